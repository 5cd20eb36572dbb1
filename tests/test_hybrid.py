"""Hybrid linear-attention targets (Qwen3.5 dense and MoE, Qwen3-Next: Gated DeltaNet
layers, a full-attention layer every 2) against transformers, verified as trees."""

import mlx.core as mx
import numpy as np
import pytest

import eagle_mlx
from conftest import HYBRID_TARGETS, make_hybrids
from eagle_mlx import load_target
from eagle_mlx.targets.cache import RecurrentCache
from test_target import random_tree, tree_forward
from test_windows import hf_greedy, hf_logits, hf_model
from tiny import continue_greedily, make_eagle_head, make_hf_model

NAMES = list(HYBRID_TARGETS)


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_hidden_states_match_transformers(tiny_dir, name):
    import torch

    folder = tiny_dir(name)
    target, _ = load_target(str(folder))
    assert {type(m).__name__ for m in target.mechanisms} == {"LinearAttentionMechanism",
                                                            "AttentionMechanism"}
    ids = np.random.default_rng(0).integers(3, target.vocab_size, 30).tolist()
    with torch.no_grad():
        out = hf_model(folder)(torch.tensor([ids]), output_hidden_states=True)
    taps = tuple(range(target.num_layers))
    h, tapped = target(mx.array([ids]), taps=taps)
    np.testing.assert_allclose(np.array(target.lm_head(h)[0]), out.logits[0].numpy(), atol=1e-4,
                               rtol=0)
    for k, t in zip(taps, tapped):
        np.testing.assert_allclose(np.array(t[0]), out.hidden_states[k][0].numpy(), atol=1e-4,
                                   rtol=0)
    cache = target.make_cache()  # through the caches, in uneven chunks
    logits = []
    for a, b in [(0, 7), (7, 8), (8, 30)]:
        h, _ = target(mx.array([ids[a:b]]), cache)
        logits.append(np.array(target.lm_head(h)[0]))
    np.testing.assert_allclose(np.concatenate(logits), out.logits[0].numpy(), atol=1e-4, rtol=0)


def held(cache):
    """What a layer's cache holds: its recurrent state and window, or its keys and values."""
    if isinstance(cache, RecurrentCache):
        return cache.arrays()
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


@pytest.mark.parametrize("name", NAMES)
def test_tree_forward_equals_path_by_path_and_keeps_the_accepted_state(tiny_dir, name):
    """Every node's logits equal transformers' over prompt + its path; after keeping a path
    every layer's cache equals the cache of feeding the prompt and that path alone (states
    and convolution windows within 1e-5), and decoding goes on as transformers'."""
    folder = tiny_dir(name)
    target, _ = load_target(str(folder))
    model = hf_model(folder)
    rng = np.random.default_rng(1)
    for trial in range(3):
        prompt = rng.integers(3, target.vocab_size, 9 + trial).tolist()
        parents, anc = random_tree(rng, 14)
        tokens = rng.integers(3, target.vocab_size, len(parents)).tolist()
        cache = target.make_cache()
        target(mx.array([prompt]), cache)
        depth = int(anc.sum(1).max()) - 1
        logits = np.array(tree_forward(target, cache, tokens, anc,
                                       max_depth=depth if trial else None))
        linear = [c for c in cache if isinstance(c, RecurrentCache)]
        for i in range(len(tokens)):
            path = [tokens[j] for j in np.nonzero(anc[i])[0]]
            np.testing.assert_allclose(logits[i], hf_logits(model, prompt + path)[-1], atol=1e-4,
                                       rtol=0)
            if i % 4 == 0:  # the state node i would leave = the state of feeding its path alone
                alone = target.make_cache()
                target(mx.array([prompt + path]), alone)
                for c, a in zip(linear, [a for a in alone if isinstance(a, RecurrentCache)]):
                    np.testing.assert_allclose(np.array(c.pending[0][i]), np.array(a[1][0]),
                                               atol=1e-5, rtol=0)
        leaf = int(rng.integers(0, len(tokens)))
        kept = np.nonzero(anc[leaf])[0]
        n = len(prompt)
        target.accept(cache, n, mx.array(n + kept))
        alone = target.make_cache()
        seq = prompt + [tokens[j] for j in kept]
        target(mx.array([seq]), alone)
        for c, a in zip(cache, alone):
            assert c.offset == a.offset == len(seq)
            for x, y in zip(held(c), held(a)):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5, rtol=0)
        expected = hf_greedy(model, seq, 8)
        out = continue_greedily(target, cache, logits[leaf], 8)
        assert out == expected, (name, trial)


@pytest.fixture(scope="module")
def hybrid_pairs(tmp_path_factory):
    """Random heads for the hybrids: EAGLE-1 for each; EAGLE-3 for an 8-layer Qwen3.5."""
    root = tmp_path_factory.mktemp("hybrid")
    pairs = {}
    for name, t in make_hybrids(root, seed=13).items():
        pairs[name + "-eagle1"] = (t, make_eagle_head(root / (name + "-h1"), t, "eagle1", seed=3))
    t = make_hf_model(root / "q8", "qwen3_5", seed=14, vocab_size=64, scale=4.0, num_hidden_layers=8,
                      num_key_value_heads=2, layer_types=["linear_attention", "full_attention"] * 4)
    pairs["qwen3_5-eagle3"] = (t, make_eagle_head(root / "q8-h3", t, "eagle3", seed=4,
                                                  draft_vocab_size=40))
    return pairs


TREES = [dict(total_tokens=8, depth=2, draft_top_k=2), dict(total_tokens=30, depth=6, draft_top_k=4),
         dict(total_tokens=5, depth=4, draft_top_k=1)]  # the last: a chain


@pytest.mark.long
@pytest.mark.parametrize("pair", [n + "-eagle1" for n in NAMES] + ["qwen3_5-eagle3"])
def test_greedy_eagle_equals_transformers_greedy(hybrid_pairs, pair):
    from test_windows import greedy_against_transformers

    greedy_against_transformers(*hybrid_pairs[pair], TREES, prompt_lengths=(5, 25), n=32)


@pytest.mark.parametrize("name", NAMES)
def test_long_accepted_paths_keep_exact_states(tiny_dir, name):
    """Trees whose right branch runs up to 5 tokens deep (a drafter that knows transformers'
    continuation): the recurrent states and windows the accepted nodes leave carry the
    decoding on exactly."""
    from test_windows import foreknown_decoding

    foreknown_decoding(tiny_dir(name), prompt_len=13, n=40, seed=2)


@pytest.mark.parametrize("speculate", [True, False], ids=["eagle", "plain"])
def test_prompt_cache_second_turn_equals_a_fresh_run(hybrid_pairs, speculate):
    """A second turn that extends the first (prompt + answer) continues from the recurrent
    states the first left; one that differs inside the first starts over; both equal
    transformers on the whole prompt."""
    from eagle_mlx.decoding.steps import PromptCache

    target_dir, head_dir = hybrid_pairs["qwen3_5-eagle1"]
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(head_dir))
    tok.eos_token_ids = set()
    reference = hf_model(target_dir)
    rng = np.random.default_rng(3)
    first = rng.integers(3, 64, 12).tolist()
    pc = PromptCache()

    def run(prompt):
        return [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=12,
                                                     prompt_cache=pc, speculate=speculate)
                for t in r.tokens]

    answer = run(first)
    assert answer == hf_greedy(reference, first, 12)
    second = first + answer + rng.integers(3, 64, 5).tolist()
    assert run(second) == hf_greedy(reference, second, 12)
    assert pc.reused >= len(first) + len(answer) - 1
    edited = second[:6] + [3] + second[7:]
    assert run(edited) == hf_greedy(reference, edited, 12)
    assert pc.reused == 0


def test_a_tree_beyond_the_state_memory_bound(hybrid_pairs, monkeypatch):
    """Each node of a hybrid's tree keeps a recurrent state per linear layer: a tree asked
    for beyond the bound is refused in one sentence naming it; the default tree is cut to
    it (and still decodes as transformers)."""
    import eagle_mlx.targets.target as target_module
    from eagle_mlx import EagleError

    target_dir, head_dir = hybrid_pairs["qwen3_5-eagle1"]
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(head_dir))
    tok.eos_token_ids = set()
    per_node = model.target.node_state_bytes
    attn = model.target.layers[0].linear_attn  # 2 linear layers of [4, 16, 16] float32 states
    assert per_node == 2 * (4 * 16 * 16 * 4 + attn.conv_dim * 4)
    monkeypatch.setattr(target_module, "machine_memory", lambda: 10 * per_node * 8)
    assert model.target.tree_node_limit() == 10
    with pytest.raises(EagleError) as e:
        list(eagle_mlx.stream_generate(model, tok, [5, 6, 7], max_tokens=4, total_tokens=30,
                                       depth=4, draft_top_k=4))
    message = str(e.value)
    assert "30 nodes" in message and "at most 10 nodes" in message and "\n" not in message
    from eagle_mlx.decoding.plan import tree_plan

    assert tree_plan(model).total_tokens == 10  # the default tree, cut to the bound
    prompt = [5, 6, 7, 9, 11]
    runs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=12))
    assert [t for r in runs for t in r.tokens] == hf_greedy(hf_model(target_dir), prompt, 12)


@pytest.mark.long
def test_sampling_on_a_hybrid_is_lossless(tmp_path):
    """Qwen3.5 (a linear-attention layer, then full attention): the first three sampled
    tokens have the distribution transformers' logits give, enumerated exactly."""
    from test_windows import chi_square_against_transformers

    target_dir = make_hf_model(tmp_path / "t", "qwen3_5", seed=3, vocab_size=8, hidden_size=32,
                               intermediate_size=64, num_hidden_layers=2, scale=1.0,
                               num_key_value_heads=2, layer_types=["linear_attention",
                                                                   "full_attention"])
    head_dir = make_eagle_head(tmp_path / "h", target_dir, "eagle1", seed=4)
    assert chi_square_against_transformers(target_dir, head_dir, [1, 4, 6, 2]) > 1e-3
