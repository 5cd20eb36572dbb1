"""What the command-line tools share: flags, loading, prompts, the stats block, and errors
that end in one sentence, never a traceback."""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

from .errors import EagleError
from .decoding.tree import MC_SIM_7B_63


class UsageError(EagleError):
    """A bad flag value: exit code 2, as argparse uses for usage errors."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors in one line (the usage is in --help), exit code 2."""

    def error(self, message):
        print(f"error: {message} (see {self.prog} --help).", file=sys.stderr)
        raise SystemExit(2)


def run_cli(main, argv=None) -> int:
    """Run main(argv); an EagleError prints its sentence and exits 1 (2 for usage errors),
    as does a lost rank of a distributed run (at once: see below)."""
    try:
        return main(sys.argv[1:] if argv is None else argv) or 0
    except EagleError as e:
        from .distributed import errors

        print(f"error: {e}", file=errors())
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        from .distributed import peer_lost

        sentence = peer_lost(e)
        if sentence is None:
            raise
        from .distributed import errors

        print(f"error: {sentence}", file=errors(), flush=True)
        try:
            sys.stdout.flush()
        except OSError:
            pass
        # the group's threads still wait on the lost rank: an orderly interpreter exit can
        # block on them, so the process ends here (as it does when the launcher stops it)
        os._exit(1)


def started() -> None:
    """The tool's own work begins: from here Ctrl-C raises KeyboardInterrupt (a reply
    stops, a training step finishes, partial outputs are cleaned up) instead of ending
    the process at once, as it does while modules and models load."""
    from .interrupts import work_started

    work_started()


NAMED_TREES = {"mc_sim_7b_63": MC_SIM_7B_63}


def add_model_args(p: argparse.ArgumentParser) -> None:
    from .demo import DEMO_NOTE

    p.add_argument("--model", help=f"target folder, Hugging Face repo id or GGUF file "
                                   f"({DEMO_NOTE})")
    p.add_argument("--eagle", help="drafter folder or repo id, any kind: an EAGLE head in MLX "
                                   "or any published PyTorch layout, a checkpoint whose MTP "
                                   "module drafts, or a block drafter (DFlash); omitted: plain "
                                   "decoding, unless the demo target is used")
    add_dtype_arg(p)
    add_draft_vocab_args(p)
    add_lookup_args(p)


def add_lookup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup", action="store_true",
                   help="prompt lookup (drafts copied from the context, one of --speculate "
                        "auto's options) also when speculation is forced: alone (without "
                        "--eagle, and with --model) or merged into the head's tree")
    p.add_argument("--no-lookup", action="store_true",
                   help="never draft with prompt lookup (not even under --speculate auto)")
    p.add_argument("--lookup-min-match", type=int, default=None,
                   help="shortest earlier occurrence of the context's end that drafts (default 2)")
    p.add_argument("--lookup-max-draft", type=int, default=None,
                   help="most tokens a lookup branch copies (default 16)")


def lookup_from_args(args):
    """LookupSettings from --lookup and its settings (None without --lookup: lookup is one of
    adaptive speculation's options; False with --no-lookup)."""
    from .decoding.lookup import LookupSettings

    if getattr(args, "no_lookup", False):
        if getattr(args, "lookup", False):
            raise UsageError("--lookup and --no-lookup contradict each other; give one.")
        return False
    extra = {k: getattr(args, f"lookup_{k}", None) for k in ("min_match", "max_draft")}
    given = [k for k, v in extra.items() if v is not None]
    if not getattr(args, "lookup", False):
        if given:
            raise UsageError(f"--lookup-{given[0].replace('_', '-')} needs --lookup.")
        return None
    settings = LookupSettings(**{k: v for k, v in extra.items() if v is not None})
    try:
        return settings.check(name=lambda field: f"--lookup-{field.replace('_', '-')}")
    except EagleError as e:
        raise UsageError(str(e)) from None


def add_draft_vocab_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="EAGLE-1 heads: draft over the N target tokens most frequent in answers "
                        "(0: the whole vocabulary; default: the whole vocabulary, or the demo "
                        "pair's measured choice)")
    p.add_argument("--draft-vocab-data", default=None,
                   help="ShareGPT-style file to count token frequencies on (default: ShareGPT)")
    p.add_argument("--draft-window", type=int, default=None,
                   help="block drafters: keep the context of the last N positions only (long "
                        "contexts; default: the checkpoint's window, else all)")
    p.add_argument("--draft-confidence", type=float, default=None,
                   help="DSpark drafters: end each cycle's chain where its confidence head gives "
                        "it less than this chance of surviving verification (0 < P < 1)")


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    from .targets.dtypes import DTYPE_CHOICES

    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="weights at load time: auto = float32 on the CPU (dequantized: MLX's "
                        "quantized and half-precision matmuls are slow there), as stored on a GPU")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-m", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than min-p times the most likely one (0: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed (0 to 2**64 - 1)")
    p.add_argument("--system-prompt", default=None, help="system message for the chat template")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="write every generated token's log-probability and its N most likely "
                        "alternatives (0: none) on stderr after the text, as one JSON object "
                        "shaped as the completions API's `logprobs`")
    p.add_argument("--total-tokens", type=int, default=None,
                   help="nodes in the draft tree, root included (default: tuned or 16)")
    p.add_argument("--depth", type=int, default=None, help="draft tree levels (default: tuned or 4)")
    p.add_argument("--draft-top-k", type=int, default=None,
                   help="children per drafted node (default: tuned or 4)")
    p.add_argument("--tree-choices", default=None,
                   help="EAGLE-1 static tree: 'mc_sim_7b_63' or a JSON list of paths")
    add_speculate_arg(p)
    add_kv_args(p)


def add_kv_args(p: argparse.ArgumentParser) -> None:
    """mlx-lm's KV cache quantization flags, meaning what they mean there."""
    p.add_argument("--kv-bits", type=int, default=None,
                   help="quantize the KV cache to this many bits (2, 3, 4, 5, 6 or 8; default: "
                        "no quantization)")
    p.add_argument("--kv-group-size", type=int, default=None,
                   help="group size of the KV cache quantization (32, 64 or 128; default 64)")
    p.add_argument("--quantized-kv-start", type=int, default=None,
                   help="quantize the KV cache once it holds this many positions (default "
                        "5000)")
    p.add_argument("--max-kv-size", type=int, default=None,
                   help="bound the KV cache to this many positions, as mlx-lm does (the 4 "
                        "first kept, then a window of the latest; default: every position)")


def kv_settings(args) -> dict:
    """The GenerationSettings fields the KV flags give; a group size or start without
    --kv-bits is a usage error."""
    out = {} if args.max_kv_size is None else {"max_kv_size": args.max_kv_size}
    if args.kv_bits is None:
        for flag in ("kv_group_size", "quantized_kv_start"):
            if getattr(args, flag) is not None:
                raise UsageError(f"{flag_name(flag)} applies to a quantized KV cache; give "
                                 "--kv-bits too.")
        return out
    out["kv_bits"] = args.kv_bits
    if args.kv_group_size is not None:
        out["kv_group_size"] = args.kv_group_size
    if args.quantized_kv_start is not None:
        out["quantized_kv_start"] = args.quantized_kv_start
    return out


SPECULATE = {"auto": "auto", "always": True, "never": False}


def add_speculate_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculate", choices=list(SPECULATE), default="auto",
                   help="auto (default): every pass chooses plain decoding, prompt lookup or the "
                        "head's trees from this machine's measured costs and the acceptance so "
                        "far; always: the head's tree (or lookup) every pass; never: plain "
                        "decoding. Tree flags mean always, with that tree")


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def settings_from_args(args):
    """The GenerationSettings the sampling and tree flags ask for, checked: a bad value is
    one sentence naming its flag, exit code 2, before anything loads."""
    from .decoding.settings import GenerationSettings

    tree_choices = None if args.tree_choices is None else parse_tree_choices(args.tree_choices)
    settings = GenerationSettings(
        max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, total_tokens=args.total_tokens, depth=args.depth,
        draft_top_k=args.draft_top_k, tree_choices=tree_choices,
        speculate=SPECULATE[args.speculate], logprobs=args.logprobs, **kv_settings(args))
    try:
        return settings.check(name=flag_name)
    except EagleError as e:
        raise UsageError(str(e)) from None


def continuation(tokenizer, messages, use_template: bool, at: int = -1):
    """The tokens of a conversation that goes on after a cached prompt (mlx-lm's reading of
    `--prompt-cache-file`): with the chat template, the rendered conversation from where the
    text of message `at` starts (the cache holds what comes before it: that message left
    open, `cache_prompt`'s document in it); else the messages' text from it on."""
    from .decoding.plan import encode_prompt

    if not (use_template and getattr(tokenizer, "chat_template", None)):
        return encode_prompt(tokenizer, "\n".join(m["content"] for m in messages[at:]))
    at = at % len(messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    marked = [*messages[:at], {**messages[at], "content": "<query>"}, *messages[at + 1:]]
    probe = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text[probe.index("<query>"):], add_special_tokens=False))


def parse_tree_choices(text: str):
    if text in NAMED_TREES:
        return NAMED_TREES[text]
    try:
        choices = json.loads(text)
    except json.JSONDecodeError:
        raise UsageError(
            f"--tree-choices must be {', '.join(NAMED_TREES)} or a JSON list of paths such as "
            f"[[0],[1],[0,0]] (got {text!r})."
        ) from None
    return choices


def text_arg(text: str, flag: str) -> str:
    """A text flag (argv is decoded with surrogate escapes): refuse bytes that are not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{flag} is not valid UTF-8 text.") from None
    return text


def read_stdin(flag: str) -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{flag} - read bytes from stdin that are not valid UTF-8 text.") from None


def load_from_args(args):
    """Load the model named by --model/--eagle, or the shipped demo pair."""
    from . import distributed
    from .demo import demo_draft_vocab, demo_paths
    from .model import load

    model_path, eagle_path = args.model, args.eagle
    draft_vocab = getattr(args, "draft_vocab", None)
    if draft_vocab is not None and draft_vocab < 0:
        raise UsageError(f"--draft-vocab must be 0 (the whole vocabulary) or positive "
                         f"(got {draft_vocab}).")
    lookup = lookup_from_args(args)
    window = getattr(args, "draft_window", None)
    if window is not None and window < 1:
        raise UsageError(f"--draft-window must be a positive number of positions (got {window}).")
    confidence = getattr(args, "draft_confidence", None)
    if confidence is not None and not 0 < confidence < 1:
        raise UsageError(f"--draft-confidence must be a probability between 0 and 1 (got "
                         f"{confidence}).")
    demo_vocab = False  # the demo's EAGLE-1 head drafts over its measured vocabulary
    if model_path is None:
        model_path, demo_head = demo_paths()
        demo_vocab = draft_vocab is None and eagle_path is None
        eagle_path = eagle_path or demo_head
    group = distributed.group()  # under mlx.launch: the target sharded over the ranks
    distributed.silence_other_ranks(group)
    # an explicit --draft-vocab 0 also overrides the benchmark's tuned choice
    model, tokenizer = load(model_path, eagle=eagle_path, dtype=args.dtype,
                            draft_vocab=0 if draft_vocab == 0 else None, group=group,
                            lookup=lookup, draft_window=window, draft_confidence=confidence)
    if demo_vocab:
        draft_vocab = demo_draft_vocab(model.head)
    if draft_vocab and model.head is not None:
        from .model import attach_draft_vocab

        data = getattr(args, "draft_vocab_data", None)
        if data is not None and not Path(data).is_file():
            raise EagleError(f"--draft-vocab-data file {data} does not exist.")
        try:
            attach_draft_vocab(model.head, model.target, tokenizer, draft_vocab, data)
        except EagleError as e:
            if str(e).startswith("draft_vocab"):
                raise UsageError("--" + str(e).replace("_", "-", 1)) from None
            raise
    started()
    return model, tokenizer


def describe_mode(model, settings) -> str:
    """What a generation with these settings runs: plain decoding or the tree actually used."""
    from .decoding.plan import tree_plan

    explicit = any(getattr(settings, k) is not None for k in
                   ("total_tokens", "depth", "draft_top_k", "tree_choices"))
    if settings.speculate == "auto" and not explicit and model.group is None:
        drafts = ["prompt lookup"] if model.auto_lookup is not None else []
        if model.head is not None:
            drafts.append(f"{describe_head(model.head)}: chains and trees")
        if not drafts:
            return "plain decoding (no head, and --no-lookup)"
        return ("auto: every pass chooses plain decoding, " + " or ".join(drafts) +
                ", from this machine's measured costs and the acceptance so far")
    lookup = getattr(model, "lookup", None)
    tree = None if model.head is None else tree_plan(
        model, settings.total_tokens, settings.depth, settings.draft_top_k, settings.tree_choices)
    if lookup is not None and tree is None and settings.speculate is not False:
        why = "" if model.head is None else " (the benchmark found the head's trees do not pay here)"
        return (f"prompt lookup alone: up to {lookup.branches} branches of {lookup.max_draft} "
                f"tokens after matches of {lookup.min_match}+ tokens{why}")
    if tree is None:
        if model.head is not None:
            return "plain decoding: the benchmark found that speculation does not pay here"
        return "plain decoding"
    if tree.static:
        shape = (f"static tree of {tree.total_tokens} nodes, depth {tree.depth}, "
                 f"draft_top_k {tree.draft_top_k}")
    else:
        shape = (f"dynamic tree: total_tokens {tree.total_tokens}, depth {tree.depth}, "
                 f"draft_top_k {tree.draft_top_k}")
    source = "tuned" if model.tuning and model.tuning.get("speculate", True) else "default"
    merged = " with prompt lookup branches in its budget" if lookup is not None else ""
    return f"{describe_head(model.head)}, {shape}{merged} ({'flags' if explicit else source})"


def describe_costs(model, settings) -> Optional[str]:
    """This machine's measured costs, where adaptive speculation uses them (measured now if
    they were not yet): each pass's seconds by tree size, and what the head's drafting adds."""
    if model.group is not None or settings.speculate != "auto" or any(
            getattr(settings, k) is not None for k in
            ("total_tokens", "depth", "draft_top_k", "tree_choices")):
        return None
    costs = model.costs(settings.kv)
    verify = ", ".join(f"{n} {s * 1e3:.1f}" for n, s in costs.verify_points)
    draft = ", ".join(f"{k} +{s * 1e3:.1f}" for k, s in costs.draft_costs.items())
    text = f"costs, ms a pass by nodes: {verify}" + (f"; drafting: {draft}" if draft else "")
    if costs.longer is not None:
        text += (f"; each position of context adds {costs.grow_fixed * 1e6:.2f} us + "
                 f"{costs.grow_node * 1e6:.2f} us a node to a pass"
                 + (f", {costs.grow_level * 1e6:.2f} us a drafted level" if draft else "")
                 + f" (measured at {costs.at} and {costs.longer['at']} positions)")
    return text


def describe_head(head) -> str:
    """The head's kind, the layout it was read from and the target layers it reads."""
    layout = head.source.layout
    if getattr(head, "reads_kv", False):
        return f"Gemma 4 assistant ({head.num_layers} layers)"
    if getattr(head, "block", False):
        from .heads.dflash import head_name

        text = f"{head_name(head)} drafter (blocks of {head.block_size})"
    else:
        text = f"{head.kind} head" + (f" ({layout} layout)" if layout and layout != "eagle_mlx"
                                      else "")
    taps = head.aux_layers
    return text + (f", reading target layers {list(taps)}" if taps else "")


def chat_prompt(tokenizer, messages, use_template: bool = True):
    """Token ids of a conversation: the chat template when the tokenizer has one, else the
    messages' text, one per line."""
    if use_template and getattr(tokenizer, "chat_template", None):
        from .training.data import template_ids

        return template_ids(tokenizer, messages, True)
    from .decoding.plan import encode_prompt

    return encode_prompt(tokenizer, "\n".join(m["content"] for m in messages))


def speculation_summary(r, costs=None) -> str:
    """What adaptive speculation chose: `auto, 31 of 62 passes speculated (lookup 24, head
    7), tau 2.10` (the prefill's pass not counted), and with the machine's `costs` why: what
    a pass over more tokens costs here, in plain passes."""
    total = sum(r.passes.values())
    drafted = {k: n for k, n in r.passes.items() if k != "plain"}
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(drafted.items(), key=lambda x: -x[1]))
    text = (f"auto, {sum(drafted.values())} of {total} passes speculated"
            + (f" ({kinds})" if kinds else "") + f", tau {r.mean_accept_length:.2f}")
    if costs is not None:
        context = r.prompt_tokens + r.generation_tokens
        plain = costs.verify(1, context)
        text += "; a pass over 2, 4, 8 tokens costs " + ", ".join(
            f"{costs.verify(n, context) / plain:.1f}" for n in (2, 4, 8)) + \
            f" plain passes here at {context} positions"
    return text


def print_stats(r, file=None, costs=None) -> None:
    file = file or sys.stdout  # the stream of the moment (a caller may have redirected it)
    print("==========", file=file)
    print(f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec", file=file)
    print(f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec",
          file=file)
    if r.passes:
        print(f"Speculation: {speculation_summary(r, costs)}", file=file)
    elif r.accept_lengths:
        print(f"Acceptance: tau {r.mean_accept_length:.2f} tokens per target forward "
              f"({r.target_forwards} target forwards)", file=file)
    else:
        print(f"Acceptance: plain decoding ({r.target_forwards} target forwards)", file=file)
    print(f"Peak memory: {r.peak_memory:.3f} GB", file=file)
