"""`python -m eagle_mlx.regen`: answers written by the target itself, for training its head.

    python -m eagle_mlx.regen --model ... --out answers.jsonl --num-conversations 2000
    python -m eagle_mlx.train --model ... --data answers.jsonl --out head-run ...

A head drafts what its target will say, so recent EAGLE recipes train it on the target's
own answers (self-distillation) rather than on ChatGPT's: each conversation's first user
message (after its system message, if any) is answered by the target through its chat
template, in batches (mlx-lm's batch_generate), and written as a ShareGPT-style JSON line
that `train --data` reads. The file grows a batch at a time: run the same command again
to continue where it stopped.
"""

import json
import sys

from .cli import ArgumentParser, UsageError, add_dtype_arg, run_cli, started
from .errors import EagleError


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m eagle_mlx.regen",
                       description="Answer training prompts with the target itself.")
    p.add_argument("--model", help="target folder, repo id or GGUF file (default: the demo target)")
    add_dtype_arg(p)
    p.add_argument("--data", help="ShareGPT-style json/jsonl of prompts (default: ShareGPT)")
    p.add_argument("--out", required=True, help="JSON-lines file to write (continued if it exists)")
    p.add_argument("--num-conversations", type=int, default=1000, help="prompts to answer in all")
    p.add_argument("--skip", type=int, default=0,
                   help="start at this conversation of --data (keep held-out ones apart)")
    p.add_argument("--max-tokens", type=int, default=256, help="longest answer")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--quiet", action="store_true")
    return p


def _main(argv) -> int:
    from .cli import chat_prompt
    from .data import load_conversations
    from .outputs import check_out_file
    from .target import load_target

    args = build_parser().parse_args(argv)
    for flag in ("num_conversations", "max_tokens", "max_prompt_tokens", "batch_size"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1 "
                             f"(got {getattr(args, flag)}).")
    if args.skip < 0:
        raise UsageError(f"--skip must be 0 or more (got {args.skip}).")
    out = check_out_file(args.out, "--out")
    done = 0
    if out.is_file():
        lines = out.read_text(encoding="utf-8").splitlines()
        try:
            done = max([json.loads(line)["source_index"] + 1 for line in lines if line.strip()]
                       or [args.skip])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise EagleError(f"--out {out} exists but was not written by eagle_mlx.regen; "
                             "choose a new file.") from None
    start = max(done, args.skip)
    end = args.skip + args.num_conversations
    if start >= end:
        print(f"{out} already answers conversations {args.skip}..{end - 1}")
        return 0
    if args.model is None:
        from .demo import demo_target

        args.model = str(demo_target())
    target, tokenizer = load_target(args.model, dtype=args.dtype)
    if not getattr(tokenizer, "chat_template", None):
        raise EagleError(f"the tokenizer of {args.model} has no chat template, which renders the "
                         "prompts.")
    conversations = load_conversations(args.data, end)
    started()
    todo = []
    for index in range(start, min(end, len(conversations))):
        messages = conversations[index]
        first = 1 if messages[0]["role"] == "system" else 0
        if first >= len(messages) or messages[first]["role"] != "user":
            continue
        prompt = messages[: first + 1]
        ids = chat_prompt(tokenizer, prompt)
        if len(ids) + args.max_tokens <= min(target.max_context, args.max_prompt_tokens +
                                             args.max_tokens):
            todo.append((index, prompt, ids))
    from mlx_lm.generate import batch_generate
    from tqdm import tqdm

    written = 0
    with open(out, "a", encoding="utf-8") as f, tqdm(total=len(todo), desc="answering",
                                                        disable=args.quiet) as bar:
        for b in range(0, len(todo), args.batch_size):
            batch = todo[b: b + args.batch_size]
            result = batch_generate(target.model, tokenizer, [ids for _, _, ids in batch],
                                    max_tokens=args.max_tokens)
            for (index, prompt, _), text in zip(batch, result.texts):
                turns = [{"from": "system" if m["role"] == "system" else "human",
                          "value": m["content"]} for m in prompt]
                turns.append({"from": "gpt", "value": text})
                f.write(json.dumps({"id": f"regen-{index}", "source_index": index,
                                    "conversations": turns}) + "\n")
            f.flush()
            written += len(batch)
            bar.update(len(batch))
    print(f"wrote {written} answers to {out}")
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
