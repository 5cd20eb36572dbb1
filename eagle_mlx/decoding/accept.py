"""Accepting drafted tokens after the verify pass (docs/eagle.md §1 step 4).

Both rules work on whole trees at once (no walk over nodes in Python) and return, as
device scalars, the deepest accepted node and the token that follows it (the bonus
token). The accepted nodes are that node's ancestors.

Greedy: a node is accepted when every node on its path equals the target's argmax at
its parent. Output is exactly the target's greedy decoding.

Sampling: recursive rejection sampling with deterministic (top-k) drafts, q(x) = 1.
At node u with target distribution p and children c1, c2, ... tried in order, c_j is
accepted with probability p(c_j) / (1 - p(c_1) - ... - p(c_{j-1})) — the official
"accept with p(x), else zero p(x) and renormalise" — and if none is accepted the next
token comes from p with all children zeroed. The output distribution is the target's.
"""

import mlx.core as mx

from .. import mlxlm
from ..targets.layers import log_softmax
from .compiled import compiled
from .tree import Tree


def _process_logits(temp: float, top_p: float, top_k: int, min_p: float, logits: mx.array):
    logprobs = logits.astype(mx.float32)
    logprobs = log_softmax(logprobs)
    if 0 < top_p < 1.0:
        logprobs = mlxlm.apply_top_p(logprobs, top_p)
    if min_p > 0:
        logprobs = mlxlm.apply_min_p(logprobs, min_p)
    if 0 < top_k < logits.shape[-1]:
        logprobs = mlxlm.apply_top_k(logprobs, top_k)
    logprobs = logprobs * (1 / temp)
    return log_softmax(logprobs)


def process_logits(logits: mx.array, temp: float, top_p: float = 1.0, top_k: int = 0,
                   min_p: float = 0.0) -> mx.array:
    """Target logits [..., V] -> the normalised log-probabilities that mlx-lm's
    `make_sampler(temp, top_p, min_p, top_k)` samples from: top-p, min-p and top-k filter
    the untempered distribution (in that order), then the temperature scales what is left."""
    return compiled(_process_logits, temp, top_p, top_k, min_p)(logits)


def _deepest(anc: mx.array, depth: mx.array, node_ok: mx.array) -> mx.array:
    """Deepest node whose whole root path is ok (the root always is)."""
    accepted = ~(anc & ~node_ok[None, :]).any(axis=1)
    return mx.argmax(mx.where(accepted, depth, -1))


def accept_greedy(tree: Tree, logits: mx.array):
    """logits [N, V] of the tree nodes -> (deepest accepted node, bonus token)."""
    return compiled(_accept_greedy)(tree.tokens, tree.parents, tree.anc, tree.depth, logits)


def _accept_greedy(tokens, parents, anc, depth, logits):
    best_next = logits.argmax(axis=-1)
    is_root = mx.arange(tokens.shape[0]) == 0
    node_ok = is_root | (tokens == best_next[parents])
    best = _deepest(anc, depth, node_ok)
    return best, best_next[best]


def accept_sampling(tree: Tree, logprobs: mx.array, key=None):
    """logprobs [N, V] (processed target distributions) -> (deepest accepted node, next token).
    key: the random key of this draw (None: MLX's global random state)."""
    if key is not None:
        return compiled(_accept_sampling_keyed)(tree.tokens, tree.parents, tree.anc, tree.depth,
                                                logprobs, key)
    return compiled(_accept_sampling, random=True)(tree.tokens, tree.parents, tree.anc,
                                                   tree.depth, logprobs)


def _accept_sampling_keyed(tokens, parents, anc, depth, logprobs, key):
    keys = mx.random.split(key)
    return _accept_sampling(tokens, parents, anc, depth, logprobs, keys[0], keys[1])


def _accept_sampling(tokens, parents, anc, depth, logprobs, key_u=None, key_c=None):
    n = tokens.shape[0]
    probs = mx.exp(logprobs)
    idx = mx.arange(n)
    p_draft = probs[parents, tokens]                              # p_parent(x) of each node
    earlier_sibling = ((parents[None, :] == parents[:, None])
                       & (idx[None, :] < idx[:, None]) & (idx[None, :] > 0))
    mass_before = (earlier_sibling * p_draft[None, :]).sum(axis=1)
    left = 1.0 - mass_before
    ratio = mx.where(left > 0, p_draft / mx.maximum(left, 1e-30), 0.0)
    passed = mx.random.uniform(shape=(n,), key=key_u) < ratio
    # tried in order: a node is taken only when no earlier sibling was
    taken = passed & ~(earlier_sibling & passed[None, :]).any(axis=1)
    best = _deepest(anc, depth, taken | (idx == 0))
    children = (parents == best) & (idx > 0)
    zeroed = mx.zeros((probs.shape[-1],)).at[tokens].add(children.astype(mx.float32)) > 0
    residual = mx.where(zeroed, 0.0, probs[best])
    residual = mx.where(residual.sum() > 0, residual, probs[best])
    return best, mx.random.categorical(mx.log(residual), key=key_c)


def accept_drawn(tree: Tree, logprobs: mx.array, key=None):
    """A chain whose tokens were drawn from the drafter's distributions `tree.q` (rows [N, V],
    row i the distribution of node i) -> (deepest accepted node, next token): node i is kept
    with probability min(1, p(x) / q(x)) while every earlier one is, and after the first
    rejection the next token comes from norm(max(0, p - q)) (Leviathan et al.), so the output
    is the target's distribution."""
    args = (tree.tokens, tree.parents, tree.anc, tree.depth, logprobs, tree.q)
    if key is None:
        return compiled(_accept_drawn, random=True)(*args)
    return compiled(_accept_drawn)(*args, *mx.random.split(key))


def _accept_drawn(tokens, parents, anc, depth, logprobs, q, key_u=None, key_c=None):
    n = tokens.shape[0]
    idx = mx.arange(n)
    probs = mx.exp(logprobs)
    qp = mx.exp(q)
    p_x = probs[parents, tokens]
    q_x = qp[idx, tokens]
    kept = mx.random.uniform(shape=(n,), key=key_u) * q_x < p_x
    best = _deepest(anc, depth, kept | (idx == 0))
    child = ((parents == best) & (idx > 0)).astype(qp.dtype)       # the rejected one, if any
    residual = mx.maximum(probs[best] - (child[:, None] * qp).sum(axis=0), 0.0)
    residual = mx.where(residual.sum() > 0, residual, probs[best])
    return best, mx.random.categorical(mx.log(residual), key=key_c)


class KeyChain:
    """The random keys of one sequence's draws, one after another from a start key: a
    sequence draws the same numbers whether it runs alone or in a batch (MLX's global
    state would interleave the rows' draws). `start(seed)`: from a seed, or (None) from
    MLX's global random state (which `mx.random.seed` makes reproducible)."""

    def __init__(self, key: mx.array):
        self.key = key

    @classmethod
    def start(cls, seed=None) -> "KeyChain":
        if seed is None:  # (a key is any pair of 32-bit words)
            return cls(mx.random.randint(0, 2**31 - 1, (2,)).astype(mx.uint32))
        return cls(mx.random.key(int(seed)))

    def next(self) -> mx.array:
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return keys[1]
