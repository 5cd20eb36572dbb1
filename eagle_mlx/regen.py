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

import json
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

from .cli import ArgumentParser, UsageError, add_dtype_arg, run_cli, started
from .errors import EagleError

from .training.features import FORMAT, INDEX, read_index  # noqa: F401  (the folder's format)

# settings that must not change between the runs that fill one folder
CACHE_LIMIT = 1 << 30  # bytes of freed buffers MLX keeps for reuse during a run
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


# ------------------------------------------------------------------ index
def write_index(out: Path, index: dict) -> None:
    from .outputs import atomic_file

    atomic_file(out / INDEX, lambda tmp: tmp.write_text(json.dumps(index, indent=1),
                                                         encoding="utf-8"))


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


# ------------------------------------------------------------------ features while decoding
class FeatureLog:
    """The target's features of one conversation by position, as the batch engine feeds
    them (`Engine.recorder`): a position fed again (a prompt cache cut back) replaces what
    followed it. Kept as float16 device arrays, evaluated after each step (`settle`: a lazy
    slice would keep the whole forward's outputs alive), until `arrays` asks for them."""

    pending = []  # what the last step recorded, not yet evaluated (every log's)

    def __init__(self):
        self.blocks = []  # (first position, hidden [n, H], tapped [n, H] per tap)

    def __call__(self, position, hidden, tapped):
        import mlx.core as mx

        block = (position, hidden.astype(mx.float16), [t.astype(mx.float16) for t in tapped])
        self.blocks.append(block)
        FeatureLog.pending += [block[1], *block[2]]

    @classmethod
    def settle(cls) -> None:
        import mlx.core as mx

        mx.eval(cls.pending)
        cls.pending = []

    def copy(self) -> "FeatureLog":
        """What is logged so far (later feeds go to this log only)."""
        log = FeatureLog()
        log.blocks = list(self.blocks)
        return log

    def arrays(self, length: int) -> dict:
        """float16 {"hidden": [length, H], "taps": [length, taps x H]} of positions 0..length-1."""
        import mlx.core as mx
        import numpy as np

        kept = []
        for pos, h, t in self.blocks:
            while kept and kept[-1][0] >= pos:  # fed again from `pos`: what followed goes
                kept.pop()
            if kept and kept[-1][0] + kept[-1][1].shape[0] > pos:
                p0, h0, t0 = kept[-1]
                kept[-1] = (p0, h0[: pos - p0], [x[: pos - p0] for x in t0])
            end = kept[-1][0] + kept[-1][1].shape[0] if kept else 0
            if pos != end:
                raise EagleError(f"the features of positions {end}..{pos - 1} were never fed.")
            kept.append((pos, h, t))
        self.blocks = kept
        hidden = mx.concatenate([h for _, h, _ in kept])[:length].astype(mx.float16)
        out = {"hidden": hidden}
        if kept[0][2]:
            out["taps"] = mx.concatenate([mx.concatenate(t, axis=-1) for _, _, t in kept]
                                         )[:length].astype(mx.float16)
        mx.eval(out)
        if hidden.shape[0] != length:
            raise EagleError(f"features of {hidden.shape[0]} positions for {length} tokens.")
        return {k: np.array(v) for k, v in out.items()}


# ------------------------------------------------------------------ shards
def write_shard(out: Path, number: int, done: list):
    """Write one shard of finished conversations; returns its index entry."""
    import numpy as np
    from safetensors.numpy import save_file
    from .outputs import atomic_file

    done = sorted(done, key=lambda d: d["index"])
    tokens = np.concatenate([np.asarray(d["tokens"], np.int32) for d in done])
    arrays = {
        "tokens": tokens,
        "loss_mask": np.concatenate([np.asarray(d["mask"], np.uint8) for d in done]),
        "offsets": np.cumsum([0] + [len(d["tokens"]) for d in done]).astype(np.int64),
        "source": np.array([d["index"] for d in done], np.int64),
        "hidden": np.concatenate([d["feats"]["hidden"] for d in done]),
    }
    if "taps" in done[0]["feats"]:
        arrays["taps"] = np.concatenate([d["feats"]["taps"] for d in done])
    for k in ("hidden", "taps"):
        if k in arrays and not np.isfinite(arrays[k]).all():
            raise EagleError(f"the target's {k} features overflow float16 (|x| > 65504) in "
                             f"conversations {[d['index'] for d in done]}; they cannot be stored.")
    name = f"shard_{number:05d}.safetensors"
    atomic_file(out / name, lambda tmp: save_file(arrays, str(tmp)))
    text = out / f"shard_{number:05d}.jsonl"
    atomic_file(text, lambda tmp: tmp.write_text(
        "".join(json.dumps({"id": f"regen-{d['index']}", "source_index": d["index"],
                            "conversations": d["turns"]}) + "\n" for d in done),
        encoding="utf-8"))
    return {"file": name, "text": text.name, "sources": [d["index"] for d in done],
            "tokens": int(len(tokens)), "answer_tokens": int(arrays["loss_mask"].sum())}


def _turns(messages):
    return [{"from": {"system": "system", "user": "human"}.get(m["role"], "gpt"),
             "value": m["content"]} for m in messages]


def _main(argv) -> int:
    from .training.data import load_conversations
    from .outputs import check_out_file

    args = build_parser().parse_args(argv)
    check_args(args)
    out = Path(args.out).expanduser()
    index = read_index(out)
    if index is None:
        check_out_file(out / INDEX, "--out")
    if args.model is None:
        from .demo import demo_target

        args.model = str(demo_target())
    end = args.skip + args.num_conversations
    done_sources = set()
    if index is not None:
        for s in index["shards"]:
            done_sources.update(s["sources"])
    from .targets.load import load_target

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
    else:
        for k in FIXED:
            have = index["settings"].get(k, "target" if k == "answers" else None)
            if have != settings[k]:
                raise UsageError(f"--out {out} was written with {k} = "
                                 f"{have!r}, not {settings[k]!r}; continue "
                                 "it with the same settings or choose a new folder.")
    conversations = load_conversations(args.data, end)
    queue = deque(Conversation(i, conversations[i]) for i in range(args.skip, min(end,
                                                                                   len(conversations)))
                  if i not in done_sources)
    eos = set(tokenizer.eos_token_ids)
    if not queue:
        print(f"{out} already holds conversations {args.skip}..{end - 1}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    started()
    from tqdm import tqdm

    shards = ShardWriter(out, index, args.shard_conversations)
    if args.answers == "data":
        return _record_answers(args, shards, conversations, queue, target, tokenizer, taps)
    from .decoding.batch import BatchGenerator
    from .model import EagleModel
    from .decoding.steps import PromptCache
    from .decoding.settings import GenerationSettings

    import mlx.core as mx

    # every step's buffers differ in size (rows grow by a token, join and leave): MLX's
    # allocator would keep each freed one for reuse, and a long run's memory grows with them
    mx.set_cache_limit(CACHE_LIMIT)
    gen = BatchGenerator(EagleModel(target), tokenizer, args.batch_size, taps=taps)
    plain = GenerationSettings(max_tokens=args.max_tokens, speculate=False)
    running = {}  # uid -> the conversation whose turn it decodes
    bar = tqdm(total=len(queue), desc="conversations", disable=args.quiet)

    def start(c):
        """c's next turn into the batch (from its prompt cache: only the new part is fed)."""
        c.answer = []
        running[gen.add(c.prompt, plain, prompt_cache=c.cache, record=c.log)] = c

    def refill():
        while len(running) < args.batch_size and queue:
            c = queue.popleft()
            if c.next_prompt(tokenizer, args.max_tokens, args.max_len) is None:
                bar.update(1)  # not even its first turn fits
            else:
                c.cache = PromptCache()
                start(c)

    def answered(c):
        """c's turn has its answer: its record (prompt + answer with their features, the
        last answer token's fed at the next turn's prefill or, at the end, on its own)."""
        answer = c.answer
        text = tokenizer.decode([t for t in answer if t not in eos])
        prompt, prompt_messages = c.prompt, c.history + [c.users[c.turn]]
        c.answered(text)
        tokens = list(prompt) + answer
        mask = history_mask(tokenizer, prompt_messages, prompt) + [1] * len(answer)
        c.record = {"index": c.index, "tokens": tokens, "mask": mask, "log": c.log.copy(),
                    "turns": _turns(c.history)}
        if c.next_prompt(tokenizer, args.max_tokens, args.max_len) is not None:
            start(c)
        else:  # the last answer's last token fed once more, for its features
            c.prompt, c.final = tokens, True
            c.answer = []
            running[gen.add(c.prompt, plain.replace(max_tokens=1), prompt_cache=c.cache,
                            record=c.log)] = c

    def features(record, complete=True):
        """A finished record with its features (a cut one loses its last token, never fed)."""
        n = len(record["tokens"]) - (0 if complete else 1)
        r = dict(record, tokens=record["tokens"][:n], mask=record["mask"][:n])
        r["feats"] = r.pop("log").arrays(n)
        return r

    stop = _sigterm_interrupts()  # a stopped run (Ctrl-C, SIGTERM) keeps what it has answered
    try:
        refill()
        while running:
            for uid, r in gen.step():
                c = running[uid]
                c.answer += r.tokens
                if r.finish_reason is None:
                    continue
                del running[uid]
                if getattr(c, "final", False):
                    c.record["log"] = c.log
                    shards.add(features(c.record))
                    c.record = c.cache = None
                    bar.update(1)
                else:
                    answered(c)
            FeatureLog.settle()
            shards.flush()
            refill()
        shards.flush(final=True)
    except KeyboardInterrupt:
        # conversations under way end at their last answered turn: nothing answered is lost
        cut = [features(c.record, complete=False) for c in running.values()
               if c.record is not None]
        for r in cut:
            shards.add(r)
        shards.flush(final=True)
        bar.close()
        print(f"stopped: wrote {shards.written} conversations to {out}, {len(cut)} of them cut at "
              "their last answered turn; the same command continues", file=sys.stderr)
        return 130
    finally:
        bar.close()
        stop.close()
    shards.report()
    return 0


class ShardWriter:
    """Finished conversations into shards of `per_shard`, the index replaced after each."""

    def __init__(self, out: Path, index: dict, per_shard: int):
        self.out, self.index, self.per_shard = out, index, per_shard
        self.finished, self.written = [], 0
        self.t0, self.seconds0 = time.perf_counter(), index["seconds"]

    def add(self, record) -> None:
        self.finished.append(record)

    def flush(self, final: bool = False) -> None:
        while len(self.finished) >= self.per_shard or (final and self.finished):
            part = self.finished[: self.per_shard]
            self.finished = self.finished[self.per_shard:]
            entry = write_shard(self.out, len(self.index["shards"]), part)
            self.index["shards"].append(entry)
            self.index["seconds"] = self.seconds0 + time.perf_counter() - self.t0
            write_index(self.out, self.index)
            self.written += len(part)

    def report(self) -> None:
        shards = self.index["shards"]
        print(f"wrote {self.written} conversations to {self.out} "
              f"({sum(s['tokens'] for s in shards)} tokens in {len(shards)} shards)")


def _record_answers(args, shards, conversations, queue, target, tokenizer, taps) -> int:
    """--answers data: each conversation as the data has it (rendered with the chat template,
    cut at --max-len), the target's features of it from one forward pass."""
    import mlx.core as mx
    import numpy as np
    from tqdm import tqdm
    from .training.data import render

    bar = tqdm(total=len(queue), desc="conversations", disable=args.quiet)
    stop = _sigterm_interrupts()
    try:
        for c in queue:
            messages = conversations[c.index]
            rendered = render(tokenizer, messages, args.max_len)
            if rendered is not None and sum(rendered[1]) > 0:
                tokens, mask = rendered
                hidden, tapped = target(mx.array(tokens)[None], taps=taps)
                feats = {"hidden": hidden[0].astype(mx.float16)}
                if tapped:
                    feats["taps"] = mx.concatenate(tapped, axis=-1)[0].astype(mx.float16)
                mx.eval(feats)
                shards.add({"index": c.index, "tokens": tokens, "mask": mask,
                            "feats": {k: np.array(v) for k, v in feats.items()},
                            "turns": _turns(messages)})
                shards.flush()
            bar.update(1)
        shards.flush(final=True)
    except KeyboardInterrupt:
        shards.flush(final=True)
        bar.close()
        print(f"stopped: wrote {shards.written} conversations to {shards.out}; the same command "
              "continues", file=sys.stderr)
        return 130
    finally:
        bar.close()
        stop.close()
    shards.report()
    return 0


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
