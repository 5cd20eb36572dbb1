"""How a sliding-window layer should keep its keys and values: the window cache
(`WindowKVCache`: the last window positions plus room, never wrapping) against a full
cache with band masks (`TreeKVCache` holding every position, the window applied by the
mask). One attention layer of a real model's shape, decoding after a long context: the
time per step (cache update + attention over what the cache returns, with the band mask)
and the bytes each cache holds, measured in one run.

    python -m eagle_mlx.benchmark window-cache                      # gpt-oss-20b's layer, W=128
    python -m eagle_mlx.benchmark window-cache --heads 32 --kv-heads 16 --head-dim 128 --window 1024
"""

import argparse
import time

import mlx.core as mx

from ..targets.cache import TreeKVCache, WindowKVCache


def run(cache, q_heads, kv_heads, dim, window, context, steps, tree, dtype):
    """Fill `context` positions, then `steps` steps of `tree` tokens each (1: decoding)."""
    rng = mx.random.key(0)
    for a in range(0, context, 2048):  # as a prefill does: chunks of 2048
        k = mx.random.normal((1, kv_heads, min(2048, context - a), dim), key=rng).astype(dtype)
        cache.update_and_fetch(k, k)
        mx.eval(cache.keys, cache.values)
    q = mx.random.normal((1, q_heads, tree, dim), key=rng).astype(dtype)
    new = mx.random.normal((1, kv_heads, tree, dim), key=rng).astype(dtype)
    times = []
    for _ in range(steps):
        n = cache.offset
        base = getattr(cache, "base_after", lambda t: 0)(tree)
        keys, values = cache.update_and_fetch(new, new)
        kpos = mx.arange(base, n + tree)
        qpos = mx.arange(n, n + tree)
        mask = (kpos[None] <= qpos[:, None]) & ((qpos[:, None] - kpos[None]) < window)
        t = time.perf_counter()
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=dim ** -0.5, mask=mask)
        mx.eval(out, cache.keys, cache.values)
        times.append(time.perf_counter() - t)
        cache.offset -= tree - 1  # keep one row, as after accepting the root alone
    times.sort()
    return times[len(times) // 2], cache.keys.nbytes + cache.values.nbytes


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark window-cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--steps", type=int, default=400, help="steps after the context (the "
                   "window cache drops old positions every ~window steps)")
    p.add_argument("--tree", type=int, default=1, help="tokens per step (1: decoding; 16: a tree)")
    p.add_argument("--dtype", default=None, choices=("float16", "float32", "bfloat16"),
                   help="default: float32 on the CPU (what targets run in there), else float16")
    a = p.parse_args(argv)
    a.dtype = a.dtype or ("float32" if mx.default_device() == mx.cpu else "float16")
    dtype = getattr(mx, a.dtype)
    print(f"layer: {a.heads} query heads, {a.kv_heads} KV heads of {a.head_dim}, window "
          f"{a.window}, {a.tree} token(s) a step, {a.dtype}, {mx.default_device()}")
    print(f"{'context':>8} {'full ms':>8} {'window ms':>9} {'ratio':>6} {'full MB':>8} {'window MB':>9}")
    for context in map(int, a.contexts.split(",")):
        full_t, full_b = run(TreeKVCache(), a.heads, a.kv_heads, a.head_dim, a.window, context,
                             a.steps, a.tree, dtype)
        win_t, win_b = run(WindowKVCache(a.window), a.heads, a.kv_heads, a.head_dim, a.window,
                           context, a.steps, a.tree, dtype)
        print(f"{context:>8} {full_t * 1e3:>8.3f} {win_t * 1e3:>9.3f} {full_t / win_t:>6.2f} "
              f"{full_b / 2**20:>8.1f} {win_b / 2**20:>9.2f}")


if __name__ == "__main__":
    main()
