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

A batch (`batch.BatchGenerator`) drafts every row through `propose_batch`: rows whose
drafters give the same `batch_key` draft in one call (an EAGLE head: one forward per level
for all of them, over the batch's ragged head caches; a Gemma 4 assistant: one per level over
the target's), the others one by one. Where the
batch holds a head's caches (`head_caches`), a row drafting on its own takes its row out
of them and puts it back.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .tree import Tree


@dataclass
class DraftRow:
    """One sequence of a batch, as its drafter sees it."""

    index: int      # its row in the batch
    drafter: "Drafter"
    state: object   # the engine's State: the drafter's state, features, tokens and root


class Drafter:
    """The interface (see the module's docstring). `owner` identifies what the drafter's
    state belongs to, so that a prompt cache made with one is not reused by another."""

    features: Optional[Tuple[int, ...]] = None
    max_depth: int = 1
    drafts_ahead: bool = False  # the engine may draft its next tree before the caller's turn
    # reads the target's committed keys and values: the engine (or a batch) says where they
    # are before each proposal (`take_kv`)
    reads_kv: bool = False

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

    def take_kv(self, state, caches, n: int, row: Optional[int] = None) -> None:
        """For a drafter that `reads_kv`: the target's caches (a batch's, with the sequence's
        `row`) hold its `n` committed positions, read before the next proposal."""
        raise NotImplementedError

    def begin(self, state) -> None:
        """A generation starts on `state` (fresh, or a prompt cache's). Nothing here."""

    def observe(self, state, accepted: List[int], seconds: Optional[float]) -> None:
        """After a cycle: the drafted tokens the target accepted, in order, and the seconds
        the cycle took (None where it was not timed alone). Nothing here."""

    def drafting(self, state) -> Optional[float]:
        """Seconds the latest proposal spent drafting, as the drafter's costs say (a batch's
        cycle is timed whole and shared out by them); None: it has no costs."""
        return None

    def observe_in_batch(self, state, accepted: List[int], seconds: Optional[float],
                         width: int, drafting: float) -> None:
        """After a cycle of a batch that took `seconds` (None: not this row's to learn
        from: its tree was not the widest), its pass `width` nodes a row wide and its rows'
        drafting `drafting` seconds as their costs say (`drafting`): here, as an untimed
        cycle of its own."""
        self.observe(state, accepted, None)

    def plain_ahead(self, state) -> bool:
        """Before the engine knows this cycle's tokens (a plain pass's): whether the next
        cycle is a plain pass whatever they are — then it is decided now, and the engine
        starts it at once, as mlx-lm's plain decoding does. Only for a drafter that
        `drafts_ahead`; here: never."""
        return False

    def chosen(self, state) -> Optional[str]:
        """What the latest cycle drafted, for a drafter that chooses (None: always the
        same)."""
        return None

    # ---------------------------------------------------------------- in a batch
    def head_caches(self, state) -> Optional[list]:
        """The per-layer KV caches of a head inside `state`, which a batch may hold in its
        own ragged caches while the sequence decodes in it (None: no head)."""
        return None

    def batch_key(self):
        """Rows whose drafters give the same key (not None) draft together, in one
        `propose_batch` call; None: alone."""
        return None

    def propose_batch(self, rows: Sequence[DraftRow], cache=None) -> List[Tree]:
        """The trees of `rows` (drafters with this one's `batch_key`, or this one alone);
        cache: the batch's head caches (a `BatchHeadCache`) where it holds them. Row by row
        here."""
        trees = []
        for r in rows:
            s = r.state
            own = None if cache is None else r.drafter.head_caches(s.drafter)
            if own is not None:  # its head's caches live in the batch: out and back
                cache.copy_out(r.index, own)
            trees.append(r.drafter.propose(s.drafter, s.feats, s.tokens, s.root))
            if own is not None:
                cache.copy_in(r.index, own)
        return trees


class HeadDrafter(Drafter):
    """A drafter whose per-sequence state is its head's own (`head.make_cache()`, with an
    `offset` and a `truncate`), the head being what a prompt cache's state belongs to."""

    head = None

    @property
    def owner(self):
        return self.head

    def new_state(self):
        return self.head.make_cache()

    def offset(self, state) -> int:
        return state.offset

    def truncate(self, state, length: int) -> None:
        state.truncate(length)
