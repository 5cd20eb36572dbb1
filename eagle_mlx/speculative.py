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


class GraphCounter(PhaseTimer):
    """Counts the MLX operations (graph nodes) each phase of the cycle evaluates, by kind:
    what a device's per-kernel launch cost multiplies. On the CPU, MLX's fast kernels
    (RoPE, attention, RMSNorm) run as their composite graphs and count as many nodes; on
    a GPU each is one. It times the phases as PhaseTimer does; the counting itself is kept
    out of them (and added up in `counting_seconds`)."""

    def __init__(self):
        super().__init__()
        self.nodes = {phase: 0 for phase in self.seconds}
        self.kinds = {}
        self.counting_seconds = 0.0

    def lap(self, phase: str, *arrays) -> None:
        if self._last is not None and arrays:
            import io
            import re

            start = time.perf_counter()
            dot = io.StringIO()
            mx.export_to_dot(dot, *arrays)
            labels = re.findall(r'label ="([^"]+)"', dot.getvalue())
            self.nodes[phase] += len(labels)
            for label in labels:
                self.kinds[label] = self.kinds.get(label, 0) + 1
            spent = time.perf_counter() - start
            self._last += spent
            self.counting_seconds += spent
        super().lap(phase, *arrays)

    def per_cycle(self) -> dict:
        cycles = max(self.cycles, 1)
        return {"nodes": {k: v / cycles for k, v in self.nodes.items()},
                "total": sum(self.nodes.values()) / cycles,
                "by_kind": {k: v / cycles for k, v in
                            sorted(self.kinds.items(), key=lambda kv: -kv[1])}}


class _NoTimer(PhaseTimer):
    def lap(self, phase, *arrays):
        pass


_NO_TIMER = _NoTimer()


@dataclass
class SamplingParams:
    """mlx-lm's sampling settings, meant as `mlx_lm.sample_utils.make_sampler` means them:
    top-p, min-p and top-k filter the untempered distribution, then the temperature."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def logprobs(self, logits: mx.array) -> mx.array:
        """The distribution tokens are drawn from, as normalised log-probabilities."""
        return process_logits(logits, self.temp, self.top_p, self.top_k, self.min_p)

    def pick(self, logits: mx.array) -> mx.array:
        """The next token from target logits (or log-probabilities) [V]."""
        if self.temp == 0:
            return logits.argmax(axis=-1)
        return mx.random.categorical(self.logprobs(logits))


# a stream for generation work, as mlx-lm's (a thread-local one: every thread that
# generates, such as the server's worker, gets its own)
generation_stream = getattr(mx, "new_thread_local_stream", mx.new_stream)(mx.default_device())
PREFILL_STEP_SIZE = 2048  # prompt tokens per prefill chunk, as mlx-lm's generate_step


class PromptCache:
    """The target's and the head's caches after a generation, kept for the next call.

    Pass the same PromptCache to successive `stream_generate` calls (a chat, a server's
    conversation): a prompt that starts with the tokens the caches hold is prefilled
    only from where it differs. `tokens` are the ids fed so far, in order (the target cache
    holds the first `offset` of them: a generation records its list, not a copy, after each
    step); the head cache holds fewer positions, and `features` are the target features of
    the positions between the two (the head's pending input).
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.owner = None      # (target, head or None): what the caches belong to
        self.tokens: List[int] = []
        self.target = None     # the target's per-layer caches
        self.head = None       # the head's cache (EAGLE only)
        self.features = None   # [target offset - head offset, F]
        self.valid = False     # False while a cycle is under way (or was interrupted)
        self.reused = 0        # prompt tokens the last call found in the caches

    def reuse(self, owner, prompt: Sequence[int]) -> int:
        """Make the caches hold a prefix of `prompt` (at most all but its last token) and
        return its length; 0 when nothing can be reused (then the caches are fresh)."""
        if not self.valid or self.owner is None or self.owner[0] is not owner[0] \
                or self.owner[1] is not owner[1]:
            self.reset()
            self.owner = owner
            return 0
        common = 0
        limit = min(self.target[0].offset, len(self.tokens), len(prompt) - 1)
        while common < limit and self.tokens[common] == prompt[common]:
            common += 1
        if self.head is not None and common < self.head.offset:
            self.head.truncate(common)  # the pending features are too late to use
            self.features = None
        if self.head is not None:
            keep = common - self.head.offset
            self.features = self.features[:keep] if keep > 0 else None
        for c in self.target:
            c.truncate(common)
        self.tokens = self.tokens[:common]
        self.valid, self.reused = False, common
        return common


def plain_steps(target, prompt: Sequence[int], sampling: SamplingParams,
                max_context: int, prompt_cache: Optional[PromptCache] = None) -> Iterator[Step]:
    """Autoregressive decoding of the target alone through mlx-lm's `generate_step`."""
    from mlx_lm.generate import generate_step

    pc = prompt_cache if prompt_cache is not None else PromptCache()
    start = pc.reuse((target, None), prompt)
    if start == 0:
        pc.target = target.make_cache()
    cached = list(prompt)
    n = len(prompt)  # tokens in the cache once the last yielded token is fed
    for token, _ in generate_step(mx.array(list(prompt[start:])), target.model, max_tokens=-1,
                                  sampler=sampling.pick, prompt_cache=pc.target,
                                  prefill_step_size=PREFILL_STEP_SIZE):
        token = int(token)
        cached.append(token)
        # generate_step has fed the token it yields (it computes one step ahead)
        pc.tokens, pc.valid = cached, True
        yield Step([token], None)  # nothing drafted
        pc.valid = False
        n += 1
        if n > max_context:  # the next token would need a position past the context
            return


def eagle_steps(target, head, prompt: Sequence[int], sampling: SamplingParams,
                total_tokens: int, depth: int, draft_top_k: int,
                tree_choices=None, max_context: Optional[int] = None,
                trace: bool = False, timer: Optional["PhaseTimer"] = None,
                prompt_cache: Optional[PromptCache] = None) -> Iterator[Step]:
    """Speculative decoding with an EAGLE head; yields one Step per target forward.

    trace: attach the verified tree to every Step. timer: time the phases of each cycle
    (this adds a sync after each phase, so use it to profile, not to measure speed).
    prompt_cache: reuse (and leave behind) the caches of an earlier call."""
    timer = timer or _NO_TIMER
    max_context = max_context or target.max_context
    taps = target.eagle3_taps if head.kind == "eagle3" else ()
    static = StaticTree(tree_choices, draft_top_k) if tree_choices else None
    tree_depth = static.max_depth if static else depth + 1  # deepest node below the root

    def features(hidden, tapped):
        # EAGLE-1/2: post-norm last hidden state; EAGLE-3: low, mid, high layer inputs
        return (mx.concatenate(tapped, axis=-1) if taps else hidden)[0]

    # 1. prefill what the caches lack, in chunks; sample the root token
    pc = prompt_cache if prompt_cache is not None else PromptCache()
    start = pc.reuse((target, head), prompt)
    if start == 0:
        pc.target, pc.head, pc.features = target.make_cache(), head.make_cache(), None
    cache, head_cache = pc.target, pc.head
    prompt_ids = mx.array(list(prompt))
    chunks = [] if pc.features is None else [pc.features]  # features the head has not seen
    with mx.stream(generation_stream):
        for a in range(start, len(prompt), PREFILL_STEP_SIZE):
            hidden, tapped = target(prompt_ids[None, a : a + PREFILL_STEP_SIZE], cache, taps=taps)
            chunks.append(features(hidden, tapped))
            if a + PREFILL_STEP_SIZE < len(prompt):
                mx.eval(chunks[-1], [c.keys for c in cache])
                mx.clear_cache()
        root = sampling.pick(target.lm_head(hidden[0, -1]))
        feats = mx.concatenate(chunks) if len(chunks) > 1 else chunks[0]   # [n - head offset, F]
        head_tokens = mx.concatenate([prompt_ids[head_cache.offset + 1:],
                                      root.reshape(1).astype(prompt_ids.dtype)])
    n = len(prompt)
    root_token = root.item()  # SYNC: the first token is output now
    cached = list(prompt) + [root_token]  # the root is fed (as tree node 0) next cycle

    def settle():  # the caches are consistent again: record them for the next call
        pc.tokens, pc.features, pc.valid = cached, feats, True

    settle()
    yield Step([root_token], None)
    pc.valid = False
    timer.start()

    while n + tree_depth < max_context:
        with mx.stream(generation_stream):
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
            logits = target.lm_head(hidden[0])                         # [size, V]
            timer.lap("verify", logits)
            # 4. accept the deepest node whose whole path the target agrees with
            if sampling.temp == 0:
                best, bonus = accept_greedy(tree, logits)
            else:
                best, bonus = accept_sampling(tree, sampling.logprobs(logits))
            path_mask = tree.anc[best]
            timer.lap("accept", path_mask, tree.tokens, bonus)
            # SYNC (once per cycle): which nodes were accepted, and the next root token
            mx.eval(path_mask, tree.tokens, bonus)
            path = np.flatnonzero(np.array(path_mask)).tolist()  # root first: parents precede
            tokens = tree.tokens.tolist()
            root_token = bonus.item()
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
            # the device keeps the accepted rows while the caller handles the tokens
            # (mlx-lm's async_eval pattern): the next cycle starts from evaluated caches
            mx.async_eval(feats, *[a for c in cache for a in (c.keys, c.values)])
        cached += out
        traced = None
        if trace:
            traced = {"tokens": tokens, "parents": tree.parents.tolist(),
                      "depth": tree.depth.tolist()}
        settle()
        yield Step(out, len(path) - 1, traced)
        pc.valid = False
        timer.start()

    # near the context limit no tree fits: finish with plain steps (the caches are not kept)
    while n < max_context:
        with mx.stream(generation_stream):
            hidden, _ = target(root.reshape(1, 1), cache)
            n += 1
            root = sampling.pick(target.lm_head(hidden[0, -1]))
        yield Step([root.item()], 0)  # SYNC: one token per step here
