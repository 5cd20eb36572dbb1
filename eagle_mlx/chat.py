"""`python -m eagle_mlx.chat`: a multi-turn chat in the terminal, streamed with EAGLE.

Commands: /reset (forget the conversation), /stats (last reply and session), /quit.
Ctrl-C stops the current reply and keeps the conversation; Ctrl-D quits. The target's
and the head's caches are kept across turns (as `mlx_lm.chat` keeps its prompt cache):
each turn prefills only the new messages.
"""

import sys

from .cli import (ArgumentParser, UsageError, add_model_args, add_sampling_args, chat_prompt,
                  load_from_args, print_stats, run_cli, settings_from_args, text_arg)
from .errors import EagleError
from .openai_api import print_logprobs

HELP = "commands: /reset  /stats  /quit   (Ctrl-C stops a reply, Ctrl-D quits)"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m eagle_mlx.chat",
                                description="Chat with a model in the terminal, using EAGLE.")
    add_model_args(p)
    p.add_argument("--prompt-cache-file", default=None,
                   help="start from the caches a file holds (python -m eagle_mlx.cache_prompt, "
                        "or mlx_lm.cache_prompt: then plain decoding): the conversation goes on "
                        "inside its open user message")
    add_sampling_args(p)
    p.set_defaults(max_tokens=512)
    return p


class Chat:
    def __init__(self, model, tokenizer, args, settings):
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.settings = settings
        self.system = ([{"role": "system", "content": args.system_prompt}]
                       if args.system_prompt else [])
        self.turns = []  # user/assistant messages, oldest first
        self.last = None
        self.session = {"replies": 0, "tokens": 0, "forwards": 0}
        self.prefix = None  # the tokens a prompt cache file holds (the conversation follows)
        self.cache = self.fresh_cache()
        self.warned = False  # the acceptance warning is given once

    def fresh_cache(self):
        """An empty PromptCache, or the one the prompt cache file holds."""
        from .decoding.steps import PromptCache

        path = getattr(self.args, "prompt_cache_file", None)
        if path is None:
            return PromptCache()
        from .cache_file import load
        from .generate import plain_for_mlx_lm_files

        cache = load(path, self.model, self.settings.kv, self.settings.max_kv_size)
        if self.prefix is None:
            self.settings = plain_for_mlx_lm_files(cache, self.settings, path)
        self.prefix = list(cache.tokens)
        return cache

    def prompt_ids(self, user: str):
        """The conversation plus the new message, oldest turns dropped to fit the context."""
        context = self.model.target.max_context
        history = list(self.turns)
        dropped = 0
        while True:
            messages = self.system + history + [{"role": "user", "content": user}]
            if self.prefix is None:
                ids = chat_prompt(self.tokenizer, messages)
            else:  # (the file's prompt, then the conversation from its first user message on)
                from .cli import continuation

                ids = self.prefix + continuation(self.tokenizer, messages, True, len(self.system))
            if len(ids) + self.settings.max_tokens <= context or not history:
                break
            history = history[2:]  # one user message and its reply
            dropped += 1
        if dropped:
            self.turns = history
            print(f"[history trimmed: dropped the {dropped} oldest turn(s) to fit the "
                  f"context of {context} tokens]", file=sys.stderr)
        if len(ids) > context:
            raise EagleError(f"this message is {len(ids)} tokens long with the system prompt, "
                             f"more than the context of {context} tokens.")
        return ids

    def reply(self, user: str) -> None:
        from .generation import stream_generate

        ids = self.prompt_ids(user)
        settings = self.settings.replace(max_tokens=min(
            self.settings.max_tokens, self.model.target.max_context - len(ids) + 1))
        text, entries = [], []
        try:
            for r in stream_generate(self.model, self.tokenizer, ids, prompt_cache=self.cache,
                                     settings=settings):
                print(r.text, end="", flush=True)
                text.append(r.text)
                entries += r.logprobs or []
                self.last = r
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        print()
        if settings.logprobs is not None:
            print_logprobs(self.tokenizer, entries)
        self.turns += [{"role": "user", "content": user},
                       {"role": "assistant", "content": "".join(text)}]
        if self.last is not None and not self.warned:
            from .generation import acceptance_warning

            warning = acceptance_warning(self.model, self.last, self.settings.temp)
            if warning:
                print(f"warning: {warning}", file=sys.stderr)
                self.warned = True
        if self.last is not None:
            self.session["replies"] += 1
            self.session["tokens"] += self.last.generation_tokens
            self.session["forwards"] += self.last.target_forwards

    def stats(self) -> None:
        if self.last is None:
            print("no reply yet")
            return
        print("last reply:")
        print_stats(self.last, costs=self.model.costs_in_use(self.settings.kv))
        s = self.session
        print(f"session: {s['replies']} replies, {s['tokens']} tokens, "
              f"{s['forwards']} target forwards, {len(self.turns) // 2} turns in history")

    def read(self, stream, interactive: bool):
        """The next line typed: text, "" for nothing to act on, None at the end of input."""
        try:
            if interactive:
                line = input(">> ")
                line.encode("utf-8")  # a terminal can deliver undecodable bytes
                return line
            raw = stream.buffer.readline()
            return raw.decode("utf-8").rstrip("\r\n") if raw else None
        except EOFError:
            return None
        except (UnicodeDecodeError, UnicodeEncodeError):
            print("error: that line is not valid UTF-8 text; it was ignored.", file=sys.stderr)
            return ""
        except KeyboardInterrupt:
            print("\n(/quit or Ctrl-D to leave)")
            return ""

    def run(self, stream) -> None:
        from .distributed import rank, share_text

        group = self.model.group  # under mlx.launch rank 0 reads, every rank replies
        interactive = stream.isatty() and rank(group) == 0
        if interactive:
            print(HELP)
        while True:
            line = self.read(stream, interactive) if rank(group) == 0 else None
            line = share_text(group, line)
            if line is None:
                break
            command = line.strip()
            if not command:
                continue
            if command == "/quit":
                break
            if command == "/reset":
                self.turns, self.last = [], None
                self.cache.reset()
                self.cache = self.fresh_cache()
                print("[conversation reset]")
                continue
            if command == "/stats":
                self.stats()
                continue
            if command.startswith("/"):
                print(f"unknown command {command}; {HELP}")
                continue
            try:
                self.reply(line)
            except EagleError as e:
                print(f"error: {e}", file=sys.stderr)


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    if args.system_prompt is not None:
        text_arg(args.system_prompt, "--system-prompt")
    model, tokenizer = load_from_args(args)
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"the tokenizer of {args.model or 'the demo model'} has no chat template, "
                         "which chat needs; use python -m eagle_mlx.generate instead.")
    Chat(model, tokenizer, args, settings).run(sys.stdin)
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
