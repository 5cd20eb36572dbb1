"""Feature shards: what `regen` writes and `train --features` reads.

A folder holds `index.json` and numbered shards. Each shard is a safetensors file of its
conversations one after another: `tokens` [N] int32, `loss_mask` [N] uint8 (1 on answer
tokens), `offsets` [C + 1] (conversation c is rows offsets[c]..offsets[c+1]-1), `source`
[C] (the conversation's index in the data), `hidden` [N, H] float16 (the target's
post-norm last hidden state: EAGLE-1 features, and through `lm_head` its distribution) and,
unless written without, `taps` [N, taps x H] float16 (the inputs of the EAGLE-3 tap
layers, concatenated), beside the same conversations as ShareGPT-style JSON lines.

Reading maps the files (numpy memmap from the safetensors header): a batch reads only its
own conversations' rows, so a training run over gigabytes of features holds none of them.
Writing (`ShardWriter`) adds a shard at a time and replaces the index atomically after each;
`FeatureLog` collects a conversation's features as the batch engine feeds its positions.
"""

import json
import struct
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from safetensors.numpy import save_file

from ..errors import EagleError
from ..outputs import atomic_file
from ..tensorfiles import SAFETENSORS_DTYPES, safetensors_header

FORMAT = "eagle_mlx-features-1"
INDEX = "index.json"


def read_index(out: Path, flag: str = "--out"):
    """The folder's index (None for a new or empty folder); one sentence if it is not ours."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    if not out.is_dir():
        raise EagleError(f"{flag} {out} is a file, not a folder.")
    try:
        index = json.loads((out / INDEX).read_text(encoding="utf-8"))
        if index.get("format") != FORMAT:
            raise ValueError
    except (OSError, ValueError, AttributeError):
        what = "; choose a new folder" if flag == "--out" else ""
        raise EagleError(f"{flag} {out} is not an empty folder and holds no index written by "
                         f"eagle_mlx.regen{what}.") from None
    return index


def map_safetensors(path: Path) -> Dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only view of the mapped file."""
    try:
        header, start = safetensors_header(path)
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=start)
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            out[name] = data[a:b].view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
        return out
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise EagleError(f"{path} is not a readable feature shard ({e}).") from None


class FeatureShards:
    """The conversations of one or more feature folders, folder by folder in shard order,
    each readable by number. Every folder must hold the features of the same target and the
    same tap layers; `limit` keeps the first conversations of that order."""
    def __init__(self, folders, target=None, limit: Optional[int] = None):
        if isinstance(folders, (str, Path)):
            folders = [folders]
        self.folders = [Path(f).expanduser() for f in folders]
        if len(set(f.resolve() for f in self.folders)) != len(self.folders):
            raise EagleError("--features names the same folder twice; each conversation would "
                             "be trained on twice as often.")
        self.indexes = [self._read(f) for f in self.folders]
        self.folder, self.index = self.folders[0], self.indexes[0]
        self.settings = self.index["settings"]
        self.taps = list(self.settings.get("taps") or [])
        for folder, index in zip(self.folders[1:], self.indexes[1:]):
            if self._identity(index) != self._identity(self.index):
                raise EagleError(f"--features {folder} holds the features of a "
                                 f"{self._described(index)}, but {self.folder} those of a "
                                 f"{self._described(self.index)}; train on one target's "
                                 "features at a time.")
        if target is not None:
            self.check_target(target)
        self.rows: List[Tuple[int, int, int]] = []  # (folder, shard, conversation within it)
        self._maps: Dict[Tuple[int, int], Dict[str, np.ndarray]] = {}
        for f, index in enumerate(self.indexes):
            for s, entry in enumerate(index["shards"]):
                self.rows += [(f, s, j) for j in range(len(entry["sources"]))]
        if limit:
            self.rows = self.rows[:limit]

    @staticmethod
    def _read(folder: Path):
        if not folder.is_dir():
            raise EagleError(f"--features {folder} is not a folder of feature shards "
                             "(python -m eagle_mlx.regen --out writes one).")
        index = read_index(folder, "--features")
        if index is None or not index["shards"]:
            raise EagleError(f"--features {folder} holds no shard yet.")
        return index

    @staticmethod
    def _identity(index):
        return (index.get("model_type"), index.get("hidden_size"), index.get("num_layers"),
                list(index["settings"].get("taps") or []))

    @staticmethod
    def _described(index) -> str:
        kind, hidden, layers, taps = FeatureShards._identity(index)
        return (f"{kind} target (hidden {hidden}, {layers} layers, "
                f"taps {taps or 'none'})")

    def check_target(self, target) -> None:
        have = self._identity(self.index)[:3]
        want = (target.model_type, target.hidden_size, target.num_layers)
        if have != want:
            raise EagleError(f"--features {self.folder} holds the features of a {have[0]} target "
                             f"(hidden {have[1]}, {have[2]} layers), not of this one "
                             f"({want[0]}, hidden {want[1]}, {want[2]} layers).")

    def __len__(self) -> int:
        return len(self.rows)

    def _shard(self, f: int, s: int) -> Dict[str, np.ndarray]:
        if (f, s) not in self._maps:
            entry = self.indexes[f]["shards"][s]
            path = self.folders[f] / entry["file"]
            arrays = map_safetensors(path)
            missing = {"tokens", "loss_mask", "offsets", "hidden"} - set(arrays)
            if missing or len(arrays["offsets"]) != len(entry["sources"]) + 1:
                raise EagleError(f"{path} is not a shard this index describes (missing "
                                 f"{sorted(missing)} or another count).")
            self._maps[f, s] = arrays
        return self._maps[f, s]

    def _span(self, i: int):
        f, s, j = self.rows[i]
        a = self._shard(f, s)
        return a, int(a["offsets"][j]), int(a["offsets"][j + 1])

    def tokens_and_mask(self, i: int, max_len: int) -> Tuple[List[int], List[int]]:
        a, lo, hi = self._span(i)
        hi = min(hi, lo + max_len)
        return a["tokens"][lo:hi].tolist(), a["loss_mask"][lo:hi].tolist()

    def rows_of(self, i: int, key: str, n: int) -> np.ndarray:
        """The first n positions of conversation i's `hidden` or `taps` (float16 views)."""
        a, lo, _ = self._span(i)
        if key not in a:
            raise EagleError(f"--features {self.folders[self.rows[i][0]]} was written without "
                             "EAGLE-3 taps (regen --no-taps); an EAGLE-3 head trains on them.")
        return a[key][lo:lo + n]

    def answer_counts(self, ids, vocab_size: int) -> np.ndarray:
        """How often each token is an answer token in the conversations `ids`."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for i in ids:
            a, lo, hi = self._span(i)
            t = a["tokens"][lo:hi][a["loss_mask"][lo:hi] > 0].astype(np.int64)
            np.add.at(counts, t[(t >= 0) & (t < vocab_size)], 1)
        return counts


# ------------------------------------------------------------------ writing
# ------------------------------------------------------------------ index
def write_index(out: Path, index: dict) -> None:
    atomic_file(out / INDEX, lambda tmp: tmp.write_text(json.dumps(index, indent=1),
                                                         encoding="utf-8"))


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
        block = (position, hidden.astype(mx.float16), [t.astype(mx.float16) for t in tapped])
        self.blocks.append(block)
        FeatureLog.pending += [block[1], *block[2]]

    @classmethod
    def settle(cls) -> None:
        mx.eval(cls.pending)
        cls.pending = []

    def copy(self) -> "FeatureLog":
        """What is logged so far (later feeds go to this log only)."""
        log = FeatureLog()
        log.blocks = list(self.blocks)
        return log

    def arrays(self, length: int) -> dict:
        """float16 {"hidden": [length, H], "taps": [length, taps x H]} of positions 0..length-1."""
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
