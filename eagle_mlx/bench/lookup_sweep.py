"""Prompt lookup's settings swept on one model: tau and tokens/s of lookup alone for each
(min_match, max_draft), against plain decoding, interleaved on the same prompts.

    python -m eagle_mlx.benchmark lookup-sweep [--model M] [--num-prompts 2] [--max-tokens 64]
        [--min-match 1 2 3] [--max-draft 4 8 16]

Without --model: the demo target. Prompts: the benchmark's edit, HumanEval and MT-bench sets.
"""

import argparse
import statistics
import sys
from dataclasses import replace

import eagle_mlx
from .prompts import load_prompts
from .timing import run_one
from ..cli import chat_prompt
from ..decoding.lookup import LookupSettings


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark lookup-sweep", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-match", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--max-draft", type=int, nargs="+", default=[4, 8, 16])
    args = p.parse_args(argv)
    if args.model is None:
        from ..demo import demo_paths

        args.model = demo_paths()[0]
    model, tok = eagle_mlx.load(args.model, lookup=True)
    prompts = load_prompts(["edit", "humaneval", "mt-bench"], args.num_prompts)
    encoded = [(src, chat_prompt(tok, [{"role": "user", "content": text}])) for src, text in prompts]
    grid = [(m, d) for m in args.min_match for d in args.max_draft]
    rows = {g: [] for g in grid}
    plain = []
    for i, (src, ids) in enumerate(encoded):
        base = run_one(replace(model, lookup=None), tok, ids, args.max_tokens, 0.0, i)
        plain.append(base["tokens_per_second"])
        for m, d in grid:
            lk = replace(model, lookup=LookupSettings(min_match=m, max_draft=d))
            r = run_one(lk, tok, ids, args.max_tokens, 0.0, i, {})
            assert r["tokens"] == base["tokens"], (m, d, "differs from plain decoding")
            rows[(m, d)].append((src, r["tau"], r["tokens_per_second"]))
        print(f"prompt {i + 1}/{len(encoded)} ({src}) done", file=sys.stderr)
    plain_tps = statistics.mean(plain)
    print(f"plain decoding: {plain_tps:.1f} tokens/s over {len(encoded)} prompts")
    print("| min_match | max_draft | tau | tokens/s | x plain | edit tau | humaneval tau | "
          "mt-bench tau |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (m, d), rs in rows.items():
        tps = statistics.mean(r[2] for r in rs)
        by = {s: statistics.mean(r[1] for r in rs if r[0] == s) for s in ("edit", "humaneval",
                                                                         "mt-bench")}
        print(f"| {m} | {d} | {statistics.mean(r[1] for r in rs):.2f} | {tps:.1f} | "
              f"{tps / plain_tps:.2f} | {by['edit']:.2f} | {by['humaneval']:.2f} | "
              f"{by['mt-bench']:.2f} |")


if __name__ == "__main__":
    main()
