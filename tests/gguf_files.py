"""GGUF files written the way llama.cpp's converter writes them, with the `gguf` package.

A tiny transformers Llama's weights go in under llama.cpp's tensor names, with Q/K rows
permuted as `convert_hf_to_gguf.py` does, each tensor in the ggml type a test asks for;
the vocabulary is a byte-level BPE trained with `tokenizers` (`gpt2`) or a SentencePiece
BPE trained with `sentencepiece` (`llama`, tokens + scores + types, no merges).
"""

import json
from pathlib import Path

import numpy as np

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")

CORPUS = """The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
In 2024, 12345 people paid $67.89 each; 3.14159 is close to pi and 1,000,000 is a million.
Café, naïve, résumé, Übermaß, straße, 東京, 北京, こんにちは, 안녕하세요, Привет мир, مرحبا, 😀 🚀 ✨.
    Indented text\twith tabs\tand   multiple   spaces.
for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }  // C code
SELECT name, age FROM users WHERE age >= 21 ORDER BY name;
Machine learning models learn patterns from data; large language models predict the next token.
Please write a short email to your colleague asking for a meeting next week about the project.
"""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_gpt2_vocab(vocab_size=400):
    """(tokens, merges) of a byte-level BPE trained on CORPUS, specials first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS] * 20, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges, tok


def train_spm_vocab(folder: Path, vocab_size=640):
    """A SentencePiece BPE model (byte fallback) trained on CORPUS; returns the processor."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    prefix = str(folder / "spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 20), model_prefix=prefix,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"], bos_id=1, eos_id=2, unk_id=0,
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", minloglevel=2)
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def _permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}


# llama.cpp's Gemma 3 names: four norms a layer ("ffn_norm" is the pre-feedforward one)
GEMMA3_NAMES = {**GGUF_NAMES, "pre_feedforward_layernorm": "ffn_norm",
                "post_attention_layernorm": "post_attention_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name.startswith("model.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        base, part = rest.rsplit(".", 1)
        names = GEMMA3_NAMES if arch == "gemma3" else GGUF_NAMES
        return f"blk.{i}.{names[base]}.{part}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def _header(path: Path, cfg: dict, arch: str):
    """A GGUFWriter with the metadata every architecture's file has, from a HF config."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny test {arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma: per layer kind, the global one here
    w.add_rope_freq_base(cfg.get("rope_theta") or rope["rope_theta"])
    if arch != "llama":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    return w


def _gpt2_vocab(w, gpt2_vocab, pre: str) -> None:
    tokens, merges, _ = gpt2_vocab
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)


def write_gguf(path: Path, hf_folder: Path, vocab: str, types=None, default="F32",
               spm_processor=None, gpt2_vocab=None, pre="gpt2", add_bos=None, arch="llama",
               raw=None):
    """Write the transformers model in `hf_folder` as a GGUF of architecture `arch`
    (llama, qwen2, qwen3, gemma3: Q/K rows permuted for llama only and Gemma's norm weights
    stored as 1 + w, as llama.cpp's converter does).

    types: {gguf tensor name (or a substring of it): ggml type name}; 2-D weights not named
    get `default`, norms stay F32 (as llama.cpp keeps them). raw: {gguf tensor name: (ggml
    type name, block bytes)} written instead of the model's values (the K-quants, which
    the gguf package cannot quantize)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_folder / "config.json").read_text())
    state = load_file(str(hf_folder / "model.safetensors"))
    T = gguf.GGMLQuantizationType
    w = _header(path, cfg, arch)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_dimension_count(head_dim)
    if vocab == "gpt2":
        _gpt2_vocab(w, gpt2_vocab, pre)
        w.add_add_bos_token(bool(add_bos))
    elif vocab == "llama":
        sp = spm_processor
        n = sp.get_piece_size()
        tokens = [sp.id_to_piece(i) for i in range(n)]

        def kind(i):
            if sp.is_unknown(i):
                return 2
            if sp.is_control(i):
                return 3
            if sp.is_byte(i):
                return 6
            if sp.is_unused(i):
                return 5
            return 4 if tokens[i] in ("<|im_start|>", "<|im_end|>") else 1

        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores([sp.get_score(i) for i in range(n)])
        w.add_token_types([kind(i) for i in range(n)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        if add_bos is not None:
            w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)
    types = types or {}
    for hf_name, arr in state.items():
        name = gguf_name(hf_name, arch)
        arr = arr.astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + 1
        if name in (raw or {}):
            qtype, data = raw[name]
            w.add_tensor(name, data, raw_dtype=T[qtype])
            continue
        if arch == "llama" and "attn_q" in name:
            arr = _permute(arr, cfg["num_attention_heads"])
        elif arch == "llama" and "attn_k" in name:
            arr = _permute(arr, cfg["num_key_value_heads"])
        if arr.ndim == 1:
            w.add_tensor(name, arr)
            continue
        tname = next((v for k, v in types.items() if k in name), default)
        qtype = T[tname]
        if tname == "F32":
            w.add_tensor(name, arr)
        elif tname == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gpt_oss_gguf(path: Path, hf_folder: Path, gpt2_vocab):
    """A transformers gpt-oss as llama.cpp's converter writes it: the fused, interleaved
    gate/up experts split into ffn_gate_exps / ffn_up_exps ([E, out, in], MXFP4 as
    `gguf` quantizes it), biases and sinks in F32, YaRN and the window in the metadata.
    Returns transformers' state dict with the experts replaced by the values the file holds
    (the `gguf` package's dequantization), for the reference model."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_folder / "config.json").read_text())
    state = load_file(str(hf_folder / "model.safetensors"))
    T = gguf.GGMLQuantizationType
    w = _header(path, cfg, "gpt-oss")
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    rope = cfg["rope_parameters"]
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_sliding_window(cfg["sliding_window"])
    _gpt2_vocab(w, gpt2_vocab, "gpt2")
    names = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias"}
    for p in "qkvo":
        for part in ("weight", "bias"):
            names[f"self_attn.{p}_proj.{part}"] = f"{'attn_output' if p == 'o' else 'attn_' + p}.{part}"
    reference = dict(state)
    for hf_name, arr in state.items():
        arr = arr.astype(np.float32)
        if not hf_name.startswith("model.layers."):
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight",
                          "model.norm.weight": "output_norm.weight",
                          "lm_head.weight": "output.weight"}[hf_name], arr)
            continue
        _, _, i, rest = hf_name.split(".", 3)
        blk = f"blk.{i}."
        if rest == "mlp.experts.gate_up_proj":  # [E, H, 2I], gate and up interleaved
            values = []
            for j, kind in ((0, "gate"), (1, "up")):
                q = gguf.quants.quantize(np.ascontiguousarray(arr[..., j::2].swapaxes(1, 2)), T.MXFP4)
                w.add_tensor(blk + f"ffn_{kind}_exps.weight", q, raw_dtype=T.MXFP4)
                values.append(gguf.quants.dequantize(q, T.MXFP4).swapaxes(1, 2))
            fused = np.empty_like(arr)
            fused[..., 0::2], fused[..., 1::2] = values
            reference[hf_name] = fused
        elif rest == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(blk + "ffn_gate_exps.bias", np.ascontiguousarray(arr[..., 0::2]))
            w.add_tensor(blk + "ffn_up_exps.bias", np.ascontiguousarray(arr[..., 1::2]))
        elif rest == "mlp.experts.down_proj":  # [E, I, H]
            q = gguf.quants.quantize(np.ascontiguousarray(arr.swapaxes(1, 2)), T.MXFP4)
            w.add_tensor(blk + "ffn_down_exps.weight", q, raw_dtype=T.MXFP4)
            reference[hf_name] = gguf.quants.dequantize(q, T.MXFP4).swapaxes(1, 2)
        elif rest == "mlp.experts.down_proj_bias":
            w.add_tensor(blk + "ffn_down_exps.bias", arr)
        else:
            w.add_tensor(blk + names[rest], arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference
