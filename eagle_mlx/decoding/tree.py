"""Drafting a tree with an EAGLE head (docs/eagle.md §1 step 2).

Every drafter's proposal comes out in the same form, ready for one verify pass:
  tokens  [N]  target token ids, node 0 = the root (the last sampled token)
  parents [N]  parent node of each node (the root is its own parent); parents precede children
  scores  [N]  the drafter's score of each node (log-probability of its path for a head; the
               root 0); lazy, so it costs nothing where no one reads it
  anc     [N, N] ancestor-or-self mask: the tree attention mask (derived from parents)
  depth   [N]  distance from the root: the position offset of each node (derived from parents)

The dynamic tree (EAGLE-2) grows `depth` levels keeping the best `draft_top_k` frontier
nodes by cumulative log-probability, then keeps the `total_tokens - 1` best nodes of the
whole pool. The static tree (EAGLE-1) drafts the fixed `tree_choices` level by level.
Everything is built as lazy MLX graphs: one head call per level, no loop over nodes.
"""

from dataclasses import asdict, dataclass, replace
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..targets.layers import log_softmax
from .compiled import compiled

# The static tree of the official EAGLE-1 code (eagle-llm's `mc_sim_7b_63`): 25 nodes + root.
MC_SIM_7B_63 = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]


@dataclass
class Tree:
    tokens: mx.array
    parents: mx.array
    anc: mx.array
    depth: mx.array
    scores: Optional[mx.array] = None
    levels: Optional[int] = None  # a bound on its depth below the root (None: the drafter's)
    # a chain whose tokens are drawn when sampling (`Engine.sampled`): draw(sampling, key) ->
    # (its tokens below the root [N - 1], the log-probabilities they were drawn from
    # [N - 1, V]); `q`: those distributions after the draw [N, V] (row 0 unused), which
    # acceptance then reads
    draw: Optional[object] = None
    q: Optional[mx.array] = None


def tree_from_parents(tokens: mx.array, parents: mx.array, scores: mx.array,
                      max_depth: int) -> Tree:
    """A Tree from its tokens, parent pointers and scores (nodes at most `max_depth` below
    the root): the ancestor mask and depths follow."""
    anc = ancestors(parents, max_depth)
    return Tree(tokens, parents, anc, anc.sum(axis=1) - 1, scores)


def pruned(tree: Tree, max_depth: int) -> Tree:
    """The tree's nodes at most `max_depth` below the root, in their order (a sync: which
    nodes those are)."""
    depth = np.array(tree.depth)
    keep = np.flatnonzero(depth <= max_depth)
    if len(keep) == len(depth):
        return tree
    place = np.zeros(len(depth), dtype=np.int32)
    place[keep] = np.arange(len(keep), dtype=np.int32)
    idx = mx.array(keep.astype(np.int32))
    parents = mx.array(place[np.array(tree.parents)[keep]])
    cut = lambda x: None if x is None else x[idx]  # noqa: E731
    return replace(tree, tokens=tree.tokens[idx], parents=parents.astype(tree.parents.dtype),
                   anc=tree.anc[idx][:, idx], depth=tree.depth[idx], scores=cut(tree.scores),
                   q=cut(tree.q), levels=max_depth, draw=None)


def top_k_entries(x: mx.array, k: int):
    """The k largest entries of the last axis, largest first: (indices, values)."""
    idx = mx.argpartition(-x, kth=k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(x, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def ancestors(parents: mx.array, max_depth: int) -> mx.array:
    """Ancestor-or-self mask from parent pointers (root = its own parent)."""
    n = parents.shape[0]
    eye = mx.eye(n, dtype=mx.bool_)
    anc = eye
    for _ in range(max_depth):  # pointer jumping one level at a time: depth, not nodes
        anc = eye | anc[parents]
    return anc


def first_level(k: int, logits: mx.array):
    """The root's k best children: (draft ids [k], log-probabilities [k])."""
    return top_k_entries(log_softmax(logits), k)


def next_level_batch(logits: mx.array, scores: mx.array, tree_mask: mx.array):
    """One level of the dynamic tree for B rows, from the head's logits [B, k, V] at each
    row's k frontier nodes: each node's k best children, their cumulative scores, and the k
    best of those k*k as the next frontier (which candidates, their scores [B, k], which
    frontier node each came from, and the frontier's mask over the drafted levels)."""
    B, k = scores.shape
    child_ids, child_lp = top_k_entries(log_softmax(logits), k)                 # [B, k, k]
    cum = (child_lp + scores[..., None]).reshape(B, -1)
    chosen, best = top_k_entries(cum, k)
    from_node = chosen // k
    picked = mx.take_along_axis(tree_mask, from_node[..., None], axis=1)
    mask = mx.concatenate([picked, mx.broadcast_to(mx.eye(k, dtype=mx.bool_), (B, k, k))], axis=2)
    return child_ids.reshape(B, -1), cum, chosen, best, from_node, mask


def _next_level(logits: mx.array, scores: mx.array, tree_mask: mx.array):
    """`next_level_batch` for one sequence: logits [k, V], scores [k], tree_mask [k, W]."""
    return tuple(x[0] for x in next_level_batch(logits[None], scores[None], tree_mask[None]))


def parent_offset(level: int, top_k: int) -> int:
    """Pool ids of the frontier chosen at `level`: 1 + flat index into the concatenated
    levels' scores (level 0 has k nodes, every later level k*k candidates)."""
    return 1 + top_k * top_k * max(0, level - 1) + (top_k if level > 0 else 0)


def _rerank(n: int, top_k: int, depth: int, all_scores, all_tokens, all_parents, root):
    """The n best nodes of the pool, in pool order (parents first), as a tree under root."""
    keep = mx.sort(mx.argpartition(-all_scores, kth=n - 1)[:n])
    node_tokens = all_tokens[keep]
    pool_parent = all_parents[keep // top_k]  # 0 = root, else 1 + pool index
    # a parent's place among the kept nodes (searchsorted), +1 for the root in front
    parent_node = (keep[None, :] < (pool_parent - 1)[:, None]).sum(axis=1) + 1
    parent_node = mx.where(pool_parent == 0, 0, parent_node)
    parents = mx.concatenate([mx.zeros((1,), dtype=parent_node.dtype), parent_node])
    tokens = mx.concatenate([root.reshape(1).astype(node_tokens.dtype), node_tokens])
    anc = ancestors(parents, depth + 1)
    scores = mx.concatenate([mx.zeros((1,), dtype=all_scores.dtype), all_scores[keep]])
    return tokens, parents, anc, anc.sum(axis=1) - 1, scores


def _tree_step_mask(stable: int, tree_mask: mx.array) -> mx.array:
    k = tree_mask.shape[0]
    return mx.concatenate([mx.ones((k, stable), dtype=mx.bool_), tree_mask], axis=1)


def draft_dynamic(head, target, cache, features: mx.array, tokens: mx.array, root: mx.array,
                  total_tokens: int, depth: int, top_k: int) -> Tree:
    """EAGLE-2 dynamic tree, exactly as the official `topK_genrate` builds it.

    features [m, F] paired with tokens [m] are the positions the head has not seen
    (feature i with token i+1, the last pair being (f_last, root)). `cache` keeps
    only real positions: the tree levels are dropped again before returning.
    (Kept apart from `draft_dynamic_batch` for speed: a batch of one, with its ragged caches
    and masks, decodes slower than this path — docs/performance.md, continuous batching.)
    """
    embed = target.embed_tokens
    out = head(features[None], tokens[None], embed, cache, fed_back=False)
    stable = cache.offset
    last = out[:, -1:]                                         # [1, 1, H]
    ids, scores = compiled(first_level, top_k)(head.logits(last[0, 0], target))
    ids = head.to_target_ids(ids)
    scores_list, tokens_list = [scores], [ids]
    parents_list = [mx.zeros((1,), dtype=mx.int32)]
    hidden = mx.repeat(last, top_k, axis=1)                    # [1, k, H] frontier features
    frontier = ids                                             # [k] frontier tokens
    tree_mask = mx.eye(top_k, dtype=mx.bool_)                  # frontier x drafted levels
    chosen = mx.arange(top_k)                                  # frontier's place in its level
    for level in range(depth):
        positions = mx.full((top_k,), stable + level, dtype=mx.int32)
        out = head(hidden, frontier[None], embed, cache, positions=positions,
                   mask=_tree_step_mask(stable, tree_mask), fed_back=True)    # [1, k, H]
        parents_list.append(chosen + parent_offset(level, top_k))
        child_ids, cum, chosen, scores, from_node, tree_mask = compiled(_next_level)(
            head.logits(out[0], target), scores, tree_mask)
        hidden = out[:, from_node]
        child_ids = head.to_target_ids(child_ids)
        frontier = child_ids[chosen]
        tokens_list.append(child_ids)
        scores_list.append(cum)
    cache.truncate(stable)

    # rerank: the total_tokens - 1 best of the pool, in pool order (parents first)
    return Tree(*compiled(_rerank, total_tokens - 1, top_k, depth)(
        mx.concatenate(scores_list), mx.concatenate(tokens_list), mx.concatenate(parents_list),
        root))


def draft_dynamic_batch(head, target, cache, features, tokens, roots,
                        rows, totals, depth: int, top_k: int):
    """`draft_dynamic` for several rows of a batch in one head pass per level, against the
    batch's head caches (a `targets.cache.BatchHeadCache`): rows (indices into the batch)
    draft, with features [m, F], tokens [m], root and tree size (`totals`) each; every
    other row of `cache` keeps what it holds. Returns the rows' trees."""
    embed = target.embed_tokens
    layers = cache.layers
    B = len(layers[0].lengths)
    m = [0] * B
    for r, t in zip(rows, tokens):
        m[r] = int(t.shape[0])
    M = max(m)
    F, dt = features[0].shape[-1], features[0].dtype
    feats = [mx.zeros((M, F), dt)] * B
    toks = [mx.zeros((M,), mx.int32)] * B
    for r, f, t in zip(rows, features, tokens):
        feats[r] = mx.pad(f, [(0, M - m[r]), (0, 0)])
        toks[r] = mx.pad(t.astype(mx.int32), (0, M - m[r]))
    held = layers[0].held
    positions = mx.array(held)[:, None] + mx.arange(M)[None, :]
    head_cache = head.batch_cache(cache)
    out = head(mx.stack(feats), mx.stack(toks), embed, head_cache, positions=positions,
               mask=layers[0].mask(None, M), fed_back=False)
    for c in layers:
        c.keep([list(range(n)) for n in m])
    stable = layers[0].held
    last = mx.take_along_axis(out, mx.array([max(n - 1, 0) for n in m])[:, None, None],
                              axis=1)                                        # [B, 1, H]
    ids, scores = top_k_entries(log_softmax(head.logits(last[:, 0], target)), top_k)   # [B, k]
    ids = head.to_target_ids(ids)
    scores_list, tokens_list = [scores], [ids]
    parents_list = [mx.zeros((B, 1), dtype=mx.int32)]
    hidden = mx.repeat(last, top_k, axis=1)                                    # [B, k, H]
    frontier = ids
    tree_mask = mx.broadcast_to(mx.eye(top_k, dtype=mx.bool_), (B, top_k, top_k))
    chosen = mx.broadcast_to(mx.arange(top_k), (B, top_k))
    for level in range(depth):
        positions = mx.broadcast_to(mx.array(stable)[:, None] + level, (B, top_k))
        out = head(hidden, frontier, embed, head_cache, positions=positions,
                   mask=layers[0].level_mask(stable, tree_mask), fed_back=True)   # [B, k, H]
        for c in layers:
            c.keep()
        parents_list.append(chosen + parent_offset(level, top_k))
        child_ids, cum, chosen, scores, from_node, tree_mask = compiled(next_level_batch)(
            head.logits(out, target), scores, tree_mask)
        hidden = mx.take_along_axis(out, from_node[..., None], axis=1)
        child_ids = head.to_target_ids(child_ids)
        frontier = mx.take_along_axis(child_ids, chosen, axis=1)
        tokens_list.append(child_ids)
        scores_list.append(cum)
    for c in layers:
        c.truncate_rows(stable)
    return reranked_rows(scores_list, tokens_list, parents_list, roots, totals, top_k, depth,
                         rows)


def reranked_rows(scores_list, tokens_list, parents_list, roots, totals, top_k: int,
                  depth: int, rows=None) -> List[Tree]:
    """The trees of several rows drafted at once (per level: scores, tokens and pool parents
    [N, ...]; `rows`: the drafting rows' indices, default all): each row's `total - 1` best
    nodes under its root."""
    all_scores = mx.concatenate(scores_list, axis=1)
    all_tokens = mx.concatenate(tokens_list, axis=1)
    all_parents = mx.concatenate(parents_list, axis=1)
    rows = range(len(roots)) if rows is None else rows
    return [Tree(*compiled(_rerank, total - 1, top_k, depth)(
        all_scores[r], all_tokens[r], all_parents[r], root))
        for r, root, total in zip(rows, roots, totals)]


@dataclass(frozen=True)
class TreeSpec:
    """The tree a generation drafts: `total_tokens` nodes with the root, `depth` levels,
    `draft_top_k` children per node; with `choices` (EAGLE-1 paths of child ranks) the
    static tree they spell, else the EAGLE-2 dynamic tree."""

    total_tokens: int
    depth: int
    draft_top_k: int
    choices: Optional[Tuple[Tuple[int, ...], ...]] = None

    @property
    def static(self) -> bool:
        return self.choices is not None

    @classmethod
    def from_choices(cls, tree_choices, draft_top_k: int) -> "TreeSpec":
        choices = tuple(tuple(c) for c in tree_choices)
        return cls(len(choices) + 1, max(map(len, choices)), draft_top_k, choices)

    def replace(self, **changes) -> "TreeSpec":
        return replace(self, **changes)

    def asdict(self) -> dict:
        """The three sizes (what the benchmark's tuning stores)."""
        d = asdict(self)
        del d["choices"]
        return d


class StaticTree:
    """An EAGLE-1 tree given as paths of child ranks (`tree_choices`), drafted level by level
    as the official EAGLE-1 code does: every node with children is fed to the head once."""

    def __init__(self, tree_choices: Sequence[Sequence[int]], top_k: int):
        choices = sorted((tuple(c) for c in tree_choices), key=lambda c: (len(c), c))
        if not choices or len(set(choices)) != len(choices):
            raise ValueError("tree_choices must be a non-empty list of distinct paths")
        index = {(): 0}
        for i, c in enumerate(choices):
            if c[:-1] not in index:
                raise ValueError(f"tree_choices has {list(c)} but not its parent {list(c[:-1])}")
            if not all(0 <= r < top_k for r in c):
                raise ValueError(f"tree_choices path {list(c)} uses a rank >= draft_top_k {top_k}")
            index[c] = i + 1
        self.top_k = top_k
        self.max_depth = max(len(c) for c in choices)
        has_children = {c[:-1] for c in choices}
        # fed[d]: nodes of depth d+1 that have children, in tree order (fed at draft step d)
        self.fed = [[c for c in choices if len(c) == d + 1 and c in has_children]
                    for d in range(self.max_depth - 1)]
        rank = {(): 0}
        for level in self.fed:
            rank.update({c: i for i, c in enumerate(level)})
        # node tokens: per depth d, flat index into the top-k of the parents fed at step d-1
        self.token_index = [
            mx.array([rank[c[:-1]] * top_k + c[-1] for c in choices if len(c) == d])
            for d in range(1, self.max_depth + 1)
        ]
        # each fed node's feature: the head output at its parent (for depth 1: the last position)
        self.hidden_index = [mx.array([rank[c[:-1]] for c in level]) for level in self.fed]
        self.fed_token_index = [mx.array([rank[c[:-1]] * top_k + c[-1] for c in level])
                                for level in self.fed]
        self.step_masks = []
        for d, level in enumerate(self.fed):
            cols = [c for lv in self.fed[: d + 1] for c in lv]
            m = np.array([[col == c[: len(col)] for col in cols] for c in level], dtype=bool)
            self.step_masks.append(mx.array(m))
        parents = [0] + [index[c[:-1]] for c in choices]
        self.parents = mx.array(parents)
        self.anc = ancestors(self.parents, self.max_depth)
        self.depth = mx.array([0] + [len(c) for c in choices])
        self.size = len(choices) + 1

    def draft(self, head, target, cache, features, tokens, root) -> Tree:
        embed = target.embed_tokens
        out = head(features[None], tokens[None], embed, cache, fed_back=False)
        stable = cache.offset
        logits = head.logits(out[0, -1:], target)              # [1, V]
        first_ids = top_k_entries(logits, self.top_k)[0]
        first_lp = mx.take_along_axis(log_softmax(logits), first_ids, axis=-1)
        topk_ids = [head.to_target_ids(first_ids)]             # per step: [parents, k]
        topk_lp = [first_lp]                                   # their log-probabilities
        hidden = out[:, -1:]
        for d, level in enumerate(self.fed):
            hidden = hidden[:, self.hidden_index[d]]            # [1, fed, H]
            toks = topk_ids[-1].reshape(-1)[self.fed_token_index[d]]
            positions = mx.full((len(level),), stable + d, dtype=mx.int32)
            out = head(hidden, toks[None], embed, cache, positions=positions,
                       mask=_tree_step_mask(stable, self.step_masks[d]), fed_back=True)
            hidden = out
            logits = head.logits(out[0], target)
            ids = top_k_entries(logits, self.top_k)[0]
            topk_ids.append(head.to_target_ids(ids))
            topk_lp.append(mx.take_along_axis(log_softmax(logits), ids, axis=-1))
        cache.truncate(stable)
        node_tokens = [topk_ids[d].reshape(-1)[self.token_index[d]] for d in range(self.max_depth)]
        tokens = mx.concatenate([root.reshape(1).astype(node_tokens[0].dtype)] + node_tokens)
        # a node's score: its own log-probability plus its parent's (parents precede children)
        own = mx.concatenate([mx.zeros((1,))] + [topk_lp[d].reshape(-1)[self.token_index[d]]
                                                  for d in range(self.max_depth)])
        scores = (self.anc.astype(own.dtype) * own[None, :]).sum(axis=1)
        return Tree(tokens, self.parents, self.anc, self.depth, scores)


def retrieve_indices(parents: List[int], leaf_order: str = "index") -> List[List[int]]:
    """Root-to-leaf node paths padded with -1 (the official `retrieve_indices`).

    leaf_order "index": leaves by node index (EAGLE-2 greedy); "sorted": paths sorted
    with -1 counted as largest (EAGLE-1, and EAGLE-2 when sampling)."""
    n = len(parents)
    has_child = set(parents[1:])
    paths = []
    for i in range(n):
        if i in has_child:
            continue
        path, j = [i], i
        while j != 0:
            j = parents[j]
            path.append(j)
        paths.append(path[::-1])
    width = max(len(p) for p in paths)
    paths = [p + [-1] * (width - len(p)) for p in paths]
    if leaf_order == "sorted":
        paths.sort(key=lambda p: [x if x >= 0 else n + 5 for x in p])
    return paths
