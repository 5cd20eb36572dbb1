"""τ and per-depth acceptance of several EAGLE heads for one target, on the same prompts.

    python -m eagle_mlx.benchmark heads --heads eagle_mlx/demo/head build/demo_head3/head \\
        --num-prompts 20 --max-tokens 128 --temps 0 1 --trees 16/4/4,60/7/10 --output cmp.json

The target is the demo target unless --model is given; EAGLE-1 heads on the demo target
draft over its 8192-token draft vocabulary, as the demo does. For every prompt (MT-bench
first turns and HumanEval, chat template) and temperature, plain decoding and then every
head with every tree run one after the other, so that machine noise falls on all alike; at
temperature 0 every output is checked against plain decoding. Prints, per temperature and
tree, each head's τ by dataset, the acceptance at each draft depth (of the cycles whose
accepted path reached depth d-1, the share that reached d) and tokens/s against plain.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path



def _models(args):
    """The target, its tokenizer and one EagleModel per head (with the demo's draft
    vocabulary where the target is the demo's)."""
    from ..demo import demo_draft_vocab, demo_target
    from ..errors import EagleError
    from ..heads.read import load_head
    from ..model import EagleModel, attach_draft_vocab
    from ..targets.load import load_target

    for h in args.heads:
        if not (Path(h) / "config.json").is_file():
            raise SystemExit(f"--heads: {h} is not a head folder (no config.json).")
    try:
        target, tok = load_target(args.model or str(demo_target()))
    except EagleError as e:
        raise SystemExit(str(e))
    models = []
    for h in args.heads:
        head = load_head(h, target)
        n = demo_draft_vocab(head) if not args.model else None
        if n:  # as the demo drafts
            attach_draft_vocab(head, target, tok, n)
        models.append(EagleModel(target, head, h))
    return target, tok, models


def _prompt_runs(models, tok, ids, args, trees, temp, seed) -> dict:
    """One prompt: plain decoding, then every tree with every head."""
    from .timing import run_one

    plain = run_one(models[0], tok, ids, args.max_tokens, temp, seed)
    row = {"plain": plain, "eagle": []}
    for tree in trees:
        per_head = []
        for m in models:
            r = run_one(m, tok, ids, args.max_tokens, temp, seed, tree)
            if temp == 0:
                r["identical_to_plain"] = r["tokens"] == plain["tokens"]
            r.pop("tokens")
            per_head.append(r)
        row["eagle"].append(per_head)
    plain.pop("tokens")
    return row


def _summary(runs, trees, labels) -> list:
    from .timing import depth_acceptance

    plain_tps = statistics.mean(r["plain"]["tokens_per_second"] for r in runs)
    summary = []
    for j, tree in enumerate(trees):
        for k, label in enumerate(labels):
            mine = [(r["source"], r["eagle"][j][k]) for r in runs]
            tps = statistics.mean(r["tokens_per_second"] for _, r in mine)
            summary.append({
                "tree": tree, "head": label,
                "tau": statistics.mean(r["tau"] for _, r in mine),
                "tau_by_source": {s: statistics.mean(r["tau"] for s2, r in mine if s2 == s)
                                  for s in sorted({s for s, _ in mine})},
                "depth_acceptance": depth_acceptance(
                    [a for _, r in mine for a in r["accept_lengths"]], tree["depth"]),
                "tokens_per_second": tps, "plain_tokens_per_second": plain_tps,
                "speedup": tps / plain_tps,
                "identical_to_plain": all(r.get("identical_to_plain", True) for _, r in mine),
            })
    return summary


def _print_table(summary, temp, prompts, max_tokens) -> None:
    plain_tps = summary[0]["plain_tokens_per_second"]
    print(f"\ntemperature {temp}, {prompts} prompts, {max_tokens} tokens, "
          f"plain {plain_tps:.1f} tokens/s")
    print("| tree | head | tau MT-bench | tau HumanEval | acceptance at depth 1.. | "
          "tokens/s |\n| --- | --- | --- | --- | --- | --- |")
    for s in summary:
        t = s["tree"]
        by = s["tau_by_source"]
        print(f"| {t['total_tokens']}/{t['depth']}/{t['draft_top_k']} | {s['head']} | "
              f"{by.get('mt-bench', float('nan')):.2f} | {by.get('humaneval', float('nan')):.2f} | "
              + ", ".join("-" if a is None else f"{a:.2f}" for a in s["depth_acceptance"])
              + f" | {s['tokens_per_second']:.1f} ({s['speedup']:.2f}x)"
              + ("" if s["identical_to_plain"] else " NOT identical to plain") + " |")


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark heads", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="target (default: the demo target)")
    p.add_argument("--heads", nargs="+", required=True, help="EAGLE head folders")
    p.add_argument("--num-prompts", type=int, default=20, help="per dataset")
    p.add_argument("--datasets", nargs="+", default=["mt-bench", "humaneval"],
                   choices=["mt-bench", "humaneval"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temps", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--trees", default="16/4/4,60/7/10")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="JSON report")
    args = p.parse_args(argv)
    from ..cli import chat_prompt
    from .prompts import load_prompts
    from .trees import parse_trees

    trees = parse_trees(args.trees)
    target, tok, models = _models(args)
    labels = [f"{m.head.kind} {m.head_path}" for m in models]
    prompts = load_prompts(args.datasets, args.num_prompts)
    encoded = [(src, chat_prompt(tok, [{"role": "user", "content": text}])) for src, text in prompts]
    report = {"model": str(target.path), "heads": labels, "max_tokens": args.max_tokens,
              "trees": trees, "results": {}}
    for temp in args.temps:
        runs = []  # per prompt: plain, then [tree][head]
        for i, (src, ids) in enumerate(encoded):
            row = {"source": src, **_prompt_runs(models, tok, ids, args, trees, temp,
                                                 args.seed + i)}
            runs.append(row)
            print(f"[{src} {i + 1}/{len(encoded)} temp {temp}] " + "; ".join(
                f"{t['total_tokens']}/{t['depth']}/{t['draft_top_k']}: " + ", ".join(
                    f"{r['tau']:.2f}" for r in per_head)
                for t, per_head in zip(trees, row["eagle"])), file=sys.stderr, flush=True)
        summary = _summary(runs, trees, labels)
        report["results"][str(temp)] = {"summary": summary, "prompts": runs}
        _print_table(summary, temp, len(encoded), args.max_tokens)
        if args.output:  # after each temperature, so a long run keeps what it measured
            Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
