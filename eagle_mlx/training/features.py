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
"""

import json
import struct
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import EagleError
from ..heads.mtp import SAFETENSORS_DTYPES, safetensors_header

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
