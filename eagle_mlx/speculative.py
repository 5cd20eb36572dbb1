"""The EAGLE decoding loop (docs/eagle.md §1), one target forward pass per step.

    prefill -> [draft -> verify -> accept -> update]*

Each cycle is built as one lazy MLX graph (head catch-up, `depth` draft levels, the
verify pass, acceptance) and synchronised with the host once, to learn which nodes
were accepted. The syncs are marked `SYNC`.
"""

import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .accept import accept_greedy, accept_sampling, process_logits
from .tree import StaticTree, draft_dynamic


@dataclass
class Step:
    tokens: List[int]             # tokens this target forward produced
    accept_length: Optional[int]  # drafted tokens accepted (None for the prefill)
    tree: Optional[dict] = None   # with trace=True: the verified tree (tokens, parents, depth)


class PhaseTimer:
    """Seconds spent in each phase of the cycle: draft / verify / accept / update."""

    def __init__(self):
        self.seconds = {"draft": 0.0, "verify": 0.0, "accept": 0.0, "update": 0.0}
        self.cycles = 0
        self._last = None

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, phase: str, *arrays) -> None:
        if self._last is None:
            return
        mx.eval(*arrays)  # SYNC (profiling only)
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now
        self.cycles += phase == "update"


class _NoTimer(PhaseTimer):
    def lap(self, phase, *arrays):
        pass


_NO_TIMER = _NoTimer()


@dataclass
class SamplingParams:
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def pick(self, logits: mx.array) -> mx.array:
        """The next token from target logits [V]."""
        if self.temp == 0:
            return logits.argmax(axis=-1)
        return mx.random.categorical(process_logits(logits, self.temp, self.top_p, self.top_k))


def plain_steps(target, prompt: Sequence[int], sampling: SamplingParams,
                max_context: int) -> Iterator[Step]:
    """Autoregressive decoding of the target alone through mlx-lm's `generate_step`."""
    from mlx_lm.generate import generate_step

    n = len(prompt)  # tokens in the cache once the last yielded token is fed
    for token, _ in generate_step(mx.array(list(prompt)), target.model, max_tokens=-1,
                                  sampler=sampling.pick):
        yield Step([int(token)], None)  # nothing drafted
        n += 1
        if n > max_context:  # the next token would need a position past the context
            return


def eagle_steps(target, head, prompt: Sequence[int], sampling: SamplingParams,
                total_tokens: int, depth: int, draft_top_k: int,
                tree_choices=None, max_context: Optional[int] = None,
                trace: bool = False, timer: Optional["PhaseTimer"] = None) -> Iterator[Step]:
    """Speculative decoding with an EAGLE head; yields one Step per target forward.

    trace: attach the verified tree to every Step. timer: time the phases of each cycle
    (this adds a sync after each phase, so use it to profile, not to measure speed)."""
    timer = timer or _NO_TIMER
    max_context = max_context or target.max_context
    taps = target.eagle3_taps if head.kind == "eagle3" else ()
    static = StaticTree(tree_choices, draft_top_k) if tree_choices else None
    tree_depth = static.max_depth if static else depth + 1  # deepest node below the root

    def features(hidden, tapped):
        # EAGLE-1/2: post-norm last hidden state; EAGLE-3: low, mid, high layer inputs
        return (mx.concatenate(tapped, axis=-1) if taps else hidden)[0]

    # 1. prefill: fill the target cache, sample the root token, hand over features
    cache, head_cache = target.make_cache(), head.make_cache()
    prompt_ids = mx.array(list(prompt))
    hidden, tapped = target(prompt_ids[None], cache, taps=taps)
    root = sampling.pick(target.lm_head(hidden[0, -1]))
    feats = features(hidden, tapped)                                   # [n, F]
    head_tokens = mx.concatenate([prompt_ids[1:], root.reshape(1).astype(prompt_ids.dtype)])
    n = len(prompt)
    root_token = root.item()  # SYNC: the first token is output now
    yield Step([root_token], None)
    timer.start()

    while n + tree_depth < max_context:
        # 2. draft a tree with the head (catch-up on the new positions first)
        if static is not None:
            tree = static.draft(head, target, head_cache, feats, head_tokens, root)
        else:
            tree = draft_dynamic(head, target, head_cache, feats, head_tokens, root,
                                 total_tokens, depth, draft_top_k)
        timer.lap("draft", tree.tokens, tree.anc)
        # 3. verify: one target forward over the whole tree, after the n cached tokens
        size = tree.tokens.shape[0]
        mask = mx.concatenate([mx.ones((size, n), dtype=mx.bool_), tree.anc], axis=1)
        hidden, tapped = target(tree.tokens[None], cache, positions=n + tree.depth,
                                mask=mask, taps=taps)
        logits = target.lm_head(hidden[0])                             # [size, V]
        timer.lap("verify", logits)
        # 4. accept the deepest node whose whole path the target agrees with
        if sampling.temp == 0:
            best, bonus = accept_greedy(tree, logits)
        else:
            logprobs = process_logits(logits, sampling.temp, sampling.top_p, sampling.top_k)
            best, bonus = accept_sampling(tree, logprobs)
        path_mask = tree.anc[best]
        # SYNC (once per cycle): which nodes were accepted, and the next root token
        mx.eval(path_mask, tree.tokens, bonus)
        path = np.flatnonzero(np.array(path_mask)).tolist()  # root first: parents precede
        tokens = tree.tokens.tolist()
        root_token = bonus.item()
        timer.lap("accept")
        # 5. update: keep the accepted rows of the target cache, hand their features on
        path_idx = mx.array(path)
        for c in cache:
            c.keep(n, n + path_idx)
        n += len(path)
        feats = features(hidden, tapped)[path_idx]
        out = [tokens[i] for i in path[1:]] + [root_token]
        head_tokens = mx.array(out, dtype=prompt_ids.dtype)
        root = mx.array(root_token)
        timer.lap("update", feats, *[c.keys for c in cache])
        traced = None
        if trace:
            traced = {"tokens": tokens, "parents": tree.parents.tolist(),
                      "depth": tree.depth.tolist()}
        yield Step(out, len(path) - 1, traced)
        timer.start()

    # near the context limit no tree fits: finish with plain steps
    while n < max_context:
        hidden, _ = target(root.reshape(1, 1), cache)
        n += 1
        root = sampling.pick(target.lm_head(hidden[0, -1]))
        yield Step([root.item()], 0)  # SYNC: one token per step here
