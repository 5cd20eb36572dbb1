"""Time the tree forward pass against mlx-lm's own forward over the same tokens.

    python -m eagle_mlx.benchmark forward [--hidden 512 --layers 8 --vocab 8000 --prefix 256]

A random Llama of the given shape runs T new tokens after a cached prefix, through
mlx-lm's `Model.__call__` (causal) and through `Target.__call__` with explicit per-token
positions and a mask (what a tree verify does). Prints median times and their ratio,
interleaved in one process so that machine noise hits both alike.
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from ..targets.target import Target


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark forward", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 60])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)

    from ..mlxlm import make_prompt_cache, model_module

    Model, ModelArgs = model_module("llama").Model, model_module("llama").ModelArgs

    config = {"model_type": "llama", "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "intermediate_size": args.hidden * 11 // 4, "num_attention_heads": args.hidden // 64,
              "num_key_value_heads": max(args.hidden // 128, 1), "rms_norm_eps": 1e-5,
              "vocab_size": args.vocab, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    model = Model(ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    target = Target(model, config)
    rng = np.random.default_rng(0)
    prefix = mx.array([rng.integers(0, args.vocab, args.prefix).tolist()])
    print(f"random Llama: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"prefix {args.prefix}, device {mx.default_device()}")
    for T in args.tokens:
        toks = mx.array([rng.integers(0, args.vocab, T).tolist()])
        ref_cache = make_prompt_cache(model)
        mx.eval(model(prefix, cache=ref_cache))
        cache = target.make_cache()
        mx.eval(target(prefix, cache)[0])
        mask = mx.concatenate([mx.ones((T, args.prefix), dtype=mx.bool_),
                               mx.tril(mx.ones((T, T), dtype=mx.bool_))], axis=1)
        positions = args.prefix + mx.arange(T)
        times = {"mlx-lm": [], "tree": []}
        for _ in range(args.reps):
            t = time.perf_counter()
            mx.eval(model(toks, cache=ref_cache))
            times["mlx-lm"].append(time.perf_counter() - t)
            for c in ref_cache:
                c.trim(T)
            t = time.perf_counter()
            h, _ = target(toks, cache, positions=positions, mask=mask)
            mx.eval(target.lm_head(h))
            times["tree"].append(time.perf_counter() - t)
            for c in cache:
                c.truncate(args.prefix)
        a, b = statistics.median(times["mlx-lm"]), statistics.median(times["tree"])
        print(f"T={T:3d}: mlx-lm {a * 1e3:8.2f} ms   tree forward {b * 1e3:8.2f} ms   "
              f"ratio {b / a:.3f}")


if __name__ == "__main__":
    main()
