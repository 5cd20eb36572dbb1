"""Quantized KV caches (`kv_bits`, `kv_group_size`, `quantized_kv_start`, as mlx-lm's
generate_step takes them) against mlx-lm's own generate_step with the same settings; trees
keep their accepted rows in a quantized cache; sampling stays exact."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from tiny import make_eagle_head, make_hf_model, tool

import eagle_mlx
from eagle_mlx import EagleError, GenerationSettings, PromptCache
from eagle_mlx.decoding.engine import Engine, SamplingParams
from eagle_mlx.decoding.settings import KVQuantization

PROMPT = [5, 9, 13, 7, 22, 31, 40, 12, 33, 8, 19, 50]
SETTINGS = [dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0),
            dict(kv_bits=4, kv_group_size=32, quantized_kv_start=5),
            dict(kv_bits=3, kv_group_size=32, quantized_kv_start=16)]  # (switches mid-run)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A tiny Llama (EAGLE-1 head) and a tiny Qwen3 (EAGLE-3 head), key/value heads of 32."""
    root = tmp_path_factory.mktemp("kv")
    llama = make_hf_model(root / "llama", "llama", seed=5, vocab_size=64, head_dim=32,
                          num_key_value_heads=2, scale=4.0)
    qwen3 = make_hf_model(root / "qwen3", "qwen3", seed=6, vocab_size=64, num_hidden_layers=7,
                          num_key_value_heads=2, scale=4.0)
    return {"llama": (llama, make_eagle_head(root / "h1", llama, "eagle1", seed=1)),
            "qwen3": (qwen3, make_eagle_head(root / "h3", qwen3, "eagle3", seed=2))}


def mlx_lm_greedy(folder, prompt, n, **kv):
    """mlx-lm's own greedy tokens with these KV settings (its generate_step)."""
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm.load(str(folder))
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                             sampler=lambda x: mx.argmax(x, axis=-1), **kv)]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_plain_eagle_and_lookup_equal_mlx_lm_with_a_quantized_cache(pairs, name):
    """Plain decoding with kv_bits 8, 4 and 3 (the switch before the prompt's end, and in the
    middle of the generation: switched a position early or late, the 3-bit run's tokens
    differ) gives mlx-lm's generate_step's tokens with the same settings; greedy EAGLE trees
    and chains merged with lookup, auto (under costs that make speculation pay, with float
    and quantized caches alike: its head and lookup cycles run on both), and lookup alone
    give the same; the caches end quantized."""
    from mlx_lm.models.cache import QuantizedKVCache

    from eagle_mlx.decoding.adaptive import Costs

    target, head = pairs[name]
    model, tok = eagle_mlx.load(str(target), eagle=str(head), lookup=True)
    alone, _ = eagle_mlx.load(str(target), lookup=True)
    tok.eos_token_ids = set()
    cheap = Costs({1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08},
                  {"head chain 1": 0.01, "head chain 6": 0.06})
    model.measured = cheap
    for kv in SETTINGS:
        model.measured_kv[(kv["kv_bits"], kv["kv_group_size"])] = cheap
        expected = mlx_lm_greedy(target, PROMPT, 32, **kv)
        cache = PromptCache()
        plain = [t for r in eagle_mlx.stream_generate(model, tok, PROMPT, max_tokens=32,
                                                      speculate=False, prompt_cache=cache, **kv)
                 for t in r.tokens]
        assert plain == expected, kv
        assert all(isinstance(c, QuantizedKVCache) and c.bits == kv["kv_bits"]
                   for c in cache.target)
        for tree in (dict(total_tokens=10, depth=3, draft_top_k=3),
                     dict(total_tokens=5, depth=3, draft_top_k=1), {}):
            cache = PromptCache()
            rs = list(eagle_mlx.stream_generate(model, tok, PROMPT, max_tokens=32,
                                                prompt_cache=cache, **tree, **kv))
            assert [t for r in rs for t in r.tokens] == expected, (kv, tree)
            assert all(isinstance(c, QuantizedKVCache) for c in cache.target)
            if not tree:  # (auto: it speculated)
                assert set(rs[-1].passes) - {"plain"}, rs[-1].passes
        looked_up = [t for r in eagle_mlx.stream_generate(alone, tok, PROMPT, max_tokens=32,
                                                          speculate=True, **kv)
                     for t in r.tokens]
        assert looked_up == expected, kv


def test_a_kept_tree_path_is_what_feeding_it_alone_writes(pairs):
    """After a verify pass over a tree, keeping a path leaves in the quantized cache
    exactly the rows the pass wrote for those nodes (packed values, scales, biases), and
    they are what feeding the path alone writes (dequantized, within rounding)."""
    from eagle_mlx.decoding.tree import tree_from_parents

    target_dir, head = pairs["llama"]
    model, _ = eagle_mlx.load(str(target_dir))
    target = model.target
    kv = KVQuantization(4, 32, 0)
    caches = target.make_cache()
    target(mx.array([PROMPT]), caches)
    target.quantize(caches, kv)
    n = len(PROMPT)
    # root 3 with children 4, 5; 6 under 4; 7 under 6; 8 under 5
    tree = tree_from_parents(mx.array([3, 4, 5, 6, 7, 8]), mx.array([0, 0, 0, 1, 3, 2]),
                             mx.zeros((6,)), 4)
    target(tree.tokens[None], caches, positions=n + tree.depth,
           mask=mx.concatenate([mx.ones((6, n), dtype=mx.bool_), tree.anc], axis=1))
    path = [0, 1, 3, 4]
    written = [[np.array(x[..., n + i, :]) for i in path] for c in caches for x in c.keys]
    target.accept(caches, n, [n + i for i in path])
    kept = [[np.array(x[..., n + j, :]) for j in range(len(path))] for c in caches
            for x in c.keys]
    for w, k in zip(written, kept):
        for a, b in zip(w, k):
            np.testing.assert_array_equal(a, b)
    alone = target.make_cache()
    target(mx.array([PROMPT]), alone)
    target.quantize(alone, kv)
    for t in (3, 4, 6, 7):
        target(mx.array([[t]]), alone)
    for c, a in zip(caches, alone):
        assert c.offset == a.offset == n + 4
        for x, y in ((c.keys, a.keys), (c.values, a.values)):
            ours = mx.dequantize(*[p[..., n: n + 4, :] for p in x], group_size=32, bits=4)
            ref = mx.dequantize(*[p[..., n: n + 4, :] for p in y], group_size=32, bits=4)
            step = float(mx.max(mx.abs(y[1][..., n: n + 4, :])))  # (one level)
            np.testing.assert_allclose(np.array(ours), np.array(ref), atol=2 * step)


@pytest.mark.long
def test_sampling_with_a_quantized_cache_is_lossless(tmp_path):
    """The first three tokens sampled (temperature 0.7, top-k 5, top-p 0.9) through EAGLE
    trees with 4-bit caches have the distribution mlx-lm's model gives with the same
    quantized caches, enumerated exactly."""
    import mlx_lm
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache
    from test_windows import chi_square_p

    from eagle_mlx.decoding.accept import process_logits
    from eagle_mlx.decoding.steps import eagle_steps

    target_dir = make_hf_model(tmp_path / "t", "llama", seed=3, vocab_size=8, hidden_size=64,
                               head_dim=32, num_key_value_heads=2, num_hidden_layers=2,
                               scale=1.0)
    head_dir = make_eagle_head(tmp_path / "h", target_dir, "eagle1", seed=4)
    prompt, runs, temp, top_p, top_k = [1, 4, 6, 2], 300, 0.7, 0.9, 5
    kv = KVQuantization(4, 32, 0)
    model, _ = eagle_mlx.load(str(target_dir), eagle=str(head_dir))
    counts = {}
    for seed in range(runs):
        mx.random.seed(seed)
        out = []
        for step in eagle_steps(model.target, model.head, prompt,
                                SamplingParams(temp, top_p, top_k), 10, 3, 3, kv=kv):
            out += step.tokens
            if len(out) >= 3:
                break
        counts[tuple(out[:3])] = counts.get(tuple(out[:3]), 0) + 1
    reference, _ = mlx_lm.load(str(target_dir))

    def logp(logits):
        return np.array(process_logits(logits, temp, top_p, top_k))

    dist = {}
    for t1, t2 in itertools.product(range(8), repeat=2):
        cache = make_prompt_cache(reference)
        reference(mx.array([prompt[:-1]]), cache=cache)
        rows = []
        for t in (prompt[-1], t1, t2):
            maybe_quantize_kv_cache(cache, 0, 32, 4)
            rows.append(reference(mx.array([[t]]), cache=cache)[0, -1])
        lp = logp(mx.stack(rows))
        for t3 in range(8):
            dist[(t1, t2, t3)] = float(np.exp(lp[0, t1] + lp[1, t2] + lp[2, t3]))
    assert chi_square_p(counts, dist, runs) > 1e-3


def test_bad_kv_settings_are_one_sentence(pairs, tmp_path):
    from test_cli import one_sentence

    target, head = pairs["llama"]
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    for bad, match in ((dict(kv_bits=7), "kv_bits must be one of 2, 3, 4, 5, 6, 8"),
                       (dict(kv_bits=4, kv_group_size=48), "kv_group_size must be one of"),
                       (dict(kv_bits=4, quantized_kv_start=-1), "quantized_kv_start must be"),
                       (dict(kv_bits=4, kv_group_size=128), "group size of 128 .* does not "
                                                              "divide the target's key/value "
                                                              "head size 32")):
        with pytest.raises(EagleError, match=match):
            eagle_mlx.generate(model, tok, PROMPT, max_tokens=4, **bad)
    with pytest.raises(EagleError, match="a batch keeps float caches"):
        eagle_mlx.batch_generate(model, tok, [PROMPT, PROMPT[:4]], settings=[
            GenerationSettings(max_tokens=4, kv_bits=4, kv_group_size=32)] * 2)
    one_sentence(tool("generate", "--model", target, "--prompt", "t5", "--kv-bits", "9"), 2,
                 "--kv-bits must be one of")
    one_sentence(tool("generate", "--model", target, "--prompt", "t5", "--kv-group-size", "32"),
                 2, "--kv-group-size applies to a quantized KV cache; give --kv-bits too.")
    one_sentence(tool("server", "--model", target, "--kv-bits", "4", "--max-batch", "2"), 2,
                 "--kv-bits quantizes one sequence's caches")
    # (refused before the server measures or listens)
    one_sentence(tool("server", "--model", target, "--kv-bits", "4", "--kv-group-size", "128",
                      "--port", "1"), 1, "does not divide the target's key/value head size 32")


@pytest.mark.parametrize("name,match", [("gemma4_swa", "KV-shared layers"),
                                        ("gpt_oss_swa", "attention sinks")])
def test_targets_mlx_lm_cannot_quantize_refuse_kv_bits(tiny_dir, name, match):
    model, tok = eagle_mlx.load(str(tiny_dir(name)))
    with pytest.raises(EagleError, match=match):
        eagle_mlx.generate(model, tok, [5, 6, 7], max_tokens=2, kv_bits=8, kv_group_size=32)


def test_the_engine_cuts_trees_at_the_switch(pairs):
    """A tree that would reach past quantized_kv_start before the switch is cut back to the
    positions before it (no node is computed with float caches past the switch)."""
    target, head = pairs["llama"]
    model, _ = eagle_mlx.load(str(target), eagle=str(head))
    drafter = eagle_mlx.decoding.registry.head_drafter(model.head, model.target, 10, 3, 3)
    engine = Engine(model.target, drafter, SamplingParams(), 512,
                    kv=KVQuantization(4, 32, len(PROMPT) + 2))
    state = engine.new_state()
    engine.prefill(state, PROMPT)
    tree = engine.draft(state)
    assert int(tree.depth.max()) == 1  # (positions n, n + 1 only)


@pytest.mark.parametrize("kind", ["gemma3_text", "qwen3_5"])
def test_windows_and_recurrent_states_stay_float_and_trees_decode_exactly(tmp_path, kind):
    """On a target with sliding windows (Gemma 3) and a Gated DeltaNet hybrid (Qwen3.5),
    the full-attention caches are quantized and the windows and recurrent states stay as
    they are (where mlx-lm's own rotating cache cannot be quantized at all); greedy trees and
    chains decode plain decoding's tokens under the same settings."""
    from mlx_lm.models.cache import QuantizedKVCache

    from conftest import PATTERN3
    from eagle_mlx.targets.cache import RecurrentCache, WindowKVCache

    overrides = dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=32)
    if kind == "gemma3_text":
        overrides.update(num_hidden_layers=6, sliding_window=8, layer_types=PATTERN3,
                         query_pre_attn_scalar=32)
    target = make_hf_model(tmp_path / "t", kind, seed=3, vocab_size=64, scale=4.0, **overrides)
    head = make_eagle_head(tmp_path / "h", target, "eagle1", seed=1)
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=5)
    cache = PromptCache()
    plain = [t for r in eagle_mlx.stream_generate(model, tok, PROMPT, max_tokens=24,
                                                  speculate=False, prompt_cache=cache, **kv)
             for t in r.tokens]
    kinds = {type(c) for c in cache.target}
    float_kind = WindowKVCache if kind == "gemma3_text" else RecurrentCache
    assert float_kind in kinds and any(issubclass(k, QuantizedKVCache) for k in kinds), kinds
    for tree in (dict(total_tokens=10, depth=3, draft_top_k=3),
                 dict(total_tokens=5, depth=3, draft_top_k=1)):
        cache = PromptCache()
        out = [t for r in eagle_mlx.stream_generate(model, tok, PROMPT, max_tokens=24,
                                                    prompt_cache=cache, **tree, **kv)
               for t in r.tokens]
        assert out == plain, tree
        assert {type(c) for c in cache.target} == kinds


def mlx_lm_bounded(folder, prompt, n, max_kv_size):
    """mlx-lm's greedy tokens with its bounded cache (`RotatingKVCache`, the 4 first
    positions kept): through generate_step's own max_kv_size where the model makes no caches
    of its own (Qwen3), else given as the prompt cache (mlx-lm's Llama makes its own, so
    generate_step would not bound it)."""
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import RotatingKVCache

    model, _ = mlx_lm.load(str(folder))
    kw = dict(max_kv_size=max_kv_size)
    if hasattr(model, "make_cache"):
        kw = dict(prompt_cache=[RotatingKVCache(max_size=max_kv_size, keep=4)
                                for _ in model.layers])
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                             sampler=lambda x: mx.argmax(x, axis=-1), **kw)]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bounded_caches_decode_as_mlx_lms(pairs, name):
    """max_kv_size as mlx-lm means it (the 4 first positions, then a window of the latest):
    plain decoding equals mlx-lm's with its bounded cache — a prompt shorter than the bound
    and one longer (mlx-lm's prefill of a chunk past the bound attends its own way) — and
    greedy trees, chains, auto and lookup give the same, every node seeing what a one-token
    step at its position would; the bound changes the tokens (against the unbounded run)."""
    target, head = pairs[name]
    model, tok = eagle_mlx.load(str(target), eagle=str(head), lookup=True)
    alone, _ = eagle_mlx.load(str(target), lookup=True)
    tok.eos_token_ids = set()
    for prompt, bound in ((PROMPT, 16), (PROMPT * 3, 24)):
        expected = mlx_lm_bounded(target, prompt, 32, bound)
        assert expected != mlx_lm_greedy(target, prompt, 32)
        kw = dict(max_tokens=32, max_kv_size=bound)
        assert fresh(model, tok, prompt, speculate=False, **kw) == expected, bound
        for tree in (dict(total_tokens=8, depth=3, draft_top_k=2),
                     dict(total_tokens=4, depth=2, draft_top_k=1), {}):
            assert fresh(model, tok, prompt, **tree, **kw) == expected, (bound, tree)
        assert fresh(alone, tok, prompt, speculate=True, **kw) == expected, bound


def test_bounded_caches_below_at_and_far_above_the_bound(tmp_path):
    """A float32 Llama of vocabulary 1024 and its EAGLE-1 head, a bound of 40: for prompts
    shorter than the bound, as long as it and seven times it (the cache rotating from the
    prefill on), 48 greedy tokens of plain decoding, of trees 16/4/4 and 8/3/2 and of auto
    equal mlx-lm's `generate_step` over its own bounded cache (`RotatingKVCache(40, keep=4)`,
    what its `make_prompt_cache` makes for max_kv_size; mlx-lm's Llama makes caches of its
    own, for which generate_step's max_kv_size bounds nothing, so the cache is handed to it),
    and differ from its unbounded decoding."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import RotatingKVCache

    target = make_hf_model(tmp_path / "t", "llama", seed=3, num_hidden_layers=4,
                           vocab_size=1024, num_key_value_heads=2)
    head = make_eagle_head(tmp_path / "h", target, "eagle1", seed=1)
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    lm = model.target.model
    rng = np.random.default_rng(0)
    for length in (33, 40, 290):
        prompt = rng.integers(3, 1024, length).tolist()
        expected = [int(t) for t, _ in generate_step(
            mx.array(prompt), lm, max_tokens=48,
            prompt_cache=[RotatingKVCache(max_size=40, keep=4) for _ in lm.layers])]
        unbounded = [int(t) for t, _ in generate_step(mx.array(prompt), lm, max_tokens=48)]
        assert expected != unbounded, length
        for kw in (dict(speculate=False), dict(total_tokens=16, depth=4, draft_top_k=4),
                   dict(total_tokens=8, depth=3, draft_top_k=2), {}):
            assert fresh(model, tok, prompt, max_tokens=48, max_kv_size=40, **kw) == \
                expected, (length, kw)


def fresh(model, tok, prompt, **kw):
    return [t for r in eagle_mlx.stream_generate(model, tok, prompt, **kw) for t in r.tokens]


def test_bad_bounds_are_one_sentence(pairs, tiny_dir):
    from test_cli import one_sentence

    target, head = pairs["llama"]
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    for bad, match in ((dict(max_kv_size=4), "max_kv_size must be a whole number of "
                                             "positions, at least 8"),
                       (dict(max_kv_size=64, kv_bits=4, kv_group_size=32), "do not go together"),
                       (dict(max_kv_size=8, total_tokens=10, depth=6, draft_top_k=2),
                        "leaves each position a window of 4 .* less than the draft tree's 8 "
                        "levels; give at least 12")):
        with pytest.raises(EagleError, match=match):
            eagle_mlx.generate(model, tok, PROMPT, max_tokens=4, **bad)
    with pytest.raises(EagleError, match="a batch keeps every position"):
        eagle_mlx.batch_generate(model, tok, [PROMPT, PROMPT[:4]], settings=[
            GenerationSettings(max_tokens=4, max_kv_size=64)] * 2)
    windowed, wtok = eagle_mlx.load(str(tiny_dir("gemma3_swa")))
    with pytest.raises(EagleError, match="gemma3_text here has sliding windows"):
        eagle_mlx.generate(windowed, wtok, [5, 6, 7], max_tokens=2, max_kv_size=64)
    one_sentence(tool("server", "--model", target, "--max-kv-size", "64", "--max-batch", "2"),
                 2, "--max-kv-size bounds one sequence's caches")
    one_sentence(tool("generate", "--model", target, "--prompt", "t5", "--max-kv-size", "2"),
                 2, "--max-kv-size must be a whole number")


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_a_heads_draft_window_bounds_its_passes_and_changes_drafts_not_tokens(pairs, name):
    """load(..., draft_window=8) on an EAGLE-1 and an EAGLE-3 head: past a long prompt, every
    drafting pass reads at most the 8 positions before it and its own (its attention's keys),
    the drafts differ from the unwindowed head's, and the tokens are plain decoding's."""
    from eagle_mlx.decoding.registry import head_drafter
    from eagle_mlx.targets.cache import DraftWindowKVCache

    target, head = pairs[name]
    prompt = PROMPT * 3
    full, tok = eagle_mlx.load(str(target), eagle=str(head))
    windowed, _ = eagle_mlx.load(str(target), eagle=str(head), draft_window=8)
    tok.eos_token_ids = set()
    tree = dict(total_tokens=10, depth=3, draft_top_k=3)
    plain = fresh(full, tok, prompt, max_tokens=24, speculate=False)
    assert fresh(windowed, tok, prompt, max_tokens=24, **tree) == plain
    read = []
    fetch = DraftWindowKVCache.update_and_fetch

    def spy(self, keys, values):
        k, v = fetch(self, keys, values)
        read.append((keys.shape[2], k.shape[2]))
        return k, v

    drafts = []
    for model in (full, windowed):
        engine = Engine(model.target, head_drafter(model.head, model.target, 10, 3, 3),
                        SamplingParams(), 512)
        state = engine.new_state()
        engine.prefill(state, prompt)
        DraftWindowKVCache.update_and_fetch = spy
        try:
            drafts.append(engine.draft(state).tokens.tolist())
        finally:
            DraftWindowKVCache.update_and_fetch = fetch
    assert drafts[0] != drafts[1]
    assert read and all(seen <= 8 + new for new, seen in read[1:])  # (after the catch-up)
    assert read[0][1] == len(prompt)  # (the first pass: its own positions)


def test_a_windowed_heads_batch_rows_are_their_runs_alone(pairs):
    """Rows of a batch with a windowed head (drafting alone, each with its own caches) are
    their runs alone: greedy, and sampled with a seed (the same draws)."""
    target, head = pairs["llama"]
    model, tok = eagle_mlx.load(str(target), eagle=str(head), draft_window=8)
    tok.eos_token_ids = set()
    prompts = [PROMPT * 2, PROMPT[:5], PROMPT * 3]
    for s in (GenerationSettings(max_tokens=16, total_tokens=8, depth=3, draft_top_k=2),
              GenerationSettings(max_tokens=16, total_tokens=8, depth=3, draft_top_k=2,
                                 temp=0.8, seed=3)):
        alone = [fresh(model, tok, p, settings=s) for p in prompts]
        res = eagle_mlx.batch_generate(model, tok, prompts, settings=[s] * 3)
        assert [r.tokens for r in res.results] == alone, s


def test_auto_under_kv_bits_takes_the_quantized_costs_from_the_switch_on(pairs, tmp_path,
                                                                        monkeypatch):
    """With kv_bits, the costs measured with quantized caches (kept apart from the float
    ones, said in their own line) are the choices' from quantized_kv_start on: float costs
    where the head pays, quantized ones where nothing does — the head drafts before the
    switch and never after it; the tokens are plain decoding's with the same caches."""
    from eagle_mlx.costs import costs_path, model_costs
    from eagle_mlx.decoding.adaptive import Costs

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path))
    target, head = pairs["llama"]
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    kv = KVQuantization(8, 32, 0)
    said = []
    measured = model_costs(model, say=said.append, kv=kv)
    assert "8-bit KV caches" in said[0] and costs_path(model, kv) != costs_path(model)
    assert costs_path(model, kv).is_file() and measured.verify_points[0][1] > 0
    model.head.source = model.head.source.replace(held_out_top1=0.9)
    model.measured = Costs({1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08},
                           {"head chain 1": 0.01, "head chain 6": 0.06})
    model.measured_kv[(8, 32)] = Costs({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0},
                                       {"head chain 1": 0.5, "head chain 6": 3.0})
    prompt = [1, 5, 9, 13]
    settings = dict(max_tokens=40, kv_bits=8, kv_group_size=32, quantized_kv_start=20)
    plain = [t for r in eagle_mlx.stream_generate(model, tok, prompt, speculate=False,
                                                  **settings) for t in r.tokens]
    seen, n = [], len(prompt)
    for r in eagle_mlx.stream_generate(model, tok, prompt, **settings):
        seen.append((n, r.tokens, dict(r.passes)))
        n += len(r.tokens)
    assert [t for _, ts, _ in seen for t in ts] == plain
    heads = [(at, p) for (at, _, p), (_, _, before) in zip(seen[1:], seen) if
             sum(v for k, v in p.items() if k.startswith("head")) >
             sum(v for k, v in before.items() if k.startswith("head"))]
    assert heads and all(at <= 20 for at, _ in heads), seen
