"""Building blocks of batched speculation: RoPE at per-row positions, and the ragged batch
KV cache, against the single-sequence code each row would run alone."""

import mlx.core as mx
import numpy as np
import pytest

from eagle_mlx import mlxlm
from eagle_mlx.targets.cache import RaggedKVCache, TreeKVCache
from eagle_mlx.targets.layers import apply_rope
from test_target import random_tree

ROPES = {
    "default": lambda: mlxlm.initialize_rope(16, 10000.0, False, None, 64),
    "llama3": lambda: mlxlm.initialize_rope(16, 500000.0, False, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}, 64),
    "dynamic": lambda: mlxlm.initialize_rope(16, 10000.0, False, {"rope_type": "dynamic",
                                                                  "factor": 2.0}, 20),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_per_row_positions_rotate_as_each_row_alone(kind):
    rope = ROPES[kind]()
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((3, 2, 5, 16)), mx.float32)
    positions = mx.array(rng.integers(0, 40, (3, 5)))
    got = apply_rope(rope, x, 0, positions)
    for b in range(3):
        np.testing.assert_array_equal(np.array(got[b]),
                                      np.array(apply_rope(rope, x[b: b + 1], 0, positions[b])[0]))


def attend(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)


def test_ragged_cache_attends_and_keeps_as_each_sequence_alone():
    """Three rows of different lengths: a ragged prefill, then two tree passes (trees of
    different sizes padded to one width) and per-row acceptance; every row's attention
    output and kept keys/values equal a TreeKVCache's fed that row alone."""
    rng = np.random.default_rng(1)
    H, D = 2, 16
    lengths = [5, 9, 2]
    B = len(lengths)
    batch = RaggedKVCache([0] * B)
    alone = [TreeKVCache() for _ in range(B)]

    def rand(*shape):
        return mx.array(rng.standard_normal(shape), mx.float32)

    # ragged prefill: one chunk as wide as the longest prompt; rows keep their own length
    T = max(lengths)
    q, k, v = rand(B, H, T, D), rand(B, H, T, D), rand(B, H, T, D)
    keys, values = batch.update_and_fetch(k, v)
    out = attend(q, keys, values, batch.mask())
    for b, n in enumerate(lengths):
        ak, av = alone[b].update_and_fetch(k[b: b + 1, :, :n], v[b: b + 1, :, :n])
        ref = attend(q[b: b + 1, :, :n], ak, av, "causal")
        np.testing.assert_allclose(np.array(out[b: b + 1, :, :n]), np.array(ref), atol=1e-5)
    batch.keep([list(range(n)) for n in lengths])
    for _ in range(2):
        sizes = [int(rng.integers(1, 7)) for _ in range(B)]
        T = max(sizes)
        trees = np.zeros((B, T, T), bool)
        kept = []
        for b, n in enumerate(sizes):
            parents, anc = random_tree(rng, n)
            trees[b, :n, :n] = anc
            trees[b, n:, n:] = np.eye(T - n, dtype=bool)  # padding nodes see themselves
            leaf = int(rng.integers(0, n))
            kept.append(np.flatnonzero(anc[leaf]).tolist())  # a root-to-node path
        q, k, v = rand(B, H, T, D), rand(B, H, T, D), rand(B, H, T, D)
        keys, values = batch.update_and_fetch(k, v)
        out = attend(q, keys, values, batch.mask(mx.array(trees)))
        for b, n in enumerate(sizes):
            start = alone[b].offset
            ak, av = alone[b].update_and_fetch(k[b: b + 1, :, :n], v[b: b + 1, :, :n])
            mask = mx.array(np.concatenate([np.ones((n, start), bool), trees[b, :n, :n]], 1))
            ref = attend(q[b: b + 1, :, :n], ak, av, mask)
            np.testing.assert_allclose(np.array(out[b: b + 1, :, :n]), np.array(ref), atol=1e-5)
            alone[b].keep(start, mx.array([start + i for i in kept[b]]))
        batch.keep(kept)
        for b in range(B):
            bk, bv = batch.row(b)
            n = alone[b].offset
            assert batch.lengths[b] == n
            np.testing.assert_array_equal(np.array(bk), np.array(alone[b].keys[..., :n, :]))
            np.testing.assert_array_equal(np.array(bv), np.array(alone[b].values[..., :n, :]))


def test_a_row_taken_out_of_the_batch_holds_none_of_the_batch():
    """A leaving row's cache (its next turn's) is a copy of its own positions: once the batch
    is gone, the batch's buffers are freed (a lazy copy would keep them alive until the row's
    next turn, a batch's worth of memory per waiting conversation)."""
    import gc

    B, H, T, D = 8, 4, 2048, 64
    batch = RaggedKVCache([0] * B)
    k = mx.random.normal((B, H, T, D))
    batch.update_and_fetch(k, k)
    batch.keep([list(range(T))] * B)
    mx.eval(batch.keys, batch.values)
    del k
    gc.collect()
    before = mx.get_active_memory()
    row = batch.extract(0)
    del batch
    gc.collect()
    freed = before - mx.get_active_memory()
    size = 2 * B * H * T * D * 4
    assert freed > 0.8 * size, (freed, size)
    assert row.offset == T and row.keys.shape[2] >= T
