"""`python -m eagle_mlx.cache_prompt`: prefill a prompt (a long document, a system prompt)
once and save the caches to a file that `generate --prompt-cache-file` continues from — as
`mlx_lm.cache_prompt` does, in its file format, with the target's features of every position
added so that a drafter catches up from them.

    python -m eagle_mlx.cache_prompt --model M --eagle H --prompt - --prompt-cache-file doc.safetensors < doc.txt
    python -m eagle_mlx.generate --model M --eagle H --prompt-cache-file doc.safetensors --prompt "Summarize it."
"""

import sys
import time

from .cli import (ArgumentParser, UsageError, add_kv_args, add_model_args, kv_settings,
                  load_from_args, read_stdin, run_cli, text_arg)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m eagle_mlx.cache_prompt",
                       description="Prefill a prompt and save its caches to a file.")
    add_model_args(p)
    p.add_argument("--prompt", "-p", required=True, help="the prompt ('-' reads stdin)")
    p.add_argument("--prompt-cache-file", required=True,
                   help="the .safetensors file to write")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="tokenize the prompt as is, without the chat template")
    add_kv_args(p)
    return p


def prompt_ids(tokenizer, prompt: str, use_template: bool):
    """mlx-lm's `cache_prompt` tokens: the user message left open (the question that follows
    goes on inside it), or the text alone."""
    if use_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=False,
                                            continue_final_message=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    from .decoding.plan import encode_prompt

    return encode_prompt(tokenizer, prompt)


def _main(argv) -> int:
    from .decoding.settings import GenerationSettings
    from .errors import EagleError

    args = build_parser().parse_args(argv)
    try:
        settings = GenerationSettings(max_tokens=1, **kv_settings(args)).check(
            name=lambda n: "--" + n.replace("_", "-"))
    except EagleError as e:
        raise UsageError(str(e)) from None
    prompt = read_stdin("--prompt") if args.prompt == "-" else text_arg(args.prompt, "--prompt")
    if not prompt.strip():
        raise UsageError("--prompt is empty.")
    model, tokenizer = load_from_args(args)
    ids = prompt_ids(tokenizer, prompt, not args.ignore_chat_template)
    if len(ids) >= model.target.max_context:
        raise UsageError(f"--prompt is {len(ids)} tokens long; the model's context is "
                         f"{model.target.max_context}.")
    from .cache_file import prefill_and_save

    start = time.perf_counter()
    if settings.max_kv_size is not None and not model.target.bounds_kv:
        raise UsageError(f"--max-kv-size bounds the caches of models whose layers all attend "
                         f"to every position; {model.target.model_type} here keeps caches of "
                         "its own.")
    prefill_and_save(args.prompt_cache_file, model, ids, settings.kv,
                     model_id=args.model or "", max_kv_size=settings.max_kv_size)
    seconds = time.perf_counter() - start
    print(f"Prompt: {len(ids)} tokens, {len(ids) / max(seconds, 1e-9):.1f} tokens-per-sec; "
          f"saved to {args.prompt_cache_file}")
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
