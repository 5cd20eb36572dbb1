"""The tree tuning: every candidate tree against plain decoding on every prompt, the cycle
model calibrated from the default tree's profile, the choice (or plain decoding), the draft
vocabulary for it, and a choice per batch size."""

import statistics
import sys
import time

from ..cli import UsageError
from ..decoding.settings import GenerationSettings
from ..errors import EagleError
from ..tuning import machine
from .curves import (cost_curves, draft_seconds, drafter_kind, expected_tokens_per_second,
                     modelled_cycle)
from .timing import depth_acceptance, run_one

DEFAULT_TREES = "4/2/2,8/3/2,16/4/4,32/5/6,60/5/10"


def parse_trees(text):
    trees = []
    for part in text.split(","):
        try:
            total, depth, k = (int(x) for x in part.split("/"))
        except ValueError:
            raise UsageError(f"--trees takes TOTAL/DEPTH/TOPK entries separated by commas, "
                             f"such as {DEFAULT_TREES} (got {part!r}).") from None
        try:
            GenerationSettings(total_tokens=total, depth=depth, draft_top_k=k).check()
        except EagleError as e:
            raise UsageError(f"--trees entry {part}: {e}") from None
        if total - 1 > k + depth * k * k:
            raise UsageError(f"--trees entry {part} is not a valid tree: total tokens must be at "
                             f"most 1 + k + depth * k^2.")
        trees.append({"total_tokens": total, "depth": depth, "draft_top_k": k})
    return trees


CHAIN = {"total_tokens": 5, "depth": 4, "draft_top_k": 1}  # four drafts, one child each


def hybrid_trees(target, trees, default: bool) -> list:
    """A hybrid target's candidates: within the bound of its nodes' recurrent states, and
    (with the default candidates) a chain beside the trees, since a node costs a state in
    every linear layer there."""
    limit = target.tree_node_limit()
    if limit is None:
        return trees
    kept = [t for t in trees if t["total_tokens"] <= limit]
    if not kept and not default:
        raise UsageError(f"every --trees candidate exceeds the {limit} nodes whose recurrent "
                         f"states fit this machine's bound ({target.node_state_bytes / 2**20:.1f} "
                         "MB a node).")
    if default and CHAIN not in kept:
        kept.append(dict(CHAIN))
    return kept


def runs_of(per_prompt, trees, tree):
    j = trees.index(tree)
    return [r["eagle"][j] for r in per_prompt]


def measure_prompt(model, tokenizer, ids, args, trees, default, temp, seed, count_graph):
    """One prompt at one temperature: plain decoding, then each tree (interleaved, so the
    machine's drift hits them alike), then a profile of the default tree's cycle phases
    (`count_graph`: also count the graph operations of each phase)."""
    from ..decoding.profiling import GraphCounter, PhaseTimer

    row = {"prompt_tokens": len(ids), "temp": temp}
    row["plain"] = run_one(model, tokenizer, ids, args.max_tokens, temp, seed)
    row["eagle"] = []
    for tree in trees:
        res = run_one(model, tokenizer, ids, args.max_tokens, temp, seed, tree)
        res["tree"] = tree
        res["speedup"] = res["tokens_per_second"] / max(row["plain"]["tokens_per_second"], 1e-9)
        if temp == 0:
            res["identical_to_plain"] = res["tokens"] == row["plain"]["tokens"]
        row["eagle"].append(res)
    timer = GraphCounter() if count_graph else PhaseTimer()
    prof = run_one(model, tokenizer, ids, args.max_tokens, temp, seed, default, timer)
    graph = None
    if count_graph:
        graph = timer.per_cycle()
        prof["seconds"] -= timer.counting_seconds
    phases = dict(timer.seconds)
    phases["other"] = max(prof["seconds"] - sum(phases.values()), 0.0)
    total = sum(phases.values()) or 1.0
    row["cycle_split"] = {k: v / total for k, v in phases.items()}
    row["cycle_seconds"] = {k: v / max(prof["cycles"], 1) for k, v in phases.items()}
    row["cycle_split_tree"] = default
    for r in [row["plain"], *row["eagle"]]:
        r.pop("tokens", None)
    return row, graph


def summarise(per_prompt, trees):
    """Per tree: tau, tokens/s and measured speedup over the prompts, tau by dataset,
    identity with plain decoding, acceptance per draft depth."""
    plain_tps = statistics.mean(r["plain"]["tokens_per_second"] for r in per_prompt)
    summary = []
    for j, tree in enumerate(trees):
        runs = [r["eagle"][j] for r in per_prompt]
        tps = statistics.mean(r["tokens_per_second"] for r in runs)
        summary.append({
            "tree": tree, "tau": statistics.mean(r["tau"] for r in runs),
            "tokens_per_second": tps, "measured_speedup": tps / plain_tps,
            "tau_by_source": {s: statistics.mean(r["eagle"][j]["tau"] for r in per_prompt
                                                 if r["source"] == s)
                              for s in sorted({r["source"] for r in per_prompt})},
            "identical_to_plain": all(r.get("identical_to_plain", True) for r in runs),
            "depth_acceptance": depth_acceptance(
                [a for r in runs for a in r["accept_lengths"]], tree["depth"]),
        })
    return plain_tps, summary


def calibrate(per_prompt, trees, default, summary, verify, draft, kind: str = "head"):
    """The cycle model's constants from the default tree's profile; with the default tree
    among those measured, its measured (unsynced) cycle scales the model too."""
    per_cycle = {k: statistics.mean(r["cycle_seconds"][k] for r in per_prompt)
                 for k in per_prompt[0]["cycle_seconds"]}
    default_tau = statistics.mean(r["tau"] for r in runs_of(per_prompt, trees, default)) \
        if default in trees else summary[0]["tau"]
    calibration = {
        "draft_scale": per_cycle["draft"] / max(draft_seconds(default, default_tau, draft,
                                                              kind), 1e-9),
        "accept_seconds_per_node": per_cycle["accept"] / default["total_tokens"],
        "fixed_seconds": per_cycle["update"] + per_cycle["other"],
        "drafter": kind,  # how its draft time grows with the tree (`drafter_kind`)
    }
    if default in trees:
        real = statistics.mean(r["generation_tokens"] / max(r["tokens_per_second"], 1e-9)
                               / max(r["target_forwards"], 1)
                               for r in runs_of(per_prompt, trees, default))
        calibration["cycle_scale"] = real / modelled_cycle(default, default_tau, verify, draft,
                                                           calibration)
    return per_cycle, calibration


def choose(summary, temp, machine) -> dict:
    """The tree with the highest expected tokens/s, kept only if both its expected and its
    measured speedup are above 1 (else plain decoding is the choice)."""
    best = max(summary, key=lambda s: s["expected_speedup"])
    pays = best["expected_speedup"] > 1.0 and best["measured_speedup"] > 1.0
    return {"speculate": pays, **best["tree"], "expected_speedup": best["expected_speedup"],
            "measured_speedup": best["measured_speedup"], "tau": best["tau"], "temp": temp,
            "machine": machine, "date": time.strftime("%Y-%m-%d")}


def print_temp(temp, summary, plain_tps, graph, default):
    for row in summary:
        t = row["tree"]
        print(f"temp {temp}, tree {t['total_tokens']}/{t['depth']}/{t['draft_top_k']}: tau "
              f"{row['tau']:.2f}, {row['tokens_per_second']:.1f} tok/s (plain {plain_tps:.1f}; "
              f"{row['measured_speedup']:.2f}x, modelled {row['expected_speedup']:.2f}x); "
              "acceptance at depth 1..: " + ", ".join(
                  "-" if a is None else f"{a:.2f}" for a in row["depth_acceptance"]),
              file=sys.stderr)
    print("graph nodes per cycle (tree {total_tokens}/{depth}/{draft_top_k}): ".format(**default)
          + ", ".join(f"{k} {v:.0f}" for k, v in graph["nodes"].items())
          + f"; total {graph['total']:.0f}", file=sys.stderr)


def print_choice(choice):
    tree = f"total_tokens {choice['total_tokens']}"
    if choice["speculate"]:
        print(f"chosen tree: {tree}, depth {choice['depth']}, draft_top_k "
              f"{choice['draft_top_k']}: expected {choice['expected_speedup']:.2f}x, measured "
              f"{choice['measured_speedup']:.2f}x, tau {choice['tau']:.2f}")
    else:
        print(f"speculation does not pay on this machine: the best tree ({tree}) is expected "
              f"at {choice['expected_speedup']:.2f}x and measured at "
              f"{choice['measured_speedup']:.2f}x of plain decoding, so plain decoding is the "
              "choice.")


def measure_trees(model, tokenizer, encoded, args, trees) -> dict:
    """The report's measurements: the cost curves, then every prompt with plain decoding and
    every tree at every temperature, summarised and calibrated per temperature."""
    print(f"{len(encoded)} prompts, {len(trees)} trees, temperatures {args.temps}", file=sys.stderr)
    prefix = int(statistics.median(len(ids) for _, ids in encoded))
    sizes = sorted({1, 2, 4, 8, 16, 32, 64} | {t["total_tokens"] for t in trees})
    sizes = [k for k in sizes if k <= max(t["total_tokens"] for t in trees) or k <= 16]
    verify, draft = cost_curves(model, prefix, sizes, reps=7)
    t1 = verify[1]
    print("verify cost t(k)/t(1): " + ", ".join(f"{k}: {verify[k] / t1:.2f}" for k in sizes),
          file=sys.stderr)
    report = {"machine": machine(),
              "model": str(model.target.path), "eagle": model.head_path, "head_kind": model.head.kind,
              "max_tokens": args.max_tokens, "prompt_prefix_for_curves": prefix,
              "verify_cost_curve": {str(k): verify[k] / t1 for k in sizes},
              "draft_cost_curve": {str(k): draft[k] / t1 for k in sizes},
              "verify_seconds": {str(k): verify[k] for k in sizes},
              "prompts": [], "trees": {}, "overall": {}}
    default, graph = model.tree_settings().asdict(), None
    for temp in args.temps:
        per_prompt = []
        for i, (src, ids) in enumerate(encoded):
            row, counted = measure_prompt(model, tokenizer, ids, args, trees, default, temp,
                                          args.seed + i, count_graph=i == 0)
            graph = counted or graph
            per_prompt.append({"source": src, **row})
            best = max(row["eagle"], key=lambda r: r["speedup"])
            print(f"[{src} {i + 1}/{len(encoded)} temp {temp}] plain "
                  f"{row['plain']['tokens_per_second']:.1f} tok/s; best tree "
                  f"{best['tree']['total_tokens']}: tau {best['tau']:.2f}, "
                  f"{best['tokens_per_second']:.1f} tok/s ({best['speedup']:.2f}x)", file=sys.stderr)
        report["prompts"] += per_prompt
        # summarise and calibrate: the model's expected speedup of every tree
        plain_tps, summary = summarise(per_prompt, trees)
        per_cycle, calibration = calibrate(per_prompt, trees, default, summary, verify, draft,
                                           drafter_kind(model.head))
        for s in summary:
            s["expected_speedup"] = expected_tokens_per_second(
                s["tree"], s["tau"], verify, draft, calibration) / plain_tps
        report["trees"][str(temp)] = summary
        print_temp(temp, summary, plain_tps, graph, default)
        split = {k: statistics.mean(r["cycle_split"][k] for r in per_prompt)
                 for k in per_prompt[0]["cycle_split"]}
        report["overall"][str(temp)] = {"plain_tokens_per_second": plain_tps, "cycle_split": split,
                                        "graph_nodes_per_cycle": graph,
                                        "cycle_seconds": per_cycle, "calibration": calibration}
    return report


def choose_draft_vocab(model, tokenizer, encoded, args, tree):
    """The chosen tree with each draft vocabulary size, interleaved prompt by prompt at the
    first temperature: the size with the most tokens per second (0: the whole vocabulary)."""
    from ..model import attach_draft_vocab

    if model.head.kind != "eagle1":
        raise UsageError("--draft-vocabs applies to EAGLE-1 heads; an EAGLE-3 head drafts over "
                         "the vocabulary it was trained with.")
    drafts = {}
    for n in args.draft_vocabs:
        if n:
            try:
                attach_draft_vocab(model.head, model.target, tokenizer, n,
                                   getattr(args, "draft_vocab_data", None))
            except EagleError as e:
                raise UsageError("--draft-vocabs: " + str(e)) from None
            drafts[n] = model.head.draft
    kept = model.head.draft
    runs = {n: [] for n in args.draft_vocabs}
    temp = args.temps[0]
    for i, (_, ids) in enumerate(encoded):
        for n in args.draft_vocabs:
            model.head.use_draft_vocab(drafts.get(n))
            runs[n].append(run_one(model, tokenizer, ids, args.max_tokens, temp, args.seed + i, tree))
    model.head.use_draft_vocab(kept)
    summary = {str(n): {"tau": statistics.mean(r["tau"] for r in rs),
                        "tokens_per_second": statistics.mean(r["tokens_per_second"] for r in rs)}
               for n, rs in runs.items()}
    best = max(args.draft_vocabs, key=lambda n: summary[str(n)]["tokens_per_second"])
    print("draft vocabulary: " + ", ".join(
        f"{n or 'whole'}: tau {summary[str(n)]['tau']:.2f}, "
        f"{summary[str(n)]['tokens_per_second']:.1f} tok/s" for n in args.draft_vocabs)
        + f"; chosen {best or 'the whole vocabulary'}", file=sys.stderr)
    return best, summary


def batch_report(model, tokenizer, encoded, args, trees) -> dict:
    """Continuous batching at every --batch-sizes B: B prompts (the benchmark's, cycled)
    decoded together, plain and with every tree, greedy; aggregate tokens/s of each, and
    the choice for B: the fastest tree, or plain decoding where none beats it."""
    from ..generation import batch_generate

    out = {}
    modes = [None] + trees
    for B in sorted(set(args.batch_sizes)):
        ids = [encoded[i % len(encoded)][1] for i in range(B)]
        rows, plain_tokens = [], None
        for tree in modes:
            s = GenerationSettings(max_tokens=args.max_tokens, speculate=tree is not None,
                                   **(tree or {}))
            res = batch_generate(model, tokenizer, ids, settings=[s] * B, max_batch=B)
            tokens = [r.tokens for r in res.results]
            taus = [r.mean_accept_length for r in res.results]
            row = {"tree": tree, "tokens_per_second": res.stats["generation_tps"],
                   "tau": statistics.mean(taus) if tree else 1.0}
            if tree is None:
                plain_tokens = tokens
            else:
                row["identical_to_plain"] = tokens == plain_tokens
            rows.append(row)
        plain_tps = rows[0]["tokens_per_second"]
        for r in rows:
            r["speedup"] = r["tokens_per_second"] / max(plain_tps, 1e-9)
        best = max(rows[1:], key=lambda r: r["speedup"])
        choice = {"speculate": best["speedup"] > 1.0, **best["tree"],
                  "measured_speedup": best["speedup"], "tau": best["tau"]}
        out[str(B)] = {"rows": rows, "choice": choice}
        print(f"batch {B}: plain {plain_tps:.1f} tok/s; " + ", ".join(
            f"{r['tree']['total_tokens']}/{r['tree']['depth']}/{r['tree']['draft_top_k']} "
            f"{r['tokens_per_second']:.1f} tok/s (tau {r['tau']:.2f})" for r in rows[1:]) +
            f"; choice: {'tree ' + str(best['tree']['total_tokens']) if choice['speculate'] else 'plain'}",
            file=sys.stderr)
    return out
