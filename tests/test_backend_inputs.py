"""Inputs every backend accepts: every quantized matmul, quantized embedding, gathered (MoE)
matmul and `mx.fast` call that the engine, the drafters and the batch path make on a 4-bit
target gets inputs of ranks and kinds that mlx-lm's own forward of the same model gives
(`generate_step` and `batch_generate`, recorded through the same wrappers). A GPU backend
runs only the shapes its kernels were written for: MLX's CUDA backend failed on the 1-D and
2-D inputs the lm_head once got, so a rank mlx-lm never produces is a failure here.

The reference is mlx-lm's forward, not this package: the allowed set is read off mlx-lm's
calls on the very model under test."""

import importlib
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TINY_TARGETS  # noqa: E402
from test_mtp import add_mtp  # noqa: E402
from tiny import make_dflash_drafter, make_eagle_head, make_gemma4_assistant  # noqa: E402
from tiny import make_hf_model  # noqa: E402

import eagle_mlx  # noqa: E402

GROUP = 32  # every tiny width is a multiple of it


def _kind(a) -> str:
    if isinstance(a, mx.array):
        return f"{a.ndim}-D {'bool' if a.dtype == mx.bool_ else 'array'}"
    return "none" if a is None else (a if isinstance(a, str) else type(a).__name__)


def _offset(offset) -> str:
    """A RoPE offset: one position for all rows (mlx-lm gives an int or a 0-D array, by
    model) or one per row."""
    return "scalar" if isinstance(offset, int) or offset.ndim == 0 else _kind(offset)


# what makes a call's input acceptable: the rank of every array it reads, and the kinds of
# the mask and the RoPE offset
SIGNATURES = {
    (mx, "quantized_matmul"): lambda x, *a, **k: (_kind(x),),
    (mx, "gather_qmm"): lambda x, w, *a, lhs_indices=None, rhs_indices=None, **k:
        (_kind(x), _kind(lhs_indices), _kind(rhs_indices)),
    (mx, "dequantize"): lambda w, *a, **k: (_kind(w),),
    (mx.fast, "scaled_dot_product_attention"): lambda q, k_, v, *a, mask=None, **k:
        (_kind(q), _kind(k_), _kind(mask)),
    (mx.fast, "rope"): lambda x, *a, offset=0, **k: (_kind(x), _offset(offset)),
    (mx.fast, "rms_norm"): lambda x, *a, **k: (_kind(x),),
    (mx.fast, "layer_norm"): lambda x, *a, **k: (_kind(x),),
}


@contextmanager
def recording():
    """Every wrapped call's (function, signature), counted, while inside."""
    seen = Counter()
    saved = []
    for (module, name), sig in SIGNATURES.items():
        fn = getattr(module, name)
        saved.append((module, name, fn))

        def wrapped(*args, _fn=fn, _name=name, _sig=sig, **kwargs):
            seen[(_name,) + _sig(*args, **kwargs)] += 1
            return _fn(*args, **kwargs)

        setattr(module, name, wrapped)
    try:
        yield seen
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def quantize(model) -> None:
    """4-bit, as mlx-lm's convert quantizes: every layer that can be, whose width the group
    size divides."""
    nn.quantize(model, group_size=GROUP, bits=4,
                class_predicate=lambda p, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % GROUP == 0)


def mlx_lm_signatures(model, tokenizer, prompts) -> set:
    """What mlx-lm's own forward gives these functions on `model` (its prefill and steps
    for one sequence, and a batch of sequences of different lengths)."""
    gen = importlib.import_module("mlx_lm.generate")
    with recording() as seen:
        for _ in gen.generate_step(mx.array(prompts[0]), model, max_tokens=6):
            pass
        gen.batch_generate(model, tokenizer, prompts, max_tokens=6)
    return set(seen)


def quantized_pair(target_dir, drafter_dir=None, **kwargs):
    model, tok = eagle_mlx.load(str(target_dir), eagle=drafter_dir and str(drafter_dir),
                                dtype="stored", **kwargs)
    quantize(model.target.model)
    mx.eval(model.target.model.parameters())
    return model, tok


def check_paths(model, tok, runs) -> None:
    """Each run (name -> a function of (model, tok) that decodes) makes only calls whose
    signature mlx-lm's own forward of this model makes."""
    # (a prompt long enough that mlx-lm's MoE layers sort their tokens by expert)
    allowed = mlx_lm_signatures(model.target.model, tok, [[3 + i % 50 for i in range(40)],
                                                          [4, 6, 8, 10, 12]])
    assert any(k[0] == "quantized_matmul" for k in allowed)
    for name, run in runs.items():
        with recording() as seen:
            run(model, tok)
        assert any(k[0] == "quantized_matmul" for k in seen), name
        wrong = {k: n for k, n in seen.items() if k not in allowed}
        assert not wrong, (name, wrong, sorted(allowed))


PROMPT = "one two three one two three one two three one two"


def _gen(**kwargs):
    def run(model, tok):
        return [t for r in eagle_mlx.stream_generate(model, tok, PROMPT, max_tokens=14,
                                                     **kwargs) for t in r.tokens]
    return run


def _batch(model, tok):
    return eagle_mlx.batch_generate(model, tok, [PROMPT, "a b c d", PROMPT + " x y"],
                                    max_tokens=10, speculate=True).texts


TREE = dict(speculate=True, total_tokens=10, depth=3, draft_top_k=3)
CHAIN = dict(speculate=True, total_tokens=4, depth=3, draft_top_k=1)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("backend")


def test_eagle_heads_trees_chains_lookup_merged_and_batches(root):
    """A 4-bit Llama with EAGLE-1 and EAGLE-3 heads: prefill, trees, chains, prompt lookup
    alone and merged into the head's tree, auto, and the batch path."""
    llama = make_hf_model(root / "llama", "llama", seed=5, num_hidden_layers=7,
                          num_key_value_heads=2, vocab_size=64, scale=4.0)
    runs = {"tree": _gen(**TREE), "chain": _gen(**CHAIN), "auto": _gen(),
            "batch": _batch}
    for kind in ("eagle1", "eagle3"):
        head = make_eagle_head(root / kind, llama, kind, seed=1)
        check_paths(*quantized_pair(llama, head), runs)
    model, tok = quantized_pair(llama, root / "eagle1", lookup=True)
    check_paths(model, tok, {"merged": _gen(**TREE), "merged batch": _batch})
    model, tok = quantized_pair(llama, None, lookup=True)
    check_paths(model, tok, {"lookup": _gen(speculate=True), "plain": _gen(speculate=False)})


def test_moe_experts_take_mlx_lms_ranks(root):
    """A 4-bit Qwen3-MoE target (gathered expert matmuls) under an EAGLE-1 head's trees."""
    moe = make_hf_model(root / "moe", "qwen3_moe", seed=9, num_hidden_layers=2,
                        num_key_value_heads=2, vocab_size=64, scale=4.0)
    head = make_eagle_head(root / "hm", moe, "eagle1", seed=3)
    check_paths(*quantized_pair(moe, head), {"tree": _gen(**TREE), "batch": _batch})


def test_mtp_block_and_assistant_drafters(root):
    """The model's own MTP module (a 4-bit Qwen3.5 hybrid), a DFlash block drafter's
    DDTree (a 4-bit Qwen3) and a Gemma 4 assistant's chains (a 4-bit Gemma 4)."""
    kind, overrides = TINY_TARGETS["qwen3_5"]
    hybrid = add_mtp(make_hf_model(root / "q35", kind, seed=31, vocab_size=64, scale=4.0,
                                   **overrides), seed=5)
    check_paths(*quantized_pair(hybrid, hybrid), {"mtp tree": _gen(**TREE)})
    qwen3 = make_hf_model(root / "qwen3", "qwen3", seed=1, vocab_size=64, num_hidden_layers=3,
                          num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True,
                          scale=4.0)
    block = make_dflash_drafter(root / "dflash", qwen3, layer_ids=(0, 2), block_size=4,
                                steps=0)
    check_paths(*quantized_pair(qwen3, block), {"ddtree": _gen(speculate=True, total_tokens=8,
                                                                    depth=2, draft_top_k=3)})
    kind, overrides = TINY_TARGETS["gemma4_swa"]
    gemma4 = make_hf_model(root / "g4", kind, seed=3, vocab_size=64, scale=4.0, **overrides)
    assistant = make_gemma4_assistant(root / "assistant", gemma4)
    check_paths(*quantized_pair(gemma4, assistant), {"assistant chain": _gen(
        speculate=True), "assistant batch": _batch})


@pytest.mark.parametrize("name", ["llama3_gqa", "mistral_swa", "gpt_oss_swa", "qwen3_5"])
def test_padded_keys_plan_once_per_buffer_and_decode_mlx_lms_tokens(tiny_dir, tmp_path, name,
                                                                    monkeypatch):
    """With the keys of masked passes padded to the cache's buffer (`pads_keys`, on by
    default where MLX runs on a CUDA GPU), a tree's attention sees one key length per
    buffer instead of a new one every cycle, and greedy trees still decode mlx-lm's own
    `generate_step` tokens: full attention, sliding windows, mlx-lm's own decoder layers
    (gpt-oss, with sinks) and a hybrid's full-attention layers."""
    from eagle_mlx.targets import layers

    target_dir = tiny_dir(name)
    head = make_eagle_head(tmp_path / "h", target_dir, "eagle1", seed=2)
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(head))
    prompt = tok.encode(PROMPT)
    gen = importlib.import_module("mlx_lm.generate")
    expected = [int(t) for t, _ in gen.generate_step(mx.array(prompt), model.target.model,
                                                     max_tokens=40)]
    lengths = {}
    for pad in (False, True):
        monkeypatch.setattr(layers, "_PAD_KEYS", [pad])
        seen = lengths[pad] = set()
        sdpa = mx.fast.scaled_dot_product_attention

        def recorded(q, k, v, *args, mask=None, **kwargs):
            if q.shape[2] > 1 and isinstance(mask, mx.array):
                seen.add(k.shape[2])
            return sdpa(q, k, v, *args, mask=mask, **kwargs)

        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recorded)
        out = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=40, **TREE)
               for t in r.tokens]
        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", sdpa)
        assert out == expected, pad
    assert len(lengths[False]) > 8 and len(lengths[True]) <= 4, (sorted(lengths[False]), sorted(lengths[True]))
