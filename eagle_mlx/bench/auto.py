"""Adaptive speculation (the tools' default) against plain decoding, interleaved on every
prompt, one sequence at a time and in batches."""

import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

from ..tuning import machine
from .timing import timed_generation

BUSY_LOOP = ("import numpy as np\n"
             "a = np.random.default_rng(0).standard_normal((384, 384), dtype=np.float32)\n"
             "while True:\n"
             "    a = np.tanh(a @ a)\n")


@contextmanager
def busy_core():
    """A second process multiplying matrices on one thread while the block runs (the other
    core of a 2-core machine busy), stopped and reaped when it ends, whatever happened."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)  # (the loop started before anything is timed)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def costs_measured_under_load(model, batch_sizes=()):
    """`benchmark --auto --measure-under-load`: the model's costs measured afresh while
    another process loads the machine (`busy_core`) and written to the cache, and so the
    batch's costs at every size the batches of `batch_sizes` choose with; the model then
    reads them from the cache as the next run would, with the checks decoding makes of them
    (a batch's: its own cycles' timing)."""
    from ..costs import batch_costs, model_costs

    print("measuring the costs while another process multiplies matrices ...", file=sys.stderr)
    with busy_core():
        model.measured = model_costs(model, refresh=True)
        for size in batch_sizes_measured(batch_sizes):
            batch_costs(model, size, refresh=True)
    model.measured = None
    model.measured_batch.clear()
    return model.costs()


def batch_sizes_measured(batch_sizes):
    """The batch sizes whose costs batches of `batch_sizes` rows choose with as they shrink
    (the powers of two from 2 up to each)."""
    out = set()
    for b in batch_sizes:
        size = 2
        while size <= b:
            out.add(size)
            size *= 2
    return sorted(out)


def auto_report(model, tokenizer, encoded, args) -> dict:
    """Plain decoding and adaptive speculation, interleaved on every prompt at every
    temperature, `--rounds` times each, the pair's order turning every time (plain first on
    the first prompt's first round, auto on its second or the next prompt's: the machine's
    drift hits both alike); per dataset the tokens/s of each (the tokens after the prefill's
    over their time, summed over the prompts and rounds), their ratio, the median of the
    prompts' own ratios, tau, what auto chose, and whether its text is plain decoding's
    every time (greedy)."""
    costs = model.costs()
    rounds = getattr(args, "rounds", 1)
    report = {"machine": machine(), "model": str(model.target.path), "eagle": model.head_path,
              "max_tokens": args.max_tokens, "rounds": rounds, "costs": costs.asdict(),
              "temps": {}, "rechecked": [],
              "measured_under_load": bool(getattr(args, "measure_under_load", False))}
    notes = [] if costs.recheck is None else costs.recheck.notes
    for temp in args.temps:
        rows = []
        for i, (src, ids) in enumerate(encoded):
            row = {"source": src, "prompt_tokens": len(ids), "plain": [], "auto": []}
            for r in range(rounds):
                modes = (("plain", False), ("auto", "auto"))
                for name, speculate in modes[:: 1 if (i + r) % 2 == 0 else -1]:
                    row[name].append(timed_generation(
                        model, tokenizer, ids, max_tokens=args.max_tokens, temp=temp,
                        seed=args.seed + i, speculate=speculate))
            for note in notes[len(report["rechecked"]):]:  # (the costs checked in decoding)
                report["rechecked"].append({"prompt": i + 1, "temp": temp, "note": note})
                print(f"[{src} {i + 1}/{len(encoded)} temp {temp}] {note}", file=sys.stderr)
            row["identical"] = all(a["tokens"] == p["tokens"] for a in row["auto"]
                                   for p in row["plain"]) if temp == 0 else None
            row["ratio"] = _speed(row["auto"]) / _speed(row["plain"])
            rows.append(row)
            passes = _passes(row["auto"])
            print(f"[{src} {i + 1}/{len(encoded)} temp {temp}] plain "
                  f"{_speed(row['plain']):.2f} tok/s, auto {_speed(row['auto']):.2f} tok/s, "
                  f"tau {_tau(row['auto']):.2f}, {passes}"
                  + (f" ({rounds} rounds)" if rounds > 1 else ""), file=sys.stderr)
        summary = {}
        for src in dict.fromkeys(r["source"] for r in rows):
            mine = [r for r in rows if r["source"] == src]
            tps = {m: _speed([g for r in mine for g in r[m]]) for m in ("plain", "auto")}
            autos = [g for r in mine for g in r["auto"]]
            summary[src] = {
                "plain_tokens_per_second": tps["plain"], "auto_tokens_per_second": tps["auto"],
                "ratio": tps["auto"] / tps["plain"],
                "median_prompt_ratio": statistics.median(r["ratio"] for r in mine),
                "tau": _tau(autos), "passes": _passes(autos),
                "identical": all(r["identical"] for r in mine) if temp == 0 else None}
            s = summary[src]
            print(f"temp {temp} {src}: plain {s['plain_tokens_per_second']:.2f} tok/s, auto "
                  f"{s['auto_tokens_per_second']:.2f} tok/s ({s['ratio']:.2f}x; the prompts' "
                  f"median {s['median_prompt_ratio']:.2f}x), tau {s['tau']:.2f}, passes "
                  f"{s['passes']}" + ("" if temp else f", identical to plain: {s['identical']}"))
        report["temps"][str(temp)] = {"summary": summary, "prompts": rows}
    if costs.recheck is not None and costs.recheck.done and not report["rechecked"]:
        print("costs checked while decoding: as measured (passes over the costs: " + ", ".join(
            f"{n} nodes {r:.2f}x" for n, r in sorted(costs.recheck.timed.items())) + ")"
            if costs.recheck.timed else "costs checked while decoding: plain passes as measured")
    if args.batch_sizes:
        report["batch"] = auto_batch_report(model, tokenizer, encoded, args)
    return report


def _speed(runs) -> float:
    """Tokens/s of timed generations together (each one's tokens after the prefill's)."""
    return sum(len(g["tokens"]) - 1 for g in runs) / max(sum(g["seconds"] for g in runs), 1e-9)


def _tau(runs) -> float:
    return sum(len(g["tokens"]) for g in runs) / max(sum(g["target_forwards"] for g in runs), 1)


def _passes(runs) -> dict:
    out = {}
    for g in runs:
        for k, n in g["passes"].items():
            out[k] = out.get(k, 0) + n
    return out


def auto_batch_report(model, tokenizer, encoded, args) -> dict:
    """Batches of every --batch-sizes B under adaptive speculation against the same
    batches decoded plainly, greedy, interleaved (each first by turns): per dataset, its
    prompts B at a time (cycled to fill the last batch); aggregate tokens/s of each, the
    ratio, the passes auto chose and whether every row's text is plain decoding's."""
    from ..decoding.settings import GenerationSettings
    from ..generation import batch_generate

    out = {}
    for B in sorted(set(args.batch_sizes)):
        for size in batch_sizes_measured([B]):  # (a batch's costs at every size its rows
            model.costs(batch=size)             # choose with: before timing)
        per_source = {}
        for src in dict.fromkeys(src for src, _ in encoded):
            ids = [x for s, x in encoded if s == src]
            groups = [[ids[(g + j) % len(ids)] for j in range(B)]
                      for g in range(0, len(ids), B)]
            tokens = {"plain": 0, "auto": 0}
            seconds = {"plain": 0.0, "auto": 0.0}
            passes, identical = {}, True
            for i, group in enumerate(groups):
                got = {}
                for mode in (("plain", "auto") if i % 2 == 0 else ("auto", "plain")):
                    settings = GenerationSettings(max_tokens=args.max_tokens, speculate=(
                        False if mode == "plain" else "auto"))
                    start = time.perf_counter()
                    res = batch_generate(model, tokenizer, group, settings=[settings] * B,
                                         max_batch=B)
                    seconds[mode] += time.perf_counter() - start
                    tokens[mode] += res.stats["generation_tokens"]
                    got[mode] = [r.tokens for r in res.results]
                    if mode == "auto":
                        for r in res.results:
                            for k, n in r.passes.items():
                                passes[k] = passes.get(k, 0) + n
                identical = identical and got["plain"] == got["auto"]
            tps = {m: tokens[m] / max(seconds[m], 1e-9) for m in tokens}
            per_source[src] = {"plain_tokens_per_second": tps["plain"],
                               "auto_tokens_per_second": tps["auto"],
                               "ratio": tps["auto"] / max(tps["plain"], 1e-9),
                               "passes": passes, "identical": identical}
            r = per_source[src]
            print(f"batch {B} {src}: plain {tps['plain']:.2f} tok/s, auto "
                  f"{tps['auto']:.2f} tok/s ({r['ratio']:.2f}x), passes {passes}, identical "
                  f"to plain: {identical}")
        out[str(B)] = per_source
    return out
