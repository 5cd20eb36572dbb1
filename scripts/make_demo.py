#!/usr/bin/env python3
"""Make the demo pair shipped inside eagle_mlx, from ShareGPT, on a CPU, in one command.

    python scripts/make_demo.py                 # about two hours on 2 CPU cores
    python scripts/make_demo.py --target-minutes 50 --head-minutes 25

1. a sentencepiece BPE tokenizer trained on ShareGPT text, saved in Hugging Face form
   (tokenizer.json + tokenizer.model) with a chat template;
2. a small Llama target trained from scratch on ShareGPT conversations rendered with that
   template, saved in Hugging Face form (config.json + model.safetensors) so transformers
   loads it too;
3. its EAGLE-1 head, trained with `python -m eagle_mlx.train`.

Everything lands in eagle_mlx/demo/{target,head}. For speed on Linux, preload OpenBLAS:
    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python ...
"""

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle_mlx.data import load_conversations  # noqa: E402

DEMO = ROOT / "eagle_mlx" / "demo"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>\n{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<|user|>\n{{ m['content'] }}\n"
    "{% else %}<|assistant|>\n{{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TARGET_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096,
    "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "rope_scaling": None, "tie_word_embeddings": True, "attention_bias": False,
    "mlp_bias": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "torch_dtype": "float32", "initializer_range": 0.02,
}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def english(conv) -> bool:
    text = "".join(m["content"] for m in conv)
    return len(text) > 0 and sum(c.isascii() for c in text) / len(text) > 0.97


# ------------------------------------------------------------------ 1. tokenizer

def bpe_vocab_and_merges(sp_model: Path):
    """The sentencepiece BPE model as a vocabulary and an ordered merge list: every split of
    a piece into two pieces, merges ranked by the merged piece's id (its BPE rank)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for piece, rank in vocab.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        merges += [(rank, vocab[a], vocab[b], a, b) for a, b in splits]
    merges.sort(key=lambda m: (m[0], len(m[3]), len(m[4])))
    return vocab, [(a, b) for *_, a, b in merges]


def train_tokenizer(conversations, folder: Path, vocab_size: int, corpus_chars: int):
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    text = "\n".join(m["content"] for c in conversations for m in c)[:corpus_chars]
    corpus.write_text(text)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "sp"), vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, user_defined_symbols=ROLE_TOKENS,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, split_digits=True, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=2, max_sentence_length=100000,
        input_sentence_size=300000, shuffle_input_sentence=True, minloglevel=2,
    )
    corpus.unlink()
    vocab, merges = bpe_vocab_and_merges(folder / "sp.model")
    tk = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in ("<unk>", "<s>", "</s>")])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in ROLE_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast, folder / "sp.model"


def check_tokenizer(fast, sp_model, conversations):
    """The Hugging Face tokenizer must encode exactly as sentencepiece does."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    for conv in conversations[:200]:
        for m in conv[:2]:
            t = m["content"][:2000]
            if fast.encode(t, add_special_tokens=False) != sp.encode(t):
                raise SystemExit(f"tokenizer conversion mismatch on: {t[:80]!r}")
    log("tokenizer: Hugging Face encoding equals sentencepiece's on 400 messages")


# ------------------------------------------------------------------ 2. target

def encode_stream(fast, conversations):
    ids = []
    for conv in conversations:
        ids += fast.apply_chat_template(conv, tokenize=True, return_dict=False)
    return np.array(ids, dtype=np.int32)


def train_target(stream, minutes, seq_len, batch, lr, seed):
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(TARGET_CONFIG))
    # GPT-2-style small init keeps a from-scratch model stable
    params = tree_flatten(model.parameters())
    model.load_weights([(k, (mx.random.normal(v.shape) * 0.02) if v.ndim == 2 else v)
                        for k, v in params])
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"target: {n_params / 1e6:.2f}M parameters, {len(stream) / 1e6:.1f}M training tokens")
    rng = np.random.default_rng(seed)
    held = stream[-200_000:]
    train = stream[:-200_000]

    def loss_fn(model, x, y):
        logits = model(x)
        return nn.losses.cross_entropy(logits, y, reduction="mean")

    step_fn = nn.value_and_grad(model, loss_fn)
    est_steps, warmup = 1_000_000, 200

    def lr_at(step):  # linear warm-up, then cosine decay to lr/10 over the time budget
        if step < warmup:
            return lr * (step + 1) / warmup
        t = min((step - warmup) / max(est_steps - warmup, 1), 1.0)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    opt = optim.AdamW(learning_rate=lr_at(0), betas=[0.9, 0.95], weight_decay=0.1)

    def windows(data, n):
        starts = rng.integers(0, len(data) - seq_len - 1, n)
        x = np.stack([data[s: s + seq_len] for s in starts])
        y = np.stack([data[s + 1: s + seq_len + 1] for s in starts])
        return mx.array(x), mx.array(y)

    def held_out_loss():
        r = np.random.default_rng(0)
        starts = r.integers(0, len(held) - seq_len - 1, 16)
        x = mx.array(np.stack([held[s: s + seq_len] for s in starts]))
        y = mx.array(np.stack([held[s + 1: s + seq_len + 1] for s in starts]))
        return loss_fn(model, x, y).item()

    start, step, deadline = time.time(), 0, time.time() + minutes * 60
    # the cosine decay is stretched over the time budget once the step speed is known
    while time.time() < deadline:
        x, y = windows(train, batch)
        opt.learning_rate = lr_at(step)
        loss, grads = step_fn(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        step += 1
        if step == 20:
            per_step = (time.time() - start) / 20
            est_steps = int(minutes * 60 / per_step)
            log(f"target: {per_step:.2f} s/step, about {est_steps} steps in the budget")
        if step % 200 == 0:
            log(f"target step {step}: train loss {loss.item():.3f}, held-out {held_out_loss():.3f}")
    final = held_out_loss()
    log(f"target: {step} steps, {step * batch * seq_len / 1e6:.1f}M tokens in "
        f"{(time.time() - start) / 60:.1f} min, held-out loss {final:.3f}")
    return model, {"steps": step, "tokens": step * batch * seq_len, "held_out_loss": final,
                   "minutes": (time.time() - start) / 60}


def save_target(model, fast, sp_model, folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(TARGET_CONFIG, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, indent=2) + "\n")
    fast.save_pretrained(folder)
    shutil.copy(sp_model, folder / "tokenizer.model")


# ------------------------------------------------------------------ main

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=12000)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--corpus-chars", type=int, default=20_000_000)
    p.add_argument("--target-minutes", type=float, default=80)
    p.add_argument("--head-minutes", type=float, default=35)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--head-lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=str(ROOT / "build" / "demo"), help="scratch folder")
    args = p.parse_args()

    t0 = time.time()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    conversations = [c for c in load_conversations(None) if english(c)][: args.conversations]
    (work / "data.json").write_text(json.dumps(
        [{"conversations": [{"from": "human" if m["role"] == "user" else
                             ("gpt" if m["role"] == "assistant" else "system"), "value": m["content"]}
                            for m in c]} for c in conversations]))
    log(f"{len(conversations)} English ShareGPT conversations")

    TARGET_CONFIG["vocab_size"] = args.vocab_size
    fast, sp_model = train_tokenizer(conversations, work / "tokenizer", args.vocab_size,
                                     args.corpus_chars)
    check_tokenizer(fast, sp_model, conversations)
    stream = encode_stream(fast, conversations)
    model, target_stats = train_target(stream, args.target_minutes, args.seq_len, args.batch,
                                       args.lr, args.seed)
    target_dir = work / "target"
    save_target(model, fast, sp_model, target_dir)

    head_out = work / "head_run"
    from eagle_mlx.train import main as train_main

    rc = train_main(["--model", str(target_dir), "--data", str(work / "data.json"),
                     "--out", str(head_out), "--max-steps", "1000000",
                     "--max-time", str(args.head_minutes * 60), "--lr", str(args.head_lr),
                     "--batch-size", "8", "--max-len", "384", "--eval-every", "200",
                     "--save-every", "500", "--eval-conversations", "64", "--seed", str(args.seed)])
    if rc:
        raise SystemExit(rc)
    rows = [json.loads(l) for l in (head_out / "train_log.jsonl").read_text().splitlines()]
    final = [r for r in rows if "eval_acc" in r][-1]

    shutil.rmtree(DEMO, ignore_errors=True)
    DEMO.mkdir(parents=True)
    shutil.copytree(target_dir, DEMO / "target")
    shutil.copytree(head_out / "head", DEMO / "head")
    recipe = {
        "conversations": len(conversations), "target": target_stats,
        "head": {"steps": final["step"], "held_out_top1_accuracy": final["eval_acc"],
                 "held_out_loss": final["eval_loss"], "minutes": args.head_minutes},
        "total_minutes": (time.time() - t0) / 60, "args": vars(args),
    }
    (DEMO / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    size = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    log(f"demo pair written to {DEMO} ({size / 1e6:.1f} MB) in {recipe['total_minutes']:.0f} min")


if __name__ == "__main__":
    main()
