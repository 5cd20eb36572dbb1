"""Drafting with a Gemma 4 assistant (`heads.gemma4_assistant`): its steps read the target's
committed keys and values (a drafter with `reads_kv`: the engine hands them over before each
proposal, views of the target's caches) and never attend to each other, so a tree costs one
batched single-query forward per depth. The tree is EAGLE-2's dynamic tree (`draft_top_k`
children per frontier node, the `draft_top_k` best of them the next frontier, the
`total_tokens - 1` best of all kept), each node carrying its own fed-back hidden state; the
chain is the `draft_top_k = 1` case."""

from typing import Optional

import mlx.core as mx

from .compiled import compiled
from .drafters import Drafter
from .tree import Tree, _first_level, _next_level, _parent_offset, _rerank


class AssistantState:
    """What the drafter keeps of a sequence: the positions it has seen, the target's post-norm
    hidden state of the last of them, and the keys and values the engine handed over."""

    def __init__(self):
        self.offset = 0
        self.hidden: Optional[mx.array] = None   # [1, H]
        self.kv = None                          # {layer type: (keys, values)}
        self.position = 0                       # the root's position

    def truncate(self, length: int) -> None:
        if length < self.offset:
            self.offset, self.hidden = length, None


class AssistantDrafter(Drafter):
    features = ()  # the target's post-norm hidden states
    reads_kv = True

    def __init__(self, head, target, total_tokens: int, depth: int, top_k: int):
        self.head, self.target = head, target
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, top_k
        self.max_depth = depth + 1
        self.kv_layers = head.kv_layers(target)
        self.scale = head.embed_scale(target)

    @property
    def owner(self):
        return self.head

    def new_state(self):
        return AssistantState()

    def offset(self, state) -> int:
        return state.offset

    def truncate(self, state, length: int) -> None:
        state.truncate(length)

    def take_kv(self, state, caches, n: int) -> None:
        """The target's committed keys and values (positions before n), as the steps read
        them, from its caches (the engine calls this before each proposal)."""
        state.kv = {}
        for kind, layer in self.kv_layers.items():
            k, v, _ = self.target.committed_kv(caches, layer, n)
            state.kv[kind] = (k, v)
        state.position = n

    def _inputs(self, tokens: mx.array, hidden: mx.array) -> mx.array:
        """[k] tokens and their [k, 1, H] fed-back states -> the steps' inputs [k, 1, 2H]."""
        e = self.target.embed_tokens(tokens.reshape(-1, 1))
        e = e * mx.array(self.scale, e.dtype)
        return mx.concatenate([e, hidden.astype(e.dtype)], axis=-1)

    def propose(self, state, features, tokens, root) -> Tree:
        if features is not None and features.shape[0]:
            state.hidden = features[-1:]
            state.offset += features.shape[0]
        if state.hidden is None:
            raise RuntimeError("the assistant drafts after a position it has seen")
        head, k = self.head, self.top_k
        step = lambda toks, h: head.step(self._inputs(toks, h), state.kv, state.position)  # noqa: E731
        logits, out = step(root.reshape(1), state.hidden[None])          # [1, V], [1, 1, H]
        ids, scores = compiled(_first_level, k)(logits[0])
        scores_list, tokens_list = [scores], [ids]
        parents_list = [mx.zeros((1,), dtype=mx.int32)]
        hidden = mx.repeat(out, k, axis=0)                                 # [k, 1, H]
        frontier, chosen = ids, mx.arange(k)
        tree_mask = mx.eye(k, dtype=mx.bool_)
        for level in range(self.depth):
            logits, out = step(frontier, hidden)                         # [k, V], [k, 1, H]
            parents_list.append(chosen + _parent_offset(level, k))
            child_ids, cum, chosen, scores, from_node, tree_mask = compiled(_next_level)(
                logits, scores, tree_mask)
            hidden = out[from_node]
            frontier = child_ids[chosen]
            tokens_list.append(child_ids)
            scores_list.append(cum)
        return Tree(*compiled(_rerank, self.total_tokens - 1, k, self.depth)(
            mx.concatenate(scores_list), mx.concatenate(tokens_list),
            mx.concatenate(parents_list), root))
