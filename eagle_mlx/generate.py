"""`python -m eagle_mlx.generate`: generate text with EAGLE speculative decoding.

Flags follow `mlx_lm.generate`; `--eagle` adds a draft head (omitted: plain decoding).

    python -m eagle_mlx.generate --model mlx-community/Meta-Llama-3.1-8B-Instruct-4bit \\
        --eagle yuhuili/EAGLE-LLaMA3.1-Instruct-8B --prompt "Write a haiku about tea."
"""

import sys
import types

from .cli import (ArgumentParser, UsageError, add_model_args, add_sampling_args, chat_prompt,
                  continuation, describe_costs, describe_mode, load_from_args, print_stats,
                  read_stdin, run_cli, settings_from_args, text_arg)
from .errors import EagleError
from .openai_api import print_logprobs


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m eagle_mlx.generate",
                                description="Generate text with EAGLE speculative decoding.")
    add_model_args(p)
    p.add_argument("--prompt", "-p", required=True, help="the prompt ('-' reads stdin)")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="tokenize the prompt as is, without the chat template")
    p.add_argument("--prompt-cache-file", default=None,
                   help="continue from the caches a file holds (written by "
                        "`python -m eagle_mlx.cache_prompt`, or by mlx_lm.cache_prompt: then "
                        "plain decoding); the prompt goes on after what it holds")
    add_sampling_args(p)
    p.add_argument("--verbose", action="store_true",
                   help="also print the tree settings (with --speculate auto: the measured "
                        "costs) and every pass's accept length (and what it drafted)")
    return p


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    prompt = read_stdin("--prompt") if args.prompt == "-" else text_arg(args.prompt, "--prompt")
    if not prompt.strip():
        raise UsageError("--prompt is empty.")
    if args.system_prompt is not None:
        text_arg(args.system_prompt, "--system-prompt")
    model, tokenizer = load_from_args(args)
    from .generation import acceptance_warning, stream_generate

    messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else [])
    messages.append({"role": "user", "content": prompt})
    cache = None
    if args.prompt_cache_file is not None:
        from .cache_file import load as load_cache

        cache = load_cache(args.prompt_cache_file, model, settings.kv, settings.max_kv_size)
        ids = cache.tokens + continuation(tokenizer, messages, not args.ignore_chat_template)
        settings = plain_for_mlx_lm_files(cache, settings, args.prompt_cache_file)
    else:
        ids = chat_prompt(tokenizer, messages, use_template=not args.ignore_chat_template)
    context = model.target.max_context
    if len(ids) > context:
        raise UsageError(f"--prompt is {len(ids)} tokens long, more than the model's context of "
                         f"{context} tokens.")
    if args.verbose:
        print(f"[{describe_mode(model, settings)}]", file=sys.stderr)
        costs = describe_costs(model, settings)
        if costs:
            print(f"[{costs}]", file=sys.stderr)
    print("==========")
    last, entries = None, []
    try:
        for r in stream_generate(model, tokenizer, ids, settings=settings, prompt_cache=cache):
            print(r.text, end="", flush=True)
            entries += r.logprobs or []
            if args.verbose and r.accept_length is not None:
                what = f"{r.choice}: " if r.choice else ""
                print(f"[{what}{r.accept_length}]", end="", file=sys.stderr, flush=True)
            last = r
    except EagleError as e:
        raise UsageError(str(e)) from None
    print()
    if settings.logprobs is not None:
        print_logprobs(tokenizer, entries)
    costs = model.costs_in_use(settings.kv)
    print_stats(last, costs=costs)
    if args.verbose and costs is not None and costs.recheck is not None:
        for note in costs.recheck.notes:
            print(f"[{note}]", file=sys.stderr)
    warning = acceptance_warning(model, last, settings.temp)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def plain_for_mlx_lm_files(cache, settings, path):
    """A cache file mlx-lm wrote holds no record of its tokens or of the target's features:
    plain decoding from it (said in one line)."""
    if cache.opaque and settings.speculate is not False:
        print(f"note: {path} was written by mlx-lm (no record of its tokens or the target's "
              "features): plain decoding.", file=sys.stderr)
        return settings.replace(speculate=False)
    return settings


def main(argv=None) -> int:
    return run_cli(_main, argv)


class _CallableModule(types.ModuleType):
    """Importing this module (`from eagle_mlx.generate import main`) rebinds the name
    `eagle_mlx.generate`, which is also the API function: calling the module calls it."""

    def __call__(self, *args, **kwargs):
        from .generation import generate

        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
