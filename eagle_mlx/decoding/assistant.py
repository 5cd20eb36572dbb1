"""Drafting with a Gemma 4 assistant (`heads.gemma4_assistant`): its steps read the target's
committed keys and values (a drafter with `reads_kv`: the engine, or a batch, hands over
where they are before each proposal; the steps read views of the target's caches) and never
attend to each other, so a tree costs one single-query forward per depth, a level's nodes
side by side as one sequence's queries. The tree is EAGLE-2's dynamic tree (`draft_top_k`
children per frontier node, the `draft_top_k` best of them the next frontier, the
`total_tokens - 1` best of all kept), each node carrying its own fed-back hidden state; the
chain is the `draft_top_k = 1` case.

A batch's rows draft together (`propose_batch`): one forward per depth for all of them,
each row's queries masked to its own committed positions of the batch's ragged caches (and
within the window for sliding layers), at its own position."""

from typing import List, Sequence

import mlx.core as mx

from .compiled import compiled
from .drafters import DraftRow, HeadDrafter
from .tree import Tree, first_level, next_level_batch, parent_offset, reranked_rows


class AssistantDrafter(HeadDrafter):
    features = ()  # the target's post-norm hidden states
    reads_kv = True

    def __init__(self, head, target, total_tokens: int, depth: int, top_k: int):
        self.head, self.target = head, target
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, top_k
        self.max_depth = depth + 1
        self.kv_layers = head.kv_layers(target)
        self.scale = head.embed_scale(target)

    def take_kv(self, state, caches, n: int, row=None) -> None:
        """Where the target's committed keys and values are (positions before n): its
        caches, and the sequence's row where they are a batch's."""
        state.caches, state.n, state.row = caches, n, row

    @staticmethod
    def _see(state, features) -> None:
        """The target's post-norm hidden states of the positions new since the last proposal:
        the last of them is the first step's h_prev."""
        if features is not None and features.shape[0]:
            state.hidden = features[-1:]
            state.offset += features.shape[0]
        if state.hidden is None:
            raise RuntimeError("the assistant drafts after a position it has seen")

    def propose(self, state, features, tokens, root) -> Tree:
        self._see(state, features)
        shared = {}
        for kind, layer in self.kv_layers.items():
            k, v, _ = self.target.committed_kv(state.caches, layer, state.n, state.row)
            shared[kind] = (k, v)
        return self._trees(shared, state.hidden[None], [root], state.n, [self.total_tokens])[0]

    def batch_key(self):
        return ("assistant", id(self.head), self.depth, self.top_k)

    def propose_batch(self, rows: Sequence[DraftRow], cache=None) -> List[Tree]:
        """Every row's tree in one forward per depth, over the batch's caches as they are
        (the rows' states were handed them with their rows)."""
        states = [r.state.drafter for r in rows]
        caches = states[0].caches
        if len(rows) == 1 or any(s.row is None or s.caches is not caches for s in states):
            return super().propose_batch(rows, cache)
        for r, s in zip(rows, states):
            self._see(s, r.state.feats)
        shared = {}
        for kind, layer in self.kv_layers.items():
            shared[kind] = self.target.batch_committed_kv(caches, layer, [s.row for s in states])
        hidden = mx.stack([s.hidden for s in states])                         # [N, 1, H]
        return self._trees(shared, hidden, [r.state.root for r in rows], [s.n for s in states],
                           [r.drafter.total_tokens for r in rows])

    def _inputs(self, tokens: mx.array, hidden: mx.array) -> mx.array:
        """tokens [N, L] and their fed-back states [N, L, H] -> the steps' inputs."""
        e = self.target.embed_tokens(tokens)
        e = e * mx.array(self.scale, e.dtype)
        return mx.concatenate([e, hidden.astype(e.dtype)], axis=-1)

    def _trees(self, shared, hidden, roots, positions, totals) -> List[Tree]:
        """The dynamic trees of N sequences: hidden [N, 1, H] their first h_prev, roots their
        roots, positions the roots' positions (an int for one sequence)."""
        head, k = self.head, self.top_k
        N = hidden.shape[0]

        def step(tokens, h):
            return head.step(self._inputs(tokens, h), shared, positions)

        root = mx.stack([r.reshape(()) for r in roots]).astype(mx.int32)[:, None]
        logits, out = step(root, hidden)                                   # [N, 1, V], [N, 1, H]
        ids, scores = compiled(first_level, k)(logits[:, 0])              # [N, k]
        scores_list, tokens_list = [scores], [ids]
        parents_list = [mx.zeros((N, 1), dtype=mx.int32)]
        hidden = mx.repeat(out, k, axis=1)                                 # [N, k, H]
        frontier = ids
        tree_mask = mx.broadcast_to(mx.eye(k, dtype=mx.bool_), (N, k, k))
        chosen = mx.broadcast_to(mx.arange(k), (N, k))
        for level in range(self.depth):
            logits, out = step(frontier, hidden)                         # [N, k, V], [N, k, H]
            parents_list.append(chosen + parent_offset(level, k))
            child_ids, cum, chosen, scores, from_node, tree_mask = compiled(next_level_batch)(
                logits, scores, tree_mask)
            hidden = mx.take_along_axis(out, from_node[..., None], axis=1)
            frontier = mx.take_along_axis(child_ids, chosen, axis=1)
            tokens_list.append(child_ids)
            scores_list.append(cum)
        return reranked_rows(scores_list, tokens_list, parents_list, roots, totals, k,
                             self.depth)
