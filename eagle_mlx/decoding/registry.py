"""Which drafter drafts a head's trees: the one place that knows every drafter class, above
them (the interface, `drafters.py`, knows none of them)."""

from .assistant import AssistantDrafter
from .block import BlockDrafter
from .drafters import Drafter
from .eagle import EagleDrafter


def head_drafter(head, target, total_tokens: int, depth: int, top_k: int,
                 tree_choices=None) -> Drafter:
    """The drafter of a head's trees: an EAGLE (or MTP) head's EAGLE-2 or static tree, a
    block drafter's DDTree (`block.BlockDrafter`; the same sizes: `total_tokens` nodes with
    the root, `depth` + 1 levels at most, `top_k` candidates per node or position), a Gemma 4
    assistant's trees (`assistant.AssistantDrafter`)."""
    if getattr(head, "block", False):
        return BlockDrafter(head, target, total_tokens, depth, top_k)
    if getattr(head, "reads_kv", False):  # a Gemma 4 assistant
        return AssistantDrafter(head, target, total_tokens, depth, top_k)
    return EagleDrafter(head, target, total_tokens, depth, top_k, tree_choices)
