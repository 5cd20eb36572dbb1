"""Continuous batching measured on one model: aggregate tokens/s of B concurrent prompts,
batched with EAGLE trees (each size given), batched plain, and one at a time, in one run
on the same prompts (every batched sequence checked against its run alone, greedy).

    python -m eagle_mlx.benchmark batch [--model M --eagle H] [--batch-sizes 1 2 4 8]
        [--max-tokens 64] [--trees 8/3/2 16/4/4] [--lookup]

Without --model: the demo pair. Prompts: the benchmark's MT-bench and HumanEval sets.
"""

import argparse
import sys
import time

import eagle_mlx
from ..generation import batch_generate
from .prompts import load_prompts
from ..cli import chat_prompt
from ..decoding.settings import GenerationSettings


def tree_settings(spec: str, max_tokens: int) -> GenerationSettings:
    if spec == "plain":
        return GenerationSettings(max_tokens=max_tokens, speculate=False)
    total, depth, k = map(int, spec.split("/"))
    return GenerationSettings(max_tokens=max_tokens, total_tokens=total, depth=depth,
                              draft_top_k=k)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark batch", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--eagle", default=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--trees", nargs="+", default=["8/3/2", "16/4/4"])
    p.add_argument("--lookup", action="store_true")
    args = p.parse_args(argv)
    if args.model is None:
        from ..demo import demo_paths

        args.model, args.eagle = demo_paths()
    model, tok = eagle_mlx.load(args.model, eagle=args.eagle, lookup=args.lookup or None)
    B_max = max(args.batch_sizes)
    texts = load_prompts(["mt-bench", "humaneval"], (B_max + 1) // 2)
    prompts = [chat_prompt(tok, [{"role": "user", "content": t}]) for _, t in texts][:B_max]
    modes = ["plain"] + args.trees
    alone = {}
    print(f"{args.model}: {len(prompts)} prompts, {args.max_tokens} tokens each, greedy",
          file=sys.stderr)
    batch_generate(model, tok, prompts[:1], settings=[tree_settings(modes[-1], 4)])  # warm up
    seconds = {}
    for m in modes:  # one at a time: each prompt alone, the reference of every batch
        s = tree_settings(m, args.max_tokens)
        runs, seconds[m] = [], []
        for ids in prompts:
            start = time.perf_counter()
            runs.append(list(eagle_mlx.stream_generate(model, tok, ids, settings=s)))
            seconds[m].append(time.perf_counter() - start)
        alone[m] = [[t for r in rs for t in r.tokens] for rs in runs]
        tau = [rs[-1].mean_accept_length for rs in runs]
        print(f"alone {m}: {sum(map(len, alone[m])) / sum(seconds[m]):.1f} tokens/s, tau "
              f"{sum(tau) / len(tau):.2f}", file=sys.stderr)

    def alone_tps(m, B):  # the same B prompts one after another
        return sum(len(x) for x in alone[m][:B]) / sum(seconds[m][:B])

    print("| batch | mode | aggregate tokens/s | x one at a time (same mode) | x plain one at a "
          "time | tau |")
    print("| --- | --- | --- | --- | --- | --- |")
    for B in args.batch_sizes:
        for m in modes:
            res = batch_generate(model, tok, prompts[:B], max_batch=B,
                                 settings=[tree_settings(m, args.max_tokens)] * B)
            for i, r in enumerate(res.results):
                assert r.tokens == alone[m][i], (B, m, i, "differs from its run alone")
            tps = res.stats["generation_tps"]
            taus = [r.mean_accept_length for r in res.results if r.mean_accept_length]
            tau = sum(taus) / len(taus) if taus else 1.0
            print(f"| {B} | {m} | {tps:.1f} | {tps / alone_tps(m, B):.2f} | "
                  f"{tps / alone_tps('plain', B):.2f} | {tau:.2f} |", flush=True)


if __name__ == "__main__":
    main()
