"""Drafting with a block drafter (a DFlash checkpoint, `heads.dflash`): one forward over
the block `[root, mask, ...]` gives a distribution for each of the next positions, and the
tree is built from them at once.

DDTree (Ringel & Romano, Algorithm 1): the `budget` prefixes of largest drafter
probability, the probability of a prefix being the product of its tokens' per-position
probabilities, over the `top_k` most likely tokens of each position. Log-probabilities are
at most 0, so a prefix scores at least as much as any extension of it and the best
`budget` prefixes are a tree: the paper's best-first search pops exactly them. Here they
are found without a heap, level by level on the device (a prefix of depth d among the best
can only extend one of the best of depth d - 1), ties going to the shallower and earlier
prefix, so that the set is closed under prefixes whatever the scores. With top_k = 1 the
tree is the chain of the block's most likely tokens: the checkpoint's own block decoding.

The tree's nodes are deterministic candidates, so the engine's acceptance (greedy, or
recursive rejection with q(x) = 1 over siblings) keeps the output exactly the target's. A chain
(top_k 1) is drawn from the block's distributions when sampling (`Engine.sampled`) and accepted
with min(1, p/q), as the checkpoints' own decoding does.
"""

from typing import List, Optional

import mlx.core as mx

from ..targets.layers import log_softmax
from .compiled import compiled
from .drafters import HeadDrafter
from .tree import Tree, top_k_entries, ancestors


def level_sizes(budget: int, top_k: int, levels: int) -> List[int]:
    """How many prefixes of each depth can be among the best `budget`."""
    sizes, f = [], 1
    for _ in range(levels):
        f = min(budget, f * top_k)
        sizes.append(f)
    return sizes


def _ddtree(budget: int, top_k: int, levels: int, logprobs: mx.array, root: mx.array):
    """The DDTree under `root` from per-position log-probabilities [levels, V]: (tokens,
    parents, scores) with the root first, then the kept prefixes level by level (each
    level's in descending score)."""
    top_ids, top_lp = top_k_entries(logprobs, top_k)                        # [levels, K]
    sizes = level_sizes(budget, top_k, levels)
    scores, tokens, parents = [], [], []
    frontier = mx.zeros((1,), dtype=logprobs.dtype)                 # the root's score
    frontier_pool = mx.zeros((1,), dtype=mx.int32)                  # its pool index (root 0)
    offset = 1
    for d, size in enumerate(sizes):
        cand = (frontier[:, None] + top_lp[d][None, :]).reshape(-1)
        pick, best = top_k_entries(cand, size)
        scores.append(best)
        tokens.append(top_ids[d][pick % top_k])
        parents.append(frontier_pool[pick // top_k])
        frontier, frontier_pool = best, offset + mx.arange(size, dtype=mx.int32)
        offset += size
    pool_scores = mx.concatenate(scores)
    pool_tokens = mx.concatenate(tokens)
    pool_parents = mx.concatenate(parents)                          # pool index, root 0
    P = pool_scores.shape[0]
    n = min(budget, P)
    # rank among the pool: higher score first, ties to the earlier (shallower) prefix
    idx = mx.arange(P)
    before = (pool_scores[None, :] > pool_scores[:, None]) | \
        ((pool_scores[None, :] == pool_scores[:, None]) & (idx[None, :] < idx[:, None]))
    rank = before.sum(axis=1)
    keep = mx.sort(mx.argsort(rank)[:n])                            # in pool order
    pool_parent = pool_parents[keep]                                # 0 = root, else 1 + index
    # a parent's place among the kept nodes, +1 for the root in front
    node_parent = (keep[None, :] < (pool_parent - 1)[:, None]).sum(axis=1) + 1
    node_parent = mx.where(pool_parent == 0, 0, node_parent).astype(mx.int32)
    out_tokens = mx.concatenate([root.reshape(1).astype(pool_tokens.dtype), pool_tokens[keep]])
    out_parents = mx.concatenate([mx.zeros((1,), dtype=mx.int32), node_parent])
    out_scores = mx.concatenate([mx.zeros((1,), dtype=pool_scores.dtype), pool_scores[keep]])
    return out_tokens, out_parents, out_scores


def build_ddtree(logprobs: mx.array, root: mx.array, budget: int, top_k: int,
                 levels: Optional[int] = None) -> Tree:
    """A DDTree of at most `budget` nodes below `root` (see the module's docstring) from
    per-position log-probabilities [L, V], at most `levels` deep (default L), over the
    `top_k` most likely tokens of each position."""
    L, V = logprobs.shape
    levels = L if levels is None else min(levels, L)
    top_k = max(1, min(top_k, budget, V))
    tokens, parents, scores = compiled(_ddtree, budget, top_k, levels)(logprobs[:levels], root)
    anc = ancestors(parents, levels)
    return Tree(tokens, parents, anc, anc.sum(axis=1) - 1, scores)


class BlockDrafter(HeadDrafter):
    """A block drafter's DDTree of `total_tokens` nodes with the root, at most `depth` + 1
    levels (as an EAGLE-2 tree's `depth`; at most the block's size - 1), `top_k` candidates
    per position (1: the chain). The block run is as long as the tree is deep (the
    checkpoint's block size at most)."""

    def __init__(self, head, target, total_tokens: int, depth: int, top_k: int,
                 window: Optional[int] = None):
        self.head, self.target = head, target
        self.total_tokens, self.top_k, self.window = total_tokens, top_k, window
        self.levels = max(1, min(depth + 1, head.predicts, total_tokens - 1))
        self.max_depth = self.levels
        self.features = head.feature_taps(target)

    def new_state(self):
        return self.head.make_cache(self.window)

    def _catch_up(self, state, features) -> None:
        """The committed positions' features [m, F] into the context (none: nothing new)."""
        if features is not None and features.shape[0]:
            self.head.add_context(state, features)

    def block_logprobs(self, state, features, root) -> mx.array:
        """Catch up on the committed positions' features [m, F], then the block's
        log-probabilities of the next `levels` positions [levels, V]."""
        self._catch_up(state, features)
        hidden = self.head.predict_hidden(state, root, self.target, self.levels)
        return log_softmax(self.head.logits(hidden, self.target).astype(mx.float32))

    def propose(self, state, features, tokens, root) -> Tree:
        if self.head.selects:  # DFlash 2's selector, DSpark's Markov head: a chain
            return self._selected(state, features, root)
        lp = self.block_logprobs(state, features, root)
        tree = build_ddtree(lp, root, self.total_tokens - 1, self.top_k, self.levels)
        if self.top_k == 1:  # a chain: when sampling, drawn from the block as the references do
            chain = lp[: tree.tokens.shape[0] - 1]

            def draw(sampling, key):
                q = sampling.logprobs(chain)
                return mx.random.categorical(q, key=key), q

            tree.draw = draw
        return tree

    def _selected(self, state, features, root) -> Tree:
        """A chain walked slot by slot (DFlash 2's candidate selector, DSpark's Markov head):
        the best-scored walk, or drawn under the generation's settings when sampling."""
        self._catch_up(state, features)
        n = min(self.levels, self.total_tokens - 1)
        hidden = self.head.predict_hidden(state, root, self.target, n)
        logits = self.head.logits(hidden, self.target).astype(mx.float32)
        select = self.head.chain
        chain, _ = select(hidden, logits, root)
        threshold = self.head.args.confidence_threshold
        if threshold is not None and "confidence_head" in self.head:
            # DSpark: the depth this cycle is worth, from the greedy walk (SYNC: the tree's
            # size must be known before the verify is built)
            alive = self.head.survival(hidden, chain, root) >= threshold
            keep = max(1, int(mx.cumprod(alive.astype(mx.int32)).sum().item()))
            if keep < n:
                n, hidden, logits, chain = keep, hidden[:keep], logits[:keep], chain[:keep]
        parents = mx.arange(-1, n, dtype=mx.int32).at[0].add(1)       # 0, 0, 1, ..., n - 1
        tree = Tree(mx.concatenate([root.reshape(1).astype(chain.dtype), chain]), parents,
                    ancestors(parents, n), mx.arange(n + 1), mx.zeros((n + 1,)))
        tree.draw = lambda sampling, key: select(hidden, logits, root, sampling, key)
        return tree
