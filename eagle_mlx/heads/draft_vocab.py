"""A reduced draft vocabulary for EAGLE-1 heads (EAGLE-3's `d2t` idea, for heads without it).

An EAGLE-1 head drafts through the target's lm_head: every draft level multiplies each
frontier node by the whole vocabulary (SmolLM2's tied 49152 x 576 matrix is a fifth of
the model). Keeping only the N target tokens that answers use most makes each level read
N rows instead. It stays lossless: the target verifies every drafted token, and a token
outside the N is still produced by the target (as the bonus token), just never drafted.

The ranking comes from token frequencies in assistant replies (ShareGPT by default, or
the user's ShareGPT-style data) tokenized with the target's tokenizer; rankings are kept
in the user's cache, keyed by the tokenizer's vocabulary and the data, and a package may
ship rankings under the same keys (the demo target's).
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import mlxlm
from ..errors import EagleError, is_int
from ..outputs import atomic_file, user_cache

COUNT_CONVERSATIONS = 4000  # ShareGPT conversations counted (about 4M answer tokens)


@dataclass
class DraftVocab:
    """The draft's token ids (in target ids) and the lm_head rows that score them."""

    ids: mx.array   # [N] int32
    rows: mx.array  # [N, H]

    @property
    def size(self) -> int:
        return self.ids.shape[0]


def count_tokens(tokenizer, conversations, vocab_size: int) -> np.ndarray:
    """How often each target token occurs in the assistant replies (plus one end-of-turn
    per reply): what a draft of answers needs."""
    texts = [m["content"] for c in conversations for m in c if m["role"] == "assistant"]
    counts = np.zeros(vocab_size, dtype=np.int64)
    fast = mlxlm.batch_encoder(tokenizer)
    for start in range(0, len(texts), 256):
        chunk = texts[start:start + 256]
        if fast is not None:
            encoded = fast(chunk, add_special_tokens=False)["input_ids"]
        else:
            encoded = [tokenizer.encode(t, add_special_tokens=False) for t in chunk]
        for ids in encoded:
            ids = np.asarray(ids, dtype=np.int64)
            np.add.at(counts, ids[(ids >= 0) & (ids < vocab_size)], 1)
    for eos in getattr(tokenizer, "eos_token_ids", None) or []:
        if 0 <= eos < vocab_size:
            counts[eos] += len(texts)
    return counts


def ranking(counts: np.ndarray) -> np.ndarray:
    """Token ids from most to least frequent (ties: lower id first)."""
    return np.lexsort((np.arange(len(counts)), -counts))


def eagle3_mapping(counts: np.ndarray, n: int):
    """EAGLE-3's draft vocabulary from token counts, in the published layout: the n most
    frequent target ids in increasing order; `d2t[i]` = target id of draft id i minus i
    (an offset), `t2d[t]` = whether target id t is in the draft vocabulary."""
    if not 1 <= n <= len(counts):
        raise EagleError(f"the draft vocabulary size must be from 1 to the target's vocabulary "
                         f"size {len(counts)} (got {n}).")
    ids = np.sort(ranking(counts)[:n])
    t2d = np.zeros(len(counts), dtype=bool)
    t2d[ids] = True
    return (ids - np.arange(n)).astype(np.int64), t2d


def ranking_file(tokenizer, vocab_size: int, data: Optional[str]) -> str:
    """The name a ranking is kept under: a hash of the tokenizer's vocabulary, the data
    counted and how much of it (the same name in the user's cache and in a shipped folder)."""
    vocab = getattr(tokenizer, "vocab", None) or {}
    key = json.dumps({"vocab": hashlib.sha256(json.dumps(sorted(vocab.items())).encode())
                      .hexdigest(), "size": vocab_size,
                      "data": str(Path(data).resolve()) if data else "sharegpt",
                      "n": COUNT_CONVERSATIONS}, sort_keys=True)
    return f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.npy"


def token_ranking(tokenizer, vocab_size: int, data: Optional[str],
                  read_conversations: Callable[[Optional[str], int], list],
                  shipped: Sequence[Path] = ()) -> np.ndarray:
    """The target's tokens ranked by frequency in answers: from the user's cache or a
    shipped folder of rankings (found by `ranking_file`), else counted in
    `read_conversations(data, COUNT_CONVERSATIONS)` once and cached."""
    name = ranking_file(tokenizer, vocab_size, data)
    path = user_cache("draft_vocab") / name
    for found in [path] + [Path(folder) / name for folder in shipped]:
        if found.is_file():
            try:
                return np.load(found).astype(np.int32)
            except (OSError, ValueError):
                pass  # a damaged cache file is counted again
    conversations = read_conversations(data, COUNT_CONVERSATIONS)
    order = ranking(count_tokens(tokenizer, conversations, vocab_size)).astype(np.int32)
    try:
        atomic_file(path, lambda t: np.save(t, order))
    except EagleError:
        pass  # an unwritable cache only costs the count next time
    return order


def check_size(target, n) -> None:
    """A draft vocabulary size the target can have: a whole number from 1 to its vocabulary."""
    if not is_int(n) or not 1 <= n <= target.vocab_size:
        raise EagleError(f"draft_vocab must be from 1 to the vocabulary size {target.vocab_size} "
                         f"(got {n!r}).")


def draft_vocab(target, order: np.ndarray, n: int) -> DraftVocab:
    """The n most frequent tokens of `order` (kept in id order) and their lm_head rows."""
    check_size(target, n)
    ids = mx.array(np.sort(np.asarray(order[:n])).astype(np.int32))
    return DraftVocab(ids, lm_head_rows(target, ids))


def lm_head_rows(target, ids: mx.array) -> mx.array:
    """Rows of the target's output matrix (dequantized where it is quantized)."""
    lm = target.family.lm
    head = lm.lm_head if hasattr(lm, "lm_head") else target.embed_tokens
    if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w = mx.dequantize(head.weight[ids], head.scales[ids],
                          None if head.biases is None else head.biases[ids],
                          head.group_size, head.bits, mode=head.mode)
        rows = w.astype(head.scales.dtype)
    else:
        rows = head.weight[ids]
    mx.eval(rows)
    return rows
