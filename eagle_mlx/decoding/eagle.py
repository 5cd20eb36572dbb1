"""The EAGLE drafter: an EAGLE-1 or EAGLE-3 head (or a model's MTP module) drafting the
EAGLE-2 dynamic tree or the EAGLE-1 static tree (`tree.py`), alone or a batch's rows in one
forward per level."""

from typing import List, Sequence

from .drafters import DraftRow, HeadDrafter
from .tree import StaticTree, Tree, draft_dynamic, draft_dynamic_batch


class EagleDrafter(HeadDrafter):
    """An EAGLE-1 or EAGLE-3 head: the EAGLE-2 dynamic tree (`total_tokens` nodes with the
    root, `depth` levels, `top_k` children per node) or a static tree (`tree_choices`)."""

    def __init__(self, head, target, total_tokens: int, depth: int, top_k: int,
                 tree_choices=None):
        self.head, self.target = head, target
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, top_k
        self.static = StaticTree(tree_choices, top_k) if tree_choices else None
        self.max_depth = self.static.max_depth if self.static else depth + 1
        self.features = head.feature_taps(target)

    def propose(self, state, features, tokens, root) -> Tree:
        if self.static is not None:
            return self.static.draft(self.head, self.target, state, features, tokens, root)
        return draft_dynamic(self.head, self.target, state, features, tokens, root,
                             self.total_tokens, self.depth, self.top_k)

    def head_caches(self, state) -> list:
        return self.head.cache_layers(state)

    def batch_key(self):
        """Dynamic trees of one shape, with a head whose layers a batch can hold."""
        if self.static is not None or not self.head.drafts_batched or \
                self.head.draft_window is not None:  # (a window: its own caches, alone)
            return None
        return ("eagle", id(self.head), self.depth, self.top_k)

    def propose_batch(self, rows: Sequence[DraftRow], cache=None) -> List[Tree]:
        if self.batch_key() is None or cache is None:
            return super().propose_batch(rows, cache)
        states = [r.state for r in rows]
        return draft_dynamic_batch(self.head, self.target, cache, [s.feats for s in states],
                                   [s.tokens for s in states], [s.root for s in states],
                                   [r.index for r in rows],
                                   [r.drafter.total_tokens for r in rows], self.depth,
                                   self.top_k)
