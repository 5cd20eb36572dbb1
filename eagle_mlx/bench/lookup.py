"""Prompt lookup against plain decoding (and, with a head, EAGLE and both merged): tau and
tokens/s per mode, the drafts' acceptance by match length, the drafter's host time."""

import statistics
import sys
import time

import mlx.core as mx

from ..tuning import write_tuning
from .timing import run_one

def lookup_report(model, tokenizer, encoded, args) -> dict:
    """Plain, prompt lookup alone, and (with a head) EAGLE and both, interleaved on every
    prompt at every temperature: tau and tokens/s per mode and per dataset, the lookup
    drafts' acceptance by match length (the calibration merged trees rank them by), and
    the drafter's host time per cycle."""
    from dataclasses import replace

    from ..decoding.lookup import LookupDrafter, calibration
    from ..model import EagleModel

    settings = model.lookup
    counting = replace(settings, stats={})
    alone = EagleModel(model.target, lookup=counting)
    modes = {"plain": (replace(model, lookup=None), False), "lookup": (alone, True)}
    if model.head is not None:
        modes["eagle"] = (replace(model, lookup=None), True)
        modes["eagle+lookup"] = (model, True)
    report = {"settings": {"min_match": settings.min_match, "max_draft": settings.max_draft,
                           "branches": settings.branches}, "temps": {}}
    produced = []
    for temp in args.temps:
        rows = []
        for i, (src, ids) in enumerate(encoded):
            row = {"source": src}
            for name, (m, speculate) in modes.items():
                r = run_one(m, tokenizer, ids, args.max_tokens, temp, args.seed + i,
                            {} if speculate else None)
                row[name] = {"tau": r["tau"], "tokens_per_second": r["tokens_per_second"]}
                if name == "plain":  # (the first mode)
                    plain_tokens = r["tokens"]
                    produced.append(ids + plain_tokens)
                elif temp == 0:
                    row[name]["identical_to_plain"] = r["tokens"] == plain_tokens
            rows.append(row)
            print(f"[{src} {i + 1}/{len(encoded)} temp {temp}] " + ", ".join(
                f"{k} tau {v['tau']:.2f} {v['tokens_per_second']:.1f} tok/s"
                for k, v in row.items() if k != "source"), file=sys.stderr)
        summary = {}
        for name in modes:
            tps = statistics.mean(r[name]["tokens_per_second"] for r in rows)
            summary[name] = {
                "tau": statistics.mean(r[name]["tau"] for r in rows), "tokens_per_second": tps,
                "speedup": tps / statistics.mean(r["plain"]["tokens_per_second"] for r in rows),
                "by_source": {s: {"tau": statistics.mean(r[name]["tau"] for r in rows
                                                         if r["source"] == s),
                                  "tokens_per_second": statistics.mean(
                                      r[name]["tokens_per_second"] for r in rows
                                      if r["source"] == s)}
                              for s in sorted({r["source"] for r in rows})},
                "identical_to_plain": all(r[name].get("identical_to_plain", True) for r in rows)}
        report["temps"][str(temp)] = {"summary": summary, "prompts": rows}
        for name, v in summary.items():
            print(f"temp {temp} {name:>13}: tau {v['tau']:.2f}, {v['tokens_per_second']:.1f} "
                  f"tok/s ({v['speedup']:.2f}x plain)" + "".join(
                      f"; {s} tau {b['tau']:.2f} {b['tokens_per_second']:.1f} tok/s"
                      for s, b in v["by_source"].items()), file=sys.stderr)
    report["lookup_stats"] = {str(k): v for k, v in sorted(counting.stats.items())}
    report["lookup_accept"] = {str(k): v for k, v in calibration(counting.stats).items()}
    # the drafter's time per cycle: a proposal (the automaton fed one token, its branches,
    # the tree's arrays made and evaluated) after each token of every plain output, the
    # prompt fed first (a cycle proposes once and absorbs >= 1 token)
    drafter, elapsed, cycles = LookupDrafter(settings), 0.0, 0
    for seq, (_, ids) in zip(produced, encoded * len(args.temps)):
        state = drafter.new_state()
        drafter.catch_up(state, mx.array(ids[1:-1]))
        for t in seq[len(ids) - 1:]:
            t0 = time.perf_counter()
            tree = drafter.propose(state, None, mx.array([t]), mx.array(t))
            mx.eval(tree.tokens, tree.parents, tree.anc, tree.depth)
            elapsed += time.perf_counter() - t0
            cycles += 1
    report["drafter_seconds_per_cycle"] = elapsed / max(cycles, 1)
    print(f"lookup drafter: {report['drafter_seconds_per_cycle'] * 1e6:.1f} us a cycle (host); "
          f"acceptance by match length {report['lookup_accept']}", file=sys.stderr)
    return report


def save_lookup_tuning(model, report) -> None:
    if not report.get("lookup_accept"):
        return
    f = write_tuning(None, model.target.path, model.target.dtype,
                     {"lookup_accept": report["lookup_accept"]})
    print(f"saved the lookup calibration to {f}", file=sys.stderr)
