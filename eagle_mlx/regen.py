"""`python -m eagle_mlx.regen`: the target's own answers, with the features a head trains on.

    python -m eagle_mlx.regen --model ... --out features/ --num-conversations 20000

A head drafts what its target will say, so recent EAGLE recipes train it on the target's
own answers (self-distillation) rather than on ChatGPT's. Every user turn of a
conversation is answered by the target (greedy), with its own earlier answers as the
history. The pass that writes a conversation's last answer also reads the whole
conversation (the history as its prompt, then each answer token as it is fed back), and
keeps, for every token, what a head trains on: the post-norm last hidden state (EAGLE-1
features, and through `lm_head` the target's distribution) and the inputs of the EAGLE-3
tap layers. These go to float16 shards (safetensors) beside an `index.json`, with each
shard's conversations as ShareGPT-style JSON lines (`train --data` reads those).

Conversations are decoded continuously batched (`batch.BatchGenerator`, plain greedy
decoding): a conversation's next turn joins as soon as its answer ends, from its own prompt
cache, so only the new user message is prefilled (never the history again), and every
position's features are recorded as the target feeds it. The output grows a shard at a time and the index is
replaced atomically after each: run the same command again (or with a larger
--num-conversations) to continue; nothing is written twice. Stopped (Ctrl-C, SIGTERM), a run
writes the conversations under way as far as their last answered turn, so no answer is lost.
"""

import signal
import sys
import threading
from collections import deque
from pathlib import Path

from .cli import ArgumentParser, UsageError, add_dtype_arg, run_cli, started
from .errors import EagleError
from .training.features import FORMAT, INDEX, FeatureLog, ShardWriter, read_index

CACHE_LIMIT = 1 << 30  # bytes of freed buffers MLX keeps for reuse during a run
# settings that must not change between the runs that fill one folder
FIXED = ("model", "data", "skip", "max_tokens", "max_len", "taps", "answers")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m eagle_mlx.regen",
                       description="Answer training conversations with the target itself and "
                                   "keep its features for training a head.")
    p.add_argument("--model", help="target folder, repo id or GGUF file (default: the demo target)")
    add_dtype_arg(p)
    p.add_argument("--data", help="ShareGPT-style json/jsonl of conversations (default: ShareGPT)")
    p.add_argument("--out", required=True,
                   help="folder of feature shards and index.json (continued if it exists)")
    p.add_argument("--num-conversations", type=int, default=1000,
                   help="conversations of --data to answer in all, from --skip on")
    p.add_argument("--skip", type=int, default=0,
                   help="start at this conversation of --data (keep held-out ones apart)")
    p.add_argument("--max-tokens", type=int, default=384, help="longest answer")
    p.add_argument("--max-len", type=int, default=2048,
                   help="longest conversation in tokens: later turns that do not fit are left out")
    p.add_argument("--batch-size", type=int, default=16, help="rows decoded together")
    p.add_argument("--shard-conversations", type=int, default=64,
                   help="conversations per shard (a shard is the unit a resumed run keeps)")
    p.add_argument("--answers", choices=["target", "data"], default="target",
                   help="target (default): the target answers every turn itself; data: keep the "
                        "data's own answers and only record the target's features of them (one "
                        "forward pass per conversation, no generation)")
    p.add_argument("--no-taps", action="store_true",
                   help="keep only the EAGLE-1 features (no EAGLE-3 tap-layer inputs)")
    p.add_argument("--quiet", action="store_true")
    return p


def check_args(args) -> None:
    for flag in ("num_conversations", "max_tokens", "max_len", "batch_size",
                 "shard_conversations"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1 "
                             f"(got {getattr(args, flag)}).")
    if args.skip < 0:
        raise UsageError(f"--skip must be 0 or more (got {args.skip}).")
    if args.answers == "target" and args.max_tokens >= args.max_len:
        raise UsageError(f"--max-tokens {args.max_tokens} leaves no room for a prompt within "
                         f"--max-len {args.max_len}.")


# ------------------------------------------------------------------ conversations
def history_mask(tokenizer, messages, prompt_ids):
    """Loss mask over a prompt that holds earlier assistant answers: 1 on their tokens
    (found as the template rendered up to each answer and including it); all 0 where the
    template does not render prefixes consistently."""
    from .training.data import template_ids

    mask = [0] * len(prompt_ids)
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = template_ids(tokenizer, messages[:j], True)
        full = template_ids(tokenizer, messages[: j + 1], False)
        if full[: len(start)] != start or prompt_ids[: len(full)] != full:
            return [0] * len(prompt_ids)
        for p in range(len(start), len(full)):
            mask[p] = 1
    return mask


class Conversation:
    """One conversation being answered turn by turn."""

    def __init__(self, index, messages):
        self.index = index
        first = 1 if messages[0]["role"] == "system" else 0
        self.history = messages[:first]
        self.users = [m for m in messages[first:] if m["role"] == "user"]
        self.turn = 0
        self.prompt = None
        self.record = None  # the conversation up to its last answered turn, with its features
        self.cache = None   # its PromptCache: the next turn prefills only what is new
        self.log = FeatureLog()
        self.answer = []

    def next_prompt(self, tokenizer, max_tokens, max_len):
        """Token ids of the next turn's prompt, or None when the conversation is done (no
        user turn left, or the next one does not fit in max_len with its answer)."""
        if self.turn >= len(self.users):
            return None
        from .training.data import template_ids

        messages = self.history + [self.users[self.turn]]
        ids = template_ids(tokenizer, messages, True)
        if len(ids) + max_tokens > max_len:
            return None
        self.prompt = ids
        return ids

    def answered(self, text):
        self.history = self.history + [self.users[self.turn],
                                       {"role": "assistant", "content": text}]
        self.turn += 1


def _turns(messages):
    return [{"from": {"system": "system", "user": "human"}.get(m["role"], "gpt"),
             "value": m["content"]} for m in messages]


# ------------------------------------------------------------------ a run
def _open(args):
    """(output folder, its index: new, or continued with the same settings; the target, its
    tokenizer and taps; the data's conversations; the queue of those still to answer)."""
    from .targets.load import load_target
    from .outputs import check_out_file
    from .training.data import load_conversations

    out = Path(args.out).expanduser()
    index = read_index(out)
    if index is None:
        check_out_file(out / INDEX, "--out")
    if args.model is None:
        from .demo import demo_target

        args.model = str(demo_target())
    end = args.skip + args.num_conversations
    done = {i for s in (index or {}).get("shards", []) for i in s["sources"]}
    target, tokenizer = load_target(args.model, dtype=args.dtype)
    if not getattr(tokenizer, "chat_template", None):
        raise EagleError(f"the tokenizer of {args.model} has no chat template, which renders the "
                         "prompts.")
    taps = [] if args.no_taps else list(target.eagle3_taps)
    if any(not 0 <= t <= target.num_layers for t in taps):
        raise EagleError(f"{args.model} has {target.num_layers} layers, too few for the EAGLE-3 "
                         f"taps {{2, L//2, L-3}} ({taps}); --no-taps records the EAGLE-1 "
                         "features alone.")
    settings = {"model": str(args.model), "data": str(args.data or "ShareGPT"), "skip": args.skip,
                "max_tokens": args.max_tokens, "max_len": args.max_len, "taps": taps,
                "answers": args.answers}
    if index is None:
        index = {"format": FORMAT, "settings": settings, "hidden_size": target.hidden_size,
                 "model_type": target.model_type, "num_layers": target.num_layers,
                 "shards": [], "seconds": 0.0}
    for k in FIXED:
        have = index["settings"].get(k, "target" if k == "answers" else None)
        if have != settings[k]:
            raise UsageError(f"--out {out} was written with {k} = {have!r}, not "
                             f"{settings[k]!r}; continue it with the same settings or choose "
                             "a new folder.")
    conversations = load_conversations(args.data, end)
    queue = deque(Conversation(i, conversations[i])
                  for i in range(args.skip, min(end, len(conversations))) if i not in done)
    return out, index, target, tokenizer, taps, conversations, queue


class Regen:
    """One run: the queued conversations answered by the target, continuously batched (or,
    with --answers data, the data's own answers read in one forward each), written a shard
    at a time. Stopped, it writes what it has and says how the same command continues."""

    def __init__(self, args, out, index, target, tokenizer, taps, conversations, queue):
        from tqdm import tqdm

        self.args, self.out, self.target, self.tokenizer = args, out, target, tokenizer
        self.taps, self.conversations, self.queue = taps, conversations, queue
        self.eos = set(tokenizer.eos_token_ids)
        self.shards = ShardWriter(out, index, args.shard_conversations)
        self.bar = tqdm(total=len(queue), desc="conversations", disable=args.quiet)
        self.running = {}  # uid -> the conversation whose turn the batch decodes

    def run(self) -> int:
        stop = _sigterm_interrupts()  # a stopped run (Ctrl-C, SIGTERM) keeps what it has
        try:
            if self.args.answers == "data":
                self._record_answers()
            else:
                self._generate()
            self.shards.flush(final=True)
        except KeyboardInterrupt:
            # conversations under way end at their last answered turn: nothing answered is lost
            cut = [self._features(c.record, complete=False) for c in self.running.values()
                   if c.record is not None]
            for r in cut:
                self.shards.add(r)
            self.shards.flush(final=True)
            self.bar.close()
            what = f", {len(cut)} of them cut at their last answered turn" if \
                self.args.answers == "target" else ""
            print(f"stopped: wrote {self.shards.written} conversations to {self.out}{what}; the "
                  "same command continues", file=sys.stderr)
            return 130
        finally:
            self.bar.close()
            stop.close()
        self.shards.report()
        return 0

    # ------------------------------------------------------------ the target's answers
    def _generate(self) -> None:
        import mlx.core as mx

        from .decoding.batch import BatchGenerator
        from .decoding.settings import GenerationSettings
        from .model import EagleModel

        # every step's buffers differ in size (rows grow by a token, join and leave): MLX's
        # allocator would keep each freed one for reuse, and a long run's memory grows with them
        mx.set_cache_limit(CACHE_LIMIT)
        self.gen = BatchGenerator(EagleModel(self.target), self.tokenizer, self.args.batch_size,
                                  taps=self.taps)
        self.plain = GenerationSettings(max_tokens=self.args.max_tokens, speculate=False)
        self._refill()
        while self.running:
            for uid, r in self.gen.step():
                c = self.running[uid]
                c.answer += r.tokens
                if r.finish_reason is None:
                    continue
                del self.running[uid]
                if getattr(c, "final", False):
                    c.record["log"] = c.log
                    self.shards.add(self._features(c.record))
                    c.record = c.cache = None
                    self.bar.update(1)
                else:
                    self._answered(c)
            FeatureLog.settle()
            self.shards.flush()
            self._refill()

    def _start(self, c, settings=None) -> None:
        """c's next turn into the batch (from its prompt cache: only the new part is fed)."""
        c.answer = []
        uid = self.gen.add(c.prompt, settings or self.plain, prompt_cache=c.cache, record=c.log)
        self.running[uid] = c

    def _refill(self) -> None:
        from .decoding.steps import PromptCache

        a = self.args
        while len(self.running) < a.batch_size and self.queue:
            c = self.queue.popleft()
            if c.next_prompt(self.tokenizer, a.max_tokens, a.max_len) is None:
                self.bar.update(1)  # not even its first turn fits
            else:
                c.cache = PromptCache()
                self._start(c)

    def _answered(self, c) -> None:
        """c's turn has its answer: its record (prompt + answer with their features, the
        last answer token's fed at the next turn's prefill or, at the end, on its own)."""
        answer, tok = c.answer, self.tokenizer
        text = tok.decode([t for t in answer if t not in self.eos])
        prompt, prompt_messages = c.prompt, c.history + [c.users[c.turn]]
        c.answered(text)
        tokens = list(prompt) + answer
        mask = history_mask(tok, prompt_messages, prompt) + [1] * len(answer)
        c.record = {"index": c.index, "tokens": tokens, "mask": mask, "log": c.log.copy(),
                    "turns": _turns(c.history)}
        if c.next_prompt(tok, self.args.max_tokens, self.args.max_len) is not None:
            self._start(c)
        else:  # the last answer's last token fed once more, for its features
            c.prompt, c.final = tokens, True
            self._start(c, self.plain.replace(max_tokens=1))

    @staticmethod
    def _features(record, complete=True):
        """A finished record with its features (a cut one loses its last token, never fed)."""
        n = len(record["tokens"]) - (0 if complete else 1)
        r = dict(record, tokens=record["tokens"][:n], mask=record["mask"][:n])
        r["feats"] = r.pop("log").arrays(n)
        return r

    # ------------------------------------------------------------ the data's answers
    def _record_answers(self) -> None:
        """Each conversation as the data has it (rendered with the chat template, cut at
        --max-len), the target's features of it from one forward pass."""
        import mlx.core as mx
        import numpy as np

        from .training.data import render

        for c in self.queue:
            messages = self.conversations[c.index]
            rendered = render(self.tokenizer, messages, self.args.max_len)
            if rendered is not None and sum(rendered[1]) > 0:
                tokens, mask = rendered
                hidden, tapped = self.target(mx.array(tokens)[None], taps=self.taps)
                feats = {"hidden": hidden[0].astype(mx.float16)}
                if tapped:
                    feats["taps"] = mx.concatenate(tapped, axis=-1)[0].astype(mx.float16)
                mx.eval(feats)
                self.shards.add({"index": c.index, "tokens": tokens, "mask": mask,
                                 "feats": {k: np.array(v) for k, v in feats.items()},
                                 "turns": _turns(messages)})
                self.shards.flush()
            self.bar.update(1)


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    out, index, target, tokenizer, taps, conversations, queue = _open(args)
    if not queue:
        end = args.skip + args.num_conversations
        print(f"{out} already holds conversations {args.skip}..{end - 1}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    started()
    return Regen(args, out, index, target, tokenizer, taps, conversations, queue).run()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


class _sigterm_interrupts:
    """SIGTERM raises KeyboardInterrupt (on the main thread) until `close`, as Ctrl-C does."""

    def __init__(self):
        self.on_main = threading.current_thread() is threading.main_thread()
        if self.on_main:
            self.previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _interrupt)

    def close(self) -> None:
        if self.on_main:
            signal.signal(signal.SIGTERM, self.previous)


def main(argv=None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
