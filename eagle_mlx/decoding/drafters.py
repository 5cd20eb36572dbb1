"""Drafters: what a speculative cycle asks of whatever proposes the tree.

A cycle asks a drafter two things, and nothing more:

* catch up on the positions the target accepted since its last proposal: their tokens and,
  where the drafter reads them, the target's features at the positions before them;
* propose a tree under the token the target sampled last (the root): tokens, the parent of
  each node and a score per node (`tree.Tree`), at most `max_depth` levels below the root.

Both happen in one call, `propose`, so a head can fold its catch-up into the lazy graph of
the draft. A drafter keeps its per-sequence state in an object of its own (`new_state()`),
held by the engine's state and by a `PromptCache` between calls; `offset(state)` is how
many positions it has seen and `truncate(state, n)` forgets the rest.

`features` says what the drafter reads from the target: None (nothing), () (the post-norm
last hidden state) or a tuple of decoder layers whose inputs it reads (EAGLE-3).
"""

from typing import Optional, Tuple

import mlx.core as mx

from .tree import StaticTree, Tree, draft_dynamic


class Drafter:
    """The interface (see the module's docstring). `owner` identifies what the drafter's
    state belongs to, so that a prompt cache made with one is not reused by another."""

    features: Optional[Tuple[int, ...]] = None
    max_depth: int = 1

    @property
    def owner(self):
        return self

    def new_state(self):
        raise NotImplementedError

    def offset(self, state) -> int:
        raise NotImplementedError

    def truncate(self, state, length: int) -> None:
        raise NotImplementedError

    def propose(self, state, features: Optional[mx.array], tokens: mx.array,
                root: mx.array) -> Tree:
        """features [m, F] (None where `features` is None) and tokens [m]: the positions
        this drafter has not seen, token i following the position of feature i (the last
        token is the root). Returns the tree to verify, root first."""
        raise NotImplementedError


class EagleDrafter(Drafter):
    """An EAGLE-1 or EAGLE-3 head: the EAGLE-2 dynamic tree (`total_tokens` nodes with the
    root, `depth` levels, `top_k` children per node) or a static tree (`tree_choices`)."""

    def __init__(self, head, target, total_tokens: int, depth: int, top_k: int,
                 tree_choices=None):
        self.head, self.target = head, target
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, top_k
        self.static = StaticTree(tree_choices, top_k) if tree_choices else None
        self.max_depth = self.static.max_depth if self.static else depth + 1
        self.features = head.feature_taps(target)

    @property
    def owner(self):
        return self.head

    def new_state(self):
        return self.head.make_cache()

    def offset(self, state) -> int:
        return state.offset

    def truncate(self, state, length: int) -> None:
        state.truncate(length)

    def propose(self, state, features, tokens, root) -> Tree:
        if self.static is not None:
            return self.static.draft(self.head, self.target, state, features, tokens, root)
        return draft_dynamic(self.head, self.target, state, features, tokens, root,
                             self.total_tokens, self.depth, self.top_k)
