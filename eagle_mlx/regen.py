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

Rows are batched in mlx-lm's batch KV cache (left padding, per-row offsets) and run
through mlx-lm's own model modules; mlx-lm's `BatchGenerator` does not return hidden
states, so the decoding loop is ours. The output grows a shard at a time and the index is
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

FORMAT = "eagle_mlx-features-1"
INDEX = "index.json"
# settings that must not change between the runs that fill one folder
FIXED = ("model", "data", "skip", "max_tokens", "max_len", "taps")


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
    if args.max_tokens >= args.max_len:
        raise UsageError(f"--max-tokens {args.max_tokens} leaves no room for a prompt within "
                         f"--max-len {args.max_len}.")


# ------------------------------------------------------------------ index
def read_index(out: Path):
    """The folder's index (None for a new or empty folder); one sentence if it is not ours."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    if not out.is_dir():
        raise EagleError(f"--out {out} is a file, not a folder.")
    try:
        index = json.loads((out / INDEX).read_text(encoding="utf-8"))
        if index.get("format") != FORMAT:
            raise ValueError
    except (OSError, ValueError, AttributeError):
        raise EagleError(f"--out {out} is not an empty folder and holds no index written by "
                         "eagle_mlx.regen; choose a new folder.") from None
    return index


def write_index(out: Path, index: dict) -> None:
    from .outputs import atomic_file

    atomic_file(out / INDEX, lambda tmp: tmp.write_text(json.dumps(index, indent=1),
                                                         encoding="utf-8"))


# ------------------------------------------------------------------ conversations
def history_mask(tokenizer, messages, prompt_ids):
    """Loss mask over a prompt that holds earlier assistant answers: 1 on their tokens
    (found as the template rendered up to each answer and including it); all 0 where the
    template does not render prefixes consistently."""
    from .data import template_ids

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

    def next_prompt(self, tokenizer, max_tokens, max_len):
        """Token ids of the next turn's prompt, or None when the conversation is done (no
        user turn left, or the next one does not fit in max_len with its answer)."""
        if self.turn >= len(self.users):
            return None
        from .data import template_ids

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


# ------------------------------------------------------------------ decoding with features
class Capture:
    """Records the inputs of the chosen decoder layers while mlx-lm's modules run."""

    def __init__(self, layer, store, i):
        self.layer, self.store, self.i = layer, store, i

    def __call__(self, h, *args, **kwargs):
        self.store[self.i] = h
        return self.layer(h, *args, **kwargs)

    def __getattr__(self, name):  # the model reads the layer's own settings (use_sliding, ...)
        return getattr(self.layer, name)


def run_rows(target, prompts, eos, max_tokens, taps, prefill_step=512):
    """Greedy answers for a batch of prompts, and the features of every token of prompt +
    answer (the answer's last token included: it is fed once more).

    Returns, per prompt, (answer ids, {"hidden": float16 [T, H], "taps": float16
    [T, len(taps) * H]}). Whether a turn is a conversation's last is known only once its
    answer is, so every turn keeps its features; a later turn's replace them."""
    import mlx.core as mx
    import numpy as np
    from .mlxlm import BatchKVCache

    inner = target.model.model
    B = len(prompts)
    lengths = [len(p) for p in prompts]
    L = max(lengths)
    pad = [L - n for n in lengths]
    tokens = mx.array([[0] * pad[b] + list(prompts[b]) for b in range(B)], dtype=mx.int32)
    cache = [BatchKVCache(pad) for _ in inner.layers]
    store = {}
    saved = list(inner.layers)
    pieces = [[] for _ in range(B)]  # per row: float16 numpy blocks in order

    def forward(x):
        h = inner(x, cache=cache)
        out = {"hidden": h}
        if taps:
            out["taps"] = mx.concatenate([store[i] for i in taps], axis=-1)
        return h, {k: v.astype(mx.float16) for k, v in out.items()}

    def keep_rows(feats, active, offset):
        """Add the features of this forward (rows in `active`, positions from `offset`)."""
        arrays = {k: np.array(v) for k, v in feats.items()}
        for r, b in enumerate(active):
            pieces[b].append({k: a[r, max(offset[r], 0):] for k, a in arrays.items()})

    try:
        for i in taps:
            inner.layers[i] = Capture(saved[i], store, i)
        h = None
        for s in range(0, L, prefill_step):
            h, feats = forward(tokens[:, s: s + prefill_step])
            mx.eval(h, feats)
            keep_rows(feats, list(range(B)), [p - s for p in pad])
        nxt = target.lm_head(h[:, -1]).argmax(-1)
        active = list(range(B))
        answers = [[] for _ in range(B)]
        finished = [False] * B
        while active:
            mx.eval(nxt)
            toks = nxt.tolist()
            keep, step_in = [], []
            for r, b in enumerate(active):
                if finished[b]:  # fed once more for its features: now it leaves
                    continue
                answers[b].append(toks[r])
                if toks[r] in eos or len(answers[b]) >= max_tokens:
                    finished[b] = True
                keep.append(r)
                step_in.append(toks[r])
            if not keep:
                break
            if len(keep) < len(active):
                for c in cache:
                    c.filter(keep)
                active = [active[r] for r in keep]
            h, feats = forward(mx.array(step_in, dtype=mx.int32)[:, None])
            nxt = target.lm_head(h[:, -1]).argmax(-1)
            mx.eval(nxt, feats)
            keep_rows(feats, active, [0] * len(active))
    finally:
        inner.layers[:] = saved
    results = []
    for b in range(B):
        feats = {k: np.concatenate([p[k] for p in pieces[b]]) for k in pieces[b][0]}
        assert len(feats["hidden"]) == lengths[b] + len(answers[b])
        results.append((answers[b], feats))
    return results


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


POOL_BATCHES = 2  # conversations in flight: batches are picked from this many batch sizes


def take_batch(pending: deque, size: int) -> list:
    """The oldest waiting conversation and the `size - 1` others whose prompts are closest
    to it in length (a batch is padded to its longest prompt, and a prompt's cost grows
    with its length); removed from `pending`, shortest first."""
    first = pending[0]
    rest = sorted(range(1, len(pending)),
                  key=lambda i: abs(len(pending[i].prompt) - len(first.prompt)))[: size - 1]
    chosen = [0] + rest
    batch = [pending[i] for i in chosen]
    for i in sorted(chosen, reverse=True):
        del pending[i]
    return sorted(batch, key=lambda c: len(c.prompt))


def _turns(messages):
    return [{"from": {"system": "system", "user": "human"}.get(m["role"], "gpt"),
             "value": m["content"]} for m in messages]


def _main(argv) -> int:
    from .data import load_conversations
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
    from .target import load_target

    target, tokenizer = load_target(args.model, dtype=args.dtype)
    if not getattr(tokenizer, "chat_template", None):
        raise EagleError(f"the tokenizer of {args.model} has no chat template, which renders the "
                         "prompts.")
    taps = [] if args.no_taps else list(target.eagle3_taps)
    settings = {"model": str(args.model), "data": str(args.data or "ShareGPT"), "skip": args.skip,
                "max_tokens": args.max_tokens, "max_len": args.max_len, "taps": taps}
    if index is None:
        index = {"format": FORMAT, "settings": settings, "hidden_size": target.hidden_size,
                 "model_type": target.model_type, "num_layers": target.num_layers,
                 "shards": [], "seconds": 0.0}
    else:
        for k in FIXED:
            if index["settings"].get(k) != settings[k]:
                raise UsageError(f"--out {out} was written with {k} = "
                                 f"{index['settings'].get(k)!r}, not {settings[k]!r}; continue "
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

    finished, written, t0 = [], 0, time.perf_counter()
    seconds0 = index["seconds"]
    pending = deque()  # conversations whose next turn is ready to run, oldest first
    pool = POOL_BATCHES * args.batch_size
    bar = tqdm(total=len(queue), desc="conversations", disable=args.quiet)

    def refill():
        while len(pending) < pool and queue:
            c = queue.popleft()
            p = c.next_prompt(tokenizer, args.max_tokens, args.max_len)
            if p is None:
                bar.update(1)  # not even its first turn fits
            else:
                pending.append(c)

    def flush(final=False):
        nonlocal finished, written
        while len(finished) >= args.shard_conversations or (final and finished):
            part, finished = finished[: args.shard_conversations], finished[args.shard_conversations:]
            entry = write_shard(out, len(index["shards"]), part)
            index["shards"].append(entry)
            index["seconds"] = seconds0 + time.perf_counter() - t0
            write_index(out, index)
            written += len(part)

    batch = []
    previous = signal.getsignal(signal.SIGTERM)
    on_main = threading.current_thread() is threading.main_thread()
    if on_main:  # a stopped run (Ctrl-C, SIGTERM) keeps what it has answered
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        refill()
        while pending:
            batch = take_batch(pending, args.batch_size)
            results = run_rows(target, [c.prompt for c in batch], eos, args.max_tokens, taps)
            for c, (answer, feats) in zip(batch, results):
                text = tokenizer.decode([t for t in answer if t not in eos])
                prompt, prompt_messages = c.prompt, c.history + [c.users[c.turn]]
                c.answered(text)
                mask = history_mask(tokenizer, prompt_messages, prompt) + [1] * len(answer)
                c.record = {"index": c.index, "tokens": list(prompt) + answer, "mask": mask,
                            "feats": feats, "turns": _turns(c.history)}
                if c.next_prompt(tokenizer, args.max_tokens, args.max_len) is not None:
                    pending.append(c)
                else:
                    finished.append(c.record)
                    bar.update(1)
            batch = []
            flush()
            refill()
        flush(final=True)
    except KeyboardInterrupt:
        # conversations under way end at their last answered turn: nothing answered is lost
        cut = [c.record for c in list(batch) + list(pending) if c.record is not None]
        finished += cut
        flush(final=True)
        bar.close()
        print(f"stopped: wrote {written} conversations to {out}, {len(cut)} of them cut at "
              "their last answered turn; the same command continues", file=sys.stderr)
        return 130
    finally:
        bar.close()
        if on_main:
            signal.signal(signal.SIGTERM, previous)
    print(f"wrote {written} conversations to {out} "
          f"({sum(s['tokens'] for s in index['shards'])} tokens in {len(index['shards'])} shards)")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
