"""Tiny models built locally with transformers (the independent reference), and the oracle."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORACLE = ROOT.parent / "shared" / "oracle"
requires_oracle = pytest.mark.skipif(
    not (ORACLE / "reference.json").is_file(),
    reason=f"the official EAGLE reference fixture is absent ({ORACLE} not found)",
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def oracle_reference() -> dict:
    with open(ORACLE / "reference.json") as f:
        return json.load(f)


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over 't3'..'t{V-1}' plus <unk>, <s>, </s> and role words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words = ["user", "assistant", "system"]
    for i in range(3, vocab_size):
        vocab[words[i - 3] if i - 3 < len(words) else f"t{i}"] = i
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


# kind -> (transformers config class, model class, config defaults): the families with
# sliding windows, attention sinks and KV sharing
OTHER_FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(head_dim=16, query_pre_attn_scalar=16)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(head_dim=16)),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                    dict(head_dim=16, global_head_dim=32, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=256)),
    # hybrid: Gated DeltaNet layers (kernel 4) with a full-attention layer every 2
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"] * 2)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"] * 2)),
}


def make_hf_model(folder: Path, kind: str = "llama", seed: int = 0, scale: float = 8.0,
                  **overrides) -> Path:
    """Save a random transformers Llama/Mixtral (float32) with a tokenizer to `folder`.

    `scale` multiplies the embedding and lm_head so greedy paths vary and top-1/top-2
    gaps stay far above float32 rounding.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    common.update(overrides)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "mixtral":
        common.setdefault("num_local_experts", 4)
        common.setdefault("num_experts_per_tok", 2)
        model = MixtralForCausalLM(MixtralConfig(**common))
    elif kind == "qwen2":  # biased q/k/v
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "qwen3":  # per-head q/k norms, explicit head_dim
        from transformers import Qwen3Config, Qwen3ForCausalLM

        common.setdefault("head_dim", 32)
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "qwen3_moe":  # q/k norms, sparse MoE blocks with top-k routing
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        common.setdefault("head_dim", 32)
        common.setdefault("num_experts", 4)
        common.setdefault("num_experts_per_tok", 2)
        common.setdefault("moe_intermediate_size", 48)
        common.setdefault("norm_topk_prob", True)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common))
    elif kind in OTHER_FAMILIES:
        import transformers

        config_class, model_class, defaults = OTHER_FAMILIES[kind]
        for k, v in defaults.items():
            common.setdefault(k, v)
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**common))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(scale)
        if not common["tie_word_embeddings"]:
            model.lm_head.weight.mul_(scale * 2)
    model = model.float().eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder, common["vocab_size"])
    return folder


def two_turn_conversations(rng, n: int, ask, answer, follow_up) -> list:
    """n ShareGPT conversations of two turns: ask(), an answer of 8-20 words, follow_up(),
    an answer of 10 (answer(k): k words), drawn in that order from `rng`."""
    return [{"id": str(i), "conversations": [
        {"from": "human", "value": ask()},
        {"from": "gpt", "value": answer(rng.randint(8, 20))},
        {"from": "human", "value": follow_up()}, {"from": "gpt", "value": answer(10)}]}
        for i in range(n)]


def continue_greedily(target, cache, logits, n: int) -> list:
    """n greedy tokens: the argmax of `logits` [V], then each next one after feeding the
    last through `target` with `cache` (what the target alone would continue with)."""
    import mlx.core as mx
    import numpy as np

    tok, out = int(np.argmax(np.array(logits))), []
    for _ in range(n):
        out.append(tok)
        h, _ = target(mx.array([[tok]]), cache)
        tok = int(np.argmax(np.array(target.lm_head(h)[0, -1])))
    return out


def tiny_llama(folder: Path, num_hidden_layers: int = 8, max_position_embeddings: int = 128,
               seed: int = 5) -> Path:
    """The tools' tiny Llama target (GQA, vocabulary 64, scaled so that greedy decoding is
    decisive): what the CLI, server and distributed tests run."""
    return make_hf_model(folder, "llama", seed=seed, num_hidden_layers=num_hidden_layers,
                         num_key_value_heads=2, vocab_size=64, scale=4.0,
                         max_position_embeddings=max_position_embeddings)


def make_eagle_head(folder: Path, target_folder: Path, kind: str = "eagle1", seed: int = 0,
                    draft_vocab_size: int = 0, std: float = 0.3, qkv_bias: bool = False,
                    hidden_size: int = 0) -> Path:
    """A random EAGLE head (published PyTorch layout) sized for the target in `target_folder`.

    qkv_bias: biased q/k/v (the Qwen2 EAGLE-1 heads); hidden_size: an EAGLE-3 head narrower
    or wider than its target (config `target_hidden_size`, its own embedding)."""
    import torch

    tcfg = json.loads((target_folder / "config.json").read_text())
    TH, V = tcfg["hidden_size"], tcfg["vocab_size"]
    H = hidden_size or TH
    nh, nkv, inter = 4, 2, 2 * H
    D = H // nh
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * std  # noqa: E731
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": inter, "num_attention_heads": nh, "num_key_value_heads": nkv,
           "vocab_size": V, "rms_norm_eps": 1e-6, "num_hidden_layers": 1,
           "max_position_embeddings": 2048, "rope_theta": 10000.0}
    if kind == "eagle1":
        cfg["bias"] = True
        p = "layers.0."
        sd = {"fc.weight": r(H, 2 * H), "fc.bias": r(H), p + "self_attn.q_proj.weight": r(H, H),
              p + "self_attn.k_proj.weight": r(nkv * D, H), p + "self_attn.v_proj.weight": r(nkv * D, H),
              p + "self_attn.o_proj.weight": r(H, H), p + "post_attention_layernorm.weight": 1 + r(H)}
        in_dims = H
    else:
        vd = draft_vocab_size or V
        cfg["draft_vocab_size"] = vd
        p = "midlayer."
        sd = {"fc.weight": r(H, 3 * TH), "norm.weight": 1 + r(H), "lm_head.weight": r(vd, H) * 10,
              p + "hidden_norm.weight": 1 + r(H), p + "input_layernorm.weight": 1 + r(H),
              p + "post_attention_layernorm.weight": 1 + r(H),
              p + "self_attn.q_proj.weight": r(H, 2 * H), p + "self_attn.k_proj.weight": r(nkv * D, 2 * H),
              p + "self_attn.v_proj.weight": r(nkv * D, 2 * H), p + "self_attn.o_proj.weight": r(H, H)}
        if vd < V:
            chosen = torch.sort(torch.randperm(V - 3, generator=g)[:vd] + 3).values
            sd["d2t"] = (chosen - torch.arange(vd)).long()
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[chosen] = True
            sd["t2d"] = t2d
        in_dims = H
        if H != TH:
            cfg["target_hidden_size"] = TH
            sd["embed_tokens.weight"] = torch.randn(V, H, generator=g)
    sd.update({p + "mlp.gate_proj.weight": r(inter, in_dims), p + "mlp.up_proj.weight": r(inter, in_dims),
               p + "mlp.down_proj.weight": r(H, inter)})
    if qkv_bias:
        cfg["qkv_bias"] = True
        sd.update({p + "self_attn.q_proj.bias": r(nh * D), p + "self_attn.k_proj.bias": r(nkv * D),
                   p + "self_attn.v_proj.bias": r(nkv * D)})
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(sd, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def numpy_sampling_distribution(logits, temp, top_p, min_p, top_k):
    """mlx-lm's make_sampler order, written independently: top-p, min-p and top-k filter
    the untempered distribution, then the temperature scales what is left."""
    import numpy as np

    lp = logits.astype(np.float64)
    lp = lp - np.log(np.exp(lp - lp.max()).sum()) - lp.max()
    keep = np.ones(lp.shape, dtype=bool)
    if 0 < top_p < 1:  # a token stays while the tokens more likely than it hold < top_p
        order = np.argsort(-lp)
        mass_before = np.concatenate([[0.0], np.cumsum(np.exp(lp[order]))[:-1]])
        keep[order[mass_before >= top_p]] = False
    if min_p > 0:
        keep &= lp >= lp.max() + np.log(min_p)
    if 0 < top_k < len(lp):
        ranked = np.argsort(-np.where(keep, lp, -np.inf))
        keep[ranked[top_k:]] = False
    z = np.where(keep, lp / temp, -np.inf)
    p = np.exp(z - z[keep].max())
    return p / p.sum()


def make_dflash_drafter(folder: Path, target_folder: Path, layer_ids=(0, 2), block_size: int = 4,
                        num_layers: int = 2, steps: int = 300, seed: int = 0,
                        version: int = 1, **overrides) -> Path:
    """A tiny DFlash (version 1) or DFlash 2 drafter made with the `dflash` package's own
    PyTorch model for the transformers target in `target_folder`, trained `steps` steps on
    the target's greedy continuations of random prompts (so that its blocks are partly
    right), saved as the published checkpoints are (config.json + model.safetensors)."""
    import torch
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_pretrained(str(target_folder), dtype=torch.float32).eval()
    tc = target.config
    V, H = tc.vocab_size, tc.hidden_size
    draft = dict(mask_token_id=V - 1, target_layer_ids=list(layer_ids), block_size=block_size)
    cfg = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=num_layers,
               num_attention_heads=4, num_key_value_heads=2, head_dim=H // 4,
               rms_norm_eps=1e-6, rope_theta=getattr(tc, "rope_theta", 1e6) or 1e6,
               max_position_embeddings=tc.max_position_embeddings)
    cfg.update(overrides)
    if cfg.get("sliding_window"):
        cfg["use_sliding_window"] = True  # (else Qwen3Config drops the window)
    cls = DFlashDraftModel
    if version == 2:
        cls = DFlash2DraftModel
        draft.update(conv_kernel_size=2, conv_group_size=H // 4, selector_rank=8,
                     selector_top_k=4)
    config = Qwen3Config(**cfg)
    config.num_target_layers = tc.num_hidden_layers
    config.dflash_config = draft
    config.block_size = block_size
    config.architectures = [cls.__name__]
    model = cls(config).float()
    if version == 2:  # (its convolutions' base kernels are left uninitialised: near identity)
        with torch.no_grad():
            for layer in model.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.normal_(0.0, 0.05)
                    conv.base_kernel[:, 0] += 1.0
    # the target's greedy continuations: sequences of 48 tokens from 6-token random prompts
    g = torch.Generator().manual_seed(seed + 1)
    seqs = torch.randint(3, V - 1, (64, 6), generator=g)
    with torch.no_grad():
        for _ in range(42):
            nxt = target(seqs).logits[:, -1].argmax(-1)
            seqs = torch.cat([seqs, nxt[:, None]], dim=1)
        out = target(seqs, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
        embed = target.get_input_embeddings().weight
    head = target.lm_head if getattr(target, "lm_head", None) is not None \
        else target.get_output_embeddings()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    T = seqs.shape[1]
    for step in range(steps):
        a = int(torch.randint(6, T - block_size, (1,), generator=g))
        rows = torch.randint(0, seqs.shape[0], (16,), generator=g)
        block = torch.full((16, block_size), V - 1)
        block[:, 0] = seqs[rows, a]
        hidden = model(position_ids=torch.arange(a + block_size)[None].expand(16, -1),
                       noise_embedding=torch.nn.functional.embedding(block, embed),
                       target_hidden=feats[rows, :a])
        logits = model.compute_logits(hidden[:, 1:], head)
        labels = seqs[rows, a + 1: a + block_size]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def make_dspark_drafter(folder: Path, target_folder: Path, dflash_folder: Path,
                        logits_start: int = 1, speculators: bool = False, seed: int = 0) -> Path:
    """A tiny DSpark drafter (DeepSpec's Qwen3 layout, or vLLM speculators' with
    `speculators`) built with mlx-dspark's own module: the backbone of the DFlash drafter in
    `dflash_folder` (trained for the target: its blocks are partly right), the target's
    embedding as its own embedding and lm_head, a random Markov head of rank 8 (small, so
    the drafts stay the backbone's) and a confidence head."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_dspark.config import DSparkConfig
    from mlx_dspark.model import DSparkDrafter

    dflash = json.loads((dflash_folder / "config.json").read_text())
    tconf = json.loads((target_folder / "config.json").read_text())
    V, H = tconf["vocab_size"], tconf["hidden_size"]
    draft = dflash["dflash_config"]
    block = draft["block_size"]
    conf = DSparkConfig(
        family="qwen3", hidden_size=H, vocab_size=V, num_hidden_layers=dflash["num_hidden_layers"],
        intermediate_size=dflash["intermediate_size"], rms_norm_eps=1e-6,
        num_attention_heads=dflash["num_attention_heads"],
        num_key_value_heads=dflash["num_key_value_heads"], head_dim=dflash["head_dim"],
        attention_k_eq_v=False, rope_theta=1e6, rope_type="default", block_size=block,
        mask_token_id=draft["mask_token_id"], logits_start=logits_start,
        target_layer_ids=list(draft["target_layer_ids"]),
        num_target_layers=tconf["num_hidden_layers"], markov_rank=8,
        final_logit_softcapping=None, mlp_activation="silu", norm_style="qwen",
        use_v_norm=False)
    mx.random.seed(seed)
    model = DSparkDrafter(conf)
    weights = dict(tree_flatten(model.parameters()))
    weights.update(mx.load(str(dflash_folder / "model.safetensors")))
    target = mx.load(str(target_folder / "model.safetensors"))
    embed = target["model.embed_tokens.weight"]
    weights["embed_tokens.weight"] = embed
    weights["lm_head.weight"] = target.get("lm_head.weight", embed)
    weights["markov_head.markov_w2.weight"] = 0.01 * weights["markov_head.markov_w2.weight"]
    model.load_weights(list(weights.items()))
    config = dict(architectures=["Qwen3DSparkModel"], model_type="qwen3", hidden_size=H,
                  vocab_size=V, num_hidden_layers=conf.num_hidden_layers,
                  intermediate_size=conf.intermediate_size,
                  num_attention_heads=conf.num_attention_heads,
                  num_key_value_heads=conf.num_key_value_heads, head_dim=conf.head_dim,
                  rms_norm_eps=1e-6, rope_theta=1e6, block_size=block,
                  mask_token_id=conf.mask_token_id, target_layer_ids=conf.target_layer_ids,
                  num_target_layers=conf.num_target_layers, markov_rank=8,
                  markov_head_type="vanilla", enable_confidence_head=True,
                  confidence_head_with_markov=True, logits_start=logits_start)
    if speculators:  # the same drafter as vLLM speculators packs it
        layer = {k: config.pop(k) for k in ("model_type", "hidden_size", "vocab_size",
                                            "num_hidden_layers", "intermediate_size",
                                            "num_attention_heads", "num_key_value_heads",
                                            "head_dim", "rms_norm_eps")}
        layer["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
        start = config.pop("logits_start")
        config = dict(speculators_model_type="dspark", transformer_layer_config=layer,
                      aux_hidden_state_layer_ids=config.pop("target_layer_ids"),
                      speculators_config={"algorithm": "dspark", "proposal_methods": [
                          {"speculative_tokens": block - start}]},
                      **{k: config[k] for k in ("block_size", "mask_token_id", "markov_rank",
                                                "markov_head_type", "enable_confidence_head",
                                                "confidence_head_with_markov")})
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def make_gemma4_assistant(folder: Path, target_folder: Path, steps: int = 0, seed: int = 0,
                          ordered: bool = False, hidden_size: int = 32, unroll: int = 3,
                          temp: float = 0.0, log=None) -> Path:
    """A tiny Gemma 4 assistant (transformers' `Gemma4AssistantForCausalLM`: 4 layers, three
    sliding and one full, reading the target's keys and values) for the transformers Gemma 4
    target in `target_folder`, trained `steps` steps on the target's continuations of random
    prompts (greedy, or sampled at `temp`) — each step `unroll` chained drafting steps from a
    random committed position, teacher-forced, as it drafts — and saved as the published ones
    are. ordered: the E2B/E4B centroid head (8 clusters, the best 2), over a random token
    ordering. log: called with each step's mean loss."""
    import torch
    from transformers import (AutoModelForCausalLM, Gemma4AssistantConfig,
                              Gemma4AssistantForCausalLM, Gemma4TextConfig)

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_pretrained(str(target_folder), dtype=torch.float32).eval()
    tc = target.config
    V = tc.vocab_size
    text = Gemma4TextConfig(
        vocab_size=V, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=tc.num_key_value_heads,
        head_dim=16, global_head_dim=32, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=tc.sliding_window, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, num_kv_shared_layers=4,
        rope_parameters=tc.rope_parameters, rms_norm_eps=1e-6, max_position_embeddings=512)
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=tc.hidden_size,
                                   use_ordered_embeddings=ordered, num_centroids=8,
                                   centroid_intermediate_top_k=2)
    model = Gemma4AssistantForCausalLM(config)
    if ordered:  # (transformers leaves the ordering zero: a permutation of the vocabulary)
        with torch.no_grad():
            model.masked_embedding.token_ordering.copy_(torch.randperm(V))
    if steps:
        g = torch.Generator().manual_seed(seed + 1)
        seqs = torch.randint(3, V - 1, (64, 6), generator=g)
        with torch.no_grad():
            for _ in range(42):
                logits = target(seqs).logits[:, -1]
                nxt = logits.argmax(-1) if temp == 0 else torch.multinomial(
                    torch.softmax(logits / temp, -1), 1, generator=g)[:, 0]
                seqs = torch.cat([seqs, nxt[:, None]], dim=1)
        embed = target.get_input_embeddings()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        T = seqs.shape[1]
        model.train()
        for _ in range(steps):
            a = int(torch.randint(6, T - unroll, (1,), generator=g))
            rows = torch.randint(0, seqs.shape[0], (16,), generator=g)
            with torch.no_grad():  # the committed state: positions before a
                out = target(seqs[rows, :a], output_hidden_states=True,
                             return_shared_kv_states=True)
                h = out.hidden_states[-1][:, -1:]
            loss = 0.0
            for k in range(unroll):
                with torch.no_grad():
                    e = embed(seqs[rows, a + k: a + k + 1])
                r = model(inputs_embeds=torch.cat([e, h], dim=-1),
                          position_ids=torch.full((16, 1), a),
                          shared_kv_states=out.shared_kv_states,
                          attention_mask=torch.ones(16, a + 1, dtype=torch.long))
                loss = loss + torch.nn.functional.cross_entropy(
                    r.logits[:, 0], seqs[rows, a + k + 1])
                h = r.last_hidden_state
            opt.zero_grad()
            loss.backward()
            opt.step()
            if log is not None:
                log(float(loss.detach()) / unroll)
    model.eval()
    model.save_pretrained(str(folder))
    return folder


def tool(name, *args, stdin=None):
    """A command-line tool's answer as a process gives it (a CompletedProcess: exit code,
    stdout, stderr), from its `main(argv)` — what its console script calls — run in this
    process (a process start costs seconds of mlx-lm's imports here)."""
    import contextlib
    import importlib
    import io

    main = importlib.import_module(f"eagle_mlx.{name}").main
    out, err, saved = io.StringIO(), io.StringIO(), sys.stdin
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # (argparse's usage errors)
                code = e.code
    finally:
        sys.stdin = saved
    return subprocess.CompletedProcess([name, *args], code or 0, out.getvalue(), err.getvalue())
