"""Prompt lookup: drafts copied from the context itself, alone or as branches of an EAGLE
tree.

A suffix automaton of the context (prompt and output so far, from its second token on:
the drafter interface hands a drafter the tokens that follow positions) is extended by
each new token in amortised constant time. Its state for the longest suffix of the context
that occurred before gives, through its transitions, every token that followed an earlier
occurrence; each is a branch, continued by the text that followed that occurrence (its
first one). Shorter matches (the suffix links) add branches with other first tokens, down
to `min_match` tokens. The branches form a small tree under the root.

Merged with a head (`MergedDrafter`), the lookup branches and the head's tree share one
node budget: nodes are ranked by the probability that the target accepts them — the
head's path probability, and for a lookup node p(m)^d at depth d after a match of m tokens,
p(m) being the per-token acceptance the benchmark measured for lookup drafts of that match
length (`LookupSettings.accept`) — a node both propose counts as either accepting, 1 - (1 -
p_head)(1 - p_lookup). Drafts are deterministic, so acceptance stays lossless.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import EagleError, is_int
from .drafters import Drafter, DraftRow
from .tree import Tree, tree_from_parents

# per-token acceptance of a lookup draft by match length (the largest key at most the match;
# capped at MAX_MATCH_KEY): what `python -m eagle_mlx.benchmark --lookup` measured on the
# demo pair, greedy, over edit-style, HumanEval and MT-bench prompts (docs/performance.md, "Prompt
# lookup"): 0.852 after matches of 2-7 tokens, 0.983 after 8 or more; a 1-token match
# (min_match 1), not measured there, is ranked below them
DEFAULT_ACCEPT = {1: 0.5, 2: 0.85, 8: 0.98}
MAX_MATCH_KEY = 8


@dataclass
class LookupSettings:
    """min_match: the shortest earlier occurrence of the context's end that drafts;
    max_draft: the most tokens a branch copies; branches: the most distinct continuations;
    accept: per-token acceptance by match length (the benchmark's calibration)."""

    min_match: int = 2   # measured best of 1, 2, 3 (python -m eagle_mlx.benchmark lookup-sweep; docs/performance.md)
    max_draft: int = 16  # measured best of 4, 8, 16
    branches: int = 3
    accept: Dict[int, float] = field(default_factory=lambda: dict(DEFAULT_ACCEPT))
    # where given, drafters count per match length [tokens accepted, tokens tried] of
    # their branches (a branch's tokens are tried until the first one rejected)
    stats: Optional[Dict[int, List[int]]] = None

    def p(self, match: int) -> float:
        keys = sorted(k for k in self.accept if k <= min(match, MAX_MATCH_KEY))
        return self.accept[keys[-1]] if keys else min(self.accept.values())

    def check(self, name=lambda field: f"lookup {field}") -> "LookupSettings":
        """Every setting in range, one sentence otherwise (`name`: how a setting is called,
        e.g. its command-line flag)."""
        for field_, value in (("min_match", self.min_match), ("max_draft", self.max_draft),
                              ("branches", self.branches)):
            if not (is_int(value) and 1 <= value <= 256):
                raise EagleError(f"{name(field_)} must be a whole number from 1 to 256 "
                                 f"(got {value!r}).")
        return self


class SuffixAutomaton:
    """The suffix automaton of a token sequence, built online (Blumer et al.): state 0 is
    the empty string; every state keeps its transitions, suffix link, longest length and
    the end of its strings' first occurrence."""

    def __init__(self, tokens=()):
        self.next: List[Dict[int, int]] = [{}]
        self.link, self.length, self.first = [-1], [0], [-1]
        self.last = 0
        self.tokens: List[int] = []
        for t in tokens:
            self.append(t)

    def append(self, c: int) -> None:
        i = len(self.tokens)
        self.tokens.append(c)
        nxt, link, length, first = self.next, self.link, self.length, self.first
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        first.append(i)
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                first.append(first[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def continuations(self, min_match: int, max_draft: int,
                      branches: int) -> List[Tuple[int, List[int]]]:
        """Up to `branches` (match length, copied tokens) with distinct first tokens: the
        longest suffix of the sequence that occurred earlier first, then shorter ones; each
        copies what followed that suffix's first occurrence with that token."""
        out, seen = [], set()
        u = self.link[self.last] if self.last else -1
        while u > 0 and self.length[u] >= min_match and len(out) < branches:
            for c, w in self.next[u].items():
                if c in seen:
                    continue
                start = self.first[w]  # where (suffix + c) first ended: c's position
                seen.add(c)
                out.append((self.length[u], self.tokens[start: start + max_draft]))
                if len(out) == branches:
                    break
            u = self.link[u]
        return out


def build_tree(root: int, nodes: List[Tuple[int, int, float]], max_depth: int) -> Tree:
    """A Tree from (token, parent index, score) triples, parents first (root = index 0),
    at most `max_depth` below the root."""
    return tree_from_parents(mx.array([root] + [t for t, _, _ in nodes], dtype=mx.int32),
                             mx.array([0] + [p for _, p, _ in nodes], dtype=mx.int32),
                             mx.array([0.0] + [s for _, _, s in nodes], dtype=mx.float32),
                             max_depth)


class _Trie:
    """Tree nodes keyed by their token path, each with the best acceptance probability
    proposed for it by each source."""

    def __init__(self):
        self.index: Dict[Tuple[int, ...], int] = {(): 0}
        self.paths: List[Tuple[int, ...]] = [()]
        self.head: List[float] = [1.0]
        self.lookup: List[float] = [1.0]

    def add(self, path: Tuple[int, ...], p: float, source: str) -> None:
        i = self.index.get(path)
        if i is None:
            i = self.index[path] = len(self.paths)
            self.paths.append(path)
            self.head.append(0.0)
            self.lookup.append(0.0)
        probs = self.head if source == "head" else self.lookup
        probs[i] = max(probs[i], p)

    def tree(self, root: int, budget: int) -> Tree:
        """The `budget - 1` most probable nodes (ancestors before descendants: a node is
        never more probable than its parent) under the root."""
        score = [1 - (1 - h) * (1 - lk) for h, lk in zip(self.head, self.lookup)]
        order = sorted(range(1, len(self.paths)), key=lambda i: (-score[i], len(self.paths[i])))
        keep = sorted(order[: budget - 1], key=lambda i: (len(self.paths[i]), i))
        place = {(): 0}
        nodes = []
        for i in keep:
            path = self.paths[i]
            if path[:-1] not in place:  # (ties can rank a child with its parent)
                continue
            place[path] = len(nodes) + 1
            nodes.append((path[-1], place[path[:-1]], math.log(max(score[i], 1e-30))))
        return build_tree(root, nodes, max((len(self.paths[i]) for i in keep), default=0))


class LookupState:
    def __init__(self):
        self.automaton = SuffixAutomaton()
        self.proposed = None  # the branches of the last proposal (for `stats`)


def calibration(stats: Dict[int, List[int]], min_tried: int = 20) -> Dict[int, float]:
    """Per-token acceptance by match length from counted [accepted, tried] (lengths with
    fewer than `min_tried` tries pooled into the next shorter one)."""
    buckets: Dict[int, List[int]] = {}
    for m, (a, t) in stats.items():
        b = buckets.setdefault(min(int(m), MAX_MATCH_KEY), [0, 0])
        b[0], b[1] = b[0] + a, b[1] + t
    out, pooled = {}, [0, 0]
    for m in sorted(buckets):
        pooled = [pooled[0] + buckets[m][0], pooled[1] + buckets[m][1]]
        if pooled[1] >= min_tried:
            out[m] = round(pooled[0] / pooled[1], 3)
            pooled = [0, 0]
    return out


class LookupDrafter(Drafter):
    """Drafts copied from the context (see the module docstring); reads nothing from the
    target."""

    features = None

    def __init__(self, settings: Optional[LookupSettings] = None, budget: Optional[int] = None):
        self.settings = settings or LookupSettings()
        self.max_depth = self.settings.max_draft
        # nodes a tree may have: the branches', within the target's bound (a hybrid's
        # recurrent states per node, `Target.tree_node_limit`)
        self.budget = 1 + self.settings.branches * self.settings.max_draft
        if budget is not None:
            self.budget = max(2, min(self.budget, budget))

    @property
    def owner(self):
        return LookupDrafter  # any lookup drafter's state is the same automaton

    def new_state(self):
        return LookupState()

    def offset(self, state) -> int:
        return len(state.automaton.tokens)

    def truncate(self, state, length: int) -> None:
        if length < len(state.automaton.tokens):  # (a prompt cache cut back: rebuilt once)
            state.automaton = SuffixAutomaton(state.automaton.tokens[:length])
        state.proposed = None

    def catch_up(self, state, tokens: mx.array) -> None:
        new = [int(t) for t in tokens.tolist()]
        stats = self.settings.stats
        if stats is not None and state.proposed:  # new[:-1]: the drafted tokens accepted
            for match, copied in state.proposed:
                a = 0
                while a < min(len(copied), len(new) - 1) and copied[a] == new[a]:
                    a += 1
                counts = stats.setdefault(match, [0, 0])
                counts[0] += a
                counts[1] += a + (a < len(copied))
        for t in new:
            state.automaton.append(t)

    def branches(self, state):
        s = self.settings
        state.proposed = state.automaton.continuations(s.min_match, s.max_draft, s.branches)
        return state.proposed

    def add_to(self, trie: _Trie, state) -> None:
        for match, copied in self.branches(state):
            p = self.settings.p(match)
            for d in range(1, len(copied) + 1):
                trie.add(tuple(copied[:d]), p ** d, "lookup")

    def propose(self, state, features, tokens, root) -> Tree:
        self.catch_up(state, tokens)
        trie = _Trie()
        self.add_to(trie, state)
        return trie.tree(int(root.item()), self.budget)


class MergedDrafter(Drafter):
    """A head's drafter and prompt lookup in one tree of at most `total_tokens` nodes."""

    def __init__(self, head_drafter, lookup: LookupDrafter, total_tokens: int):
        self.head, self.lookup, self.total_tokens = head_drafter, lookup, total_tokens
        self.features = head_drafter.features
        self.max_depth = max(head_drafter.max_depth, lookup.max_depth)

    @property
    def owner(self):
        return (self.head.owner, LookupDrafter)

    def new_state(self):
        return (self.head.new_state(), self.lookup.new_state())

    def offset(self, state) -> int:
        return self.head.offset(state[0])

    def truncate(self, state, length: int) -> None:
        self.head.truncate(state[0], length)
        self.lookup.truncate(state[1], length)

    reads_kv = property(lambda self: self.head.reads_kv)

    def take_kv(self, state, caches, n: int, row=None) -> None:
        self.head.take_kv(state[0], caches, n, row)

    def propose(self, state, features, tokens, root) -> Tree:
        return self.merge(state, self.head.propose(state[0], features, tokens, root), tokens)

    def head_caches(self, state) -> Optional[list]:
        return self.head.head_caches(state[0])

    def batch_key(self):
        key = self.head.batch_key()
        return None if key is None else ("merged", key)

    def propose_batch(self, rows, cache=None) -> List[Tree]:
        """The heads' trees together, then each merged with its lookup branches."""
        if self.batch_key() is None or cache is None:
            return super().propose_batch(rows, cache)
        heads = [DraftRow(r.index, r.drafter.head, _HeadView(r.state)) for r in rows]
        drafted = self.head.propose_batch(heads, cache)
        # SYNC: the heads' trees come to the host to be merged with lookup's
        mx.eval([[t.tokens, t.parents, t.scores] for t in drafted])
        return [r.drafter.merge(r.state.drafter, t, r.state.tokens)
                for r, t in zip(rows, drafted)]

    def merge(self, state, drafted: Tree, tokens) -> Tree:
        """The head's tree `drafted` and the lookup branches as one tree (the lookup drafter
        catches up on `tokens` first)."""
        self.lookup.catch_up(state[1], tokens)
        trie, root = head_trie(drafted)
        self.lookup.add_to(trie, state[1])
        return trie.tree(root, self.total_tokens)


def head_trie(drafted: Tree):
    """A head's tree as a trie of its paths with their probabilities (to merge lookup
    branches into), and its root token."""
    # SYNC: the head's tree comes to the host to be merged (a few hundred bytes)
    mx.eval(drafted.tokens, drafted.parents, drafted.scores)
    toks, parents = drafted.tokens.tolist(), drafted.parents.tolist()
    scores = np.array(drafted.scores.astype(mx.float32)).tolist()
    trie = _Trie()
    paths = [()]
    for i in range(1, len(toks)):  # parents precede children
        paths.append(paths[parents[i]] + (toks[i],))
        trie.add(paths[i], math.exp(min(scores[i], 0.0)), "head")
    return trie, toks[0]


class _HeadView:
    """A sequence's engine state as its head's drafter sees it inside a MergedDrafter."""

    def __init__(self, state):
        self.drafter = state.drafter[0]
        self.feats, self.tokens, self.root = state.feats, state.tokens, state.root
