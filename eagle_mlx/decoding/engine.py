"""The speculative decoding engine (docs/eagle.md §1): explicit state, one target forward
pass per cycle.

    state = engine.new_state(); engine.prefill(state, prompt)
    while engine.fits(state): step = engine.cycle(state)   # draft -> verify -> accept -> update

A cycle is one lazy MLX graph (the drafter's catch-up and proposal, the verify pass,
acceptance) synchronised with the host once, to learn which nodes were accepted (marked
`SYNC`). The drafter is anything that implements `drafters.Drafter`; the target's layers
each bring their own mechanism (`targets.target.Target.mechanisms`): how they run in a tree
verify and what their caches keep after acceptance. Prompt caching, profiling and tracing
are layered around the cycle by the callers (`steps.py`, `profiling.py`). A batch's cycle
(`batch.py`) accepts and advances each row with this engine's `accept` and `advance`; this
single-sequence cycle stays apart from it for speed (a batch of one, with ragged caches and
masks, decodes slower: docs/performance.md, continuous batching).
"""

import time
from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .accept import KeyChain, accept_drawn, accept_greedy, accept_sampling, process_logits
from .logprobs import TokenLogprob, score
from .settings import KVQuantization
from .tree import Tree, pruned


@dataclass
class Step:
    tokens: List[int]             # tokens this target forward produced
    accept_length: Optional[int]  # drafted tokens accepted (None for the prefill)
    tree: Optional[dict] = None   # when traced: the verified tree (tokens, parents, depth)
    drafted: Optional[Tree] = field(default=None, repr=False)  # the verified tree itself
    tree_tokens: Optional[List[int]] = field(default=None, repr=False)  # its tokens, synced
    choice: Optional[str] = None  # what a choosing drafter drafted (`Drafter.chosen`)
    # when asked for: each token's log-probability and top alternatives (`logprobs.py`)
    logprobs: Optional[List[TokenLogprob]] = field(default=None, repr=False)


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

    def pick(self, logits: mx.array, key=None) -> mx.array:
        """The next token from target logits (or log-probabilities) [V]; key: the draw's
        random key (None: MLX's global random state)."""
        if self.temp == 0:
            return logits.argmax(axis=-1)
        return mx.random.categorical(self.logprobs(logits), key=key)


# a stream for generation work, as mlx-lm's (a thread-local one: every thread that
# generates gets its own)
generation_stream = getattr(mx, "new_thread_local_stream", mx.new_stream)(mx.default_device())
PREFILL_STEP_SIZE = 2048  # prompt tokens per prefill chunk, as mlx-lm's generate_step


@dataclass
class State:
    """One sequence being decoded."""

    caches: list                        # the target's per-layer caches
    drafter: object                     # the drafter's own state
    n: int = 0                          # positions the target caches hold
    feats: Optional[mx.array] = None    # [m, F] target features the drafter has not seen
    tokens: Optional[mx.array] = None   # [m] the tokens that follow them, the root last
    root: Optional[mx.array] = None     # the last sampled token: node 0 of the next tree
    history: List[int] = field(default_factory=list)  # every token fed or to feed, root last
    keys: Optional[KeyChain] = None     # the sequence's random keys (None: MLX's global state)
    ahead: Optional[tuple] = None       # the next cycle's (tree, verified or None, when it
    #                                     began), drafted ahead

    def key(self):
        return None if self.keys is None else self.keys.next()


@dataclass
class Verified:
    hidden: mx.array
    tapped: list
    logits: mx.array


class DraftsAhead:
    """The engine's pipelining: where a cycle is a plain pass, the next cycle's plain pass is
    built on the token not yet known, and (`pipeline`) the next cycle is drafted and
    verified while the caller handles this one's tokens. Mixed into `Engine`, whose
    `target`, `drafter`, `max_context`, `draft`, `verify` and `plain_pass` it uses."""

    def decides_plain(self, state: State, tree: Tree) -> bool:
        """Whether the drafter decides now, before this cycle's token is known, that the next
        pass is plain (`Drafter.plain_ahead`). Asked wherever this cycle is a plain pass that
        a plain pass could follow without a tree's recurrent states, whether or not the engine
        pipelines (a batch's rows ask too), so a sequence's choices are the same everywhere."""
        return self.drafter.drafts_ahead and self._plain_follows(state, tree) and \
            self.drafter.plain_ahead(state.drafter)

    def _plain_follows(self, state: State, tree: Tree) -> bool:
        """Whether this cycle is a plain pass whose row stays in place and another plain
        pass, without recurrent states, fits after it (one more position and a tree)."""
        return tree.tokens.shape[0] == 1 and not self.target.node_state_bytes and \
            state.n + 1 + self.drafter.max_depth < self.max_context

    def prebuild(self, state: State, tree: Tree, accepted, keep: bool = True
                 ) -> Optional[tuple]:
        """Where this cycle is a plain pass (the root alone, its row kept in place), the
        next plain pass's graph, built on the token not yet computed while the device
        computes it, as mlx-lm's plain decoding builds each step: (verified, the caches'
        snapshot to forget it by, should the drafter choose otherwise; None where `keep` is
        False: the drafter has decided on it already, and a snapshot copies every layer's
        buffers). None elsewhere."""
        if not self._plain_follows(state, tree) or not self.target.snapshots(state.caches):
            return None
        self.target.accept(state.caches, state.n, [state.n])  # (in place: nothing moves)
        saved = self.target.snapshot(state.caches) if keep else None
        return self.plain_pass(state, accepted[1].reshape(1)), saved

    def ahead(self, state: State, prebuilt: Optional[tuple] = None,
              started: Optional[float] = None) -> None:
        """The next cycle's draft and verify now, evaluated while the caller handles this
        cycle's tokens (a plain pass's verify is `prebuilt`, from `prebuild`, where there is
        one; `started`: it is running already, since then — the drafter decided it ahead).
        The drafter has consumed the pending features and tokens."""
        start = time.perf_counter() if started is None else started
        tree = self.draft(state)
        state.feats = state.tokens = None
        if prebuilt is not None:
            if tree.tokens.shape[0] == 1:
                verified = prebuilt[0]
            else:
                assert started is None, "a plain pass decided ahead was drafted otherwise"
                self.target.restore(state.caches, prebuilt[1])
                prebuilt = None
        if prebuilt is None:
            verified = self.verify(state, tree)
        if started is None:
            mx.async_eval(verified.logits, verified.hidden, *verified.tapped)
        state.ahead = (tree, verified, start)


class Engine(DraftsAhead):
    def __init__(self, target, drafter, sampling: SamplingParams, max_context: int,
                 logprobs: Optional[int] = None, pipeline: bool = False,
                 kv: Optional[KVQuantization] = None, split_prompt: bool = False):
        """logprobs: report every token's log-probability with that many top alternatives
        (None: not). pipeline: a drafter that `drafts_ahead` drafts the next cycle (and
        verifies it, where it is a plain pass) before the caller gets this one's tokens —
        the caches then hold one position more than `State.n` between cycles, so only where
        no prompt cache keeps them."""
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.max_context, self.logprobs, self.pipeline = max_context, logprobs, pipeline
        # quantized KV caches (None: float), switched to as mlx-lm's generate_step does: the
        # prompt but its last token first, and every step after, once a cache holds
        # `kv.start` positions; a position from `kv.start` on is computed only after the
        # switch (a tree that would reach past it before is cut back: `_before_switch`)
        self.kv = kv
        # the prompt but its last token, then that token alone (mlx-lm's generate_step's
        # order, which quantized and bounded caches make visible)
        self.split_prompt = split_prompt or kv is not None
        self.root_logprobs = None  # the prefill's token's, where asked for
        self.taps = tuple(drafter.features or ())
        # recorder(position, hidden [n, H], tapped [n, H] per tap): the target's features of
        # every position it keeps, as fed (training data written while generating)
        self.recorder = None

    def new_state(self) -> State:
        return State(self.target.make_cache(), self.drafter.new_state())

    def fits(self, state: State) -> bool:
        """Whether a whole tree still fits in the context after what the caches hold."""
        return state.n + self.drafter.max_depth < self.max_context

    def _features(self, hidden, tapped) -> Optional[mx.array]:
        # EAGLE-1/2: post-norm last hidden state; EAGLE-3: the tap layers' inputs
        if self.drafter.features is None:
            return None
        return (mx.concatenate(tapped, axis=-1) if self.drafter.features else hidden)[0]

    # ---------------------------------------------------------------- prefill
    def prefill(self, state: State, prompt: Sequence[int], start: int = 0) -> int:
        """Feed prompt[start:] (the caches hold prompt[:start], and `state.feats` the
        features the drafter has not seen of those) in chunks; sample the root token."""
        for _ in self.prefill_chunks(state, prompt, start):
            pass
        return state.history[-1]

    def prefill_chunks(self, state: State, prompt: Sequence[int], start: int = 0,
                       chunk: int = PREFILL_STEP_SIZE):
        """`prefill` one chunk of `chunk` tokens at a time: yields after each chunk but the
        last (the caller may run other work between them)."""
        target = self.target
        self.drafter.begin(state.drafter)
        prompt_ids = mx.array(list(prompt))
        chunks = [] if state.feats is None else [state.feats]
        L = len(prompt)
        if not self.split_prompt:
            pieces = [(a, min(a + chunk, L)) for a in range(start, L, chunk)]
        else:  # (mlx-lm's order: the prompt but its last token, then that token alone)
            pieces = [(a, min(a + chunk, L - 1)) for a in range(start, L - 1, chunk)]
            pieces.append((L - 1, L))
        with mx.stream(generation_stream):
            for a, b in pieces:
                hidden, tapped = target(prompt_ids[None, a: b], state.caches, taps=self.taps)
                self._quantize(state)
                f = self._features(hidden, tapped)
                if f is not None:
                    chunks.append(f)
                if self.recorder is not None:
                    self.recorder(a, hidden[0], [t[0] for t in tapped])
                if b < L:
                    mx.eval(hidden, chunks, target.cache_arrays(state.caches))
                    mx.clear_cache()
                    yield
            logits = target.lm_head(hidden[0, -1])
            root = self.sampling.pick(logits, state.key())
            state.feats = (mx.concatenate(chunks) if len(chunks) > 1 else chunks[0]) \
                if chunks else None   # [n - drafter offset, F]
            seen = self.drafter.offset(state.drafter)
            state.tokens = mx.concatenate([prompt_ids[seen + 1:],
                                           root.reshape(1).astype(prompt_ids.dtype)])
        state.n, state.root = len(prompt), root
        root_token = root.item()  # SYNC: the first token is output now
        state.history = list(prompt) + [root_token]
        self.root_logprobs = self.scores(logits[None], [root_token])

    def scores(self, logits: mx.array, tokens: List[int]) -> Optional[List[TokenLogprob]]:
        """Each token's log-probability and alternatives, where asked for (logits [n, V]:
        row j is the target's logits before tokens[j])."""
        if self.logprobs is None:
            return None
        return score(self.sampling, logits, tokens, self.logprobs)

    # ---------------------------------------------------------------- the cycle
    def cycle(self, state: State) -> Step:
        start = time.perf_counter()
        with mx.stream(generation_stream):
            if state.ahead is not None:  # drafted and verified ahead (timed from then)
                tree, verified, start = state.ahead
                state.ahead = None
            else:
                tree = self.draft(state)
                verified = self.verify(state, tree)
            accepted = self.accept(tree, verified, state.key())
            ahead = self.pipeline and self.drafter.drafts_ahead and \
                not self._before_switch(state)
            decided = self.decides_plain(state, tree)  # (pipelined or not: the same choices)
            nxt = self.prebuild(state, tree, accepted, keep=not decided) if ahead else None
            started = nxt is not None and decided
            if started:  # the next plain pass runs on the token before the host knows it
                nxt = (nxt[0], None)  # (the snapshot would keep the old buffers from reuse)
                mx.async_eval(accepted[0], accepted[1], tree.tokens)
                mx.async_eval(nxt[0].logits, nxt[0].hidden, *nxt[0].tapped)
            step = self.update(state, tree, verified, accepted, kept=nxt is not None)
            synced = time.perf_counter()
            # (timed at the cycle's one sync: what the drafter's choice cost; not when
            # sampling, where choices follow only what is reproducible, so a seed repeats)
            seconds = time.perf_counter() - start if self.sampling.temp == 0 else None
            self.drafter.observe(state.drafter, step.tokens[:-1], seconds)
            step.choice = self.drafter.chosen(state.drafter)
            if ahead and self.fits(state):
                self.ahead(state, nxt, synced if started else None)
            elif nxt is not None:  # (a started pass is never past the context: `prebuild`)
                self.target.restore(state.caches, nxt[1])
            # the device keeps the accepted rows while the caller handles the tokens
            # (mlx-lm's async_eval pattern): the next cycle starts from evaluated caches
            mx.async_eval(*self.updated_arrays(state))
        return step

    def updated_arrays(self, state: State) -> list:
        """What the update leaves to evaluate: the kept features and every layer's cache."""
        return ([] if state.feats is None else [state.feats]) + \
            self.target.cache_arrays(state.caches)

    def draft(self, state: State) -> Tree:
        """1. the drafter catches up on the new positions and proposes a tree (a drafter that
        `reads_kv` is handed the target's committed keys and values first)."""
        if self.drafter.reads_kv:
            self.drafter.take_kv(state.drafter, state.caches, state.n)
        tree = self.sampled(state, self.drafter.propose(state.drafter, state.feats,
                                                        state.tokens, state.root))
        if self._before_switch(state) and state.n + self.drafter.max_depth >= self.kv.start:
            tree = pruned(tree, self.kv.start - 1 - state.n)
        return tree

    def sampled(self, state: State, tree: Tree) -> Tree:
        """A chain the drafter leaves to be drawn (`Tree.draw`): when sampling, its tokens
        drawn by the drafter under this generation's settings with the sequence's key;
        greedy, as proposed."""
        if tree.draw is None or self.sampling.temp == 0:
            return tree
        drawn, q = tree.draw(self.sampling, state.key())
        tokens = mx.concatenate([tree.tokens[:1], drawn.astype(tree.tokens.dtype)])
        return replace(tree, tokens=tokens, q=mx.concatenate([mx.zeros_like(q[:1]), q]),
                       draw=None)

    def plain_pass(self, state: State, token: mx.array) -> Verified:
        """The target's forward over one token [1] after what the caches hold, as mlx-lm's
        plain step runs it (no tree mask or positions)."""
        hidden, tapped = self.target(token[None], state.caches, taps=self.taps)
        return Verified(hidden, tapped, self.target.lm_head(hidden[0]))

    def verify(self, state: State, tree: Tree) -> Verified:
        """2. one target forward over the whole tree, after the n cached positions."""
        size = tree.tokens.shape[0]
        if size == 1 and not self.target.node_state_bytes:  # a plain pass: as mlx-lm's step
            return self.plain_pass(state, tree.tokens)
        mask = mx.concatenate([mx.ones((size, state.n), dtype=mx.bool_), tree.anc], axis=1)
        hidden, tapped = self.target(tree.tokens[None], state.caches,
                                     positions=state.n + tree.depth, mask=mask, taps=self.taps,
                                     max_depth=self.drafter.max_depth if tree.levels is None
                                     else tree.levels)
        return Verified(hidden, tapped, self.target.lm_head(hidden[0]))   # logits [size, V]

    def accept(self, tree: Tree, verified: Verified, key=None):
        """3. the deepest node whose whole path the target agrees with, and the bonus token
        (key: the draw's random key when sampling)."""
        if self.sampling.temp == 0:
            best, bonus = accept_greedy(tree, verified.logits)
        elif tree.q is not None:  # drawn from the drafter: min(1, p/q)
            best, bonus = accept_drawn(tree, self.sampling.logprobs(verified.logits), key)
        else:
            best, bonus = accept_sampling(tree, self.sampling.logprobs(verified.logits), key)
        return tree.anc[best], bonus

    def update(self, state: State, tree: Tree, verified: Verified, accepted,
               kept: bool = False) -> Step:
        """4. keep the accepted rows of every layer's cache (kept: already kept, a plain
        pass's), hand their features on."""
        path_mask, bonus = accepted
        # SYNC (once per cycle): which nodes were accepted, and the next root token
        mx.eval(path_mask, tree.tokens, bonus)
        path = np.flatnonzero(np.array(path_mask)).tolist()  # root first: parents precede
        if not kept:
            self.target.accept(state.caches, state.n, [state.n + i for i in path])
        step = self.advance(state, tree, verified, path, bonus.item())
        self._quantize(state)
        return step

    def _before_switch(self, state: State) -> bool:
        """Whether the caches are to be quantized at a later position (`kv`)."""
        return self.kv is not None and state.n < self.kv.start

    def _quantize(self, state: State) -> None:
        """mlx-lm's switch to quantized caches, where due (`kv`)."""
        if self.kv is not None:
            self.target.quantize(state.caches, self.kv)

    def advance(self, state: State, tree: Tree, verified: Verified, path: List[int],
                root_token: int) -> Step:
        """The state after acceptance kept `path` (tree nodes, root first) of the target's
        caches and sampled `root_token`: the features, tokens and position the drafter and
        the next cycle read."""
        tokens = tree.tokens.tolist()
        path_idx = mx.array(path)
        if self.recorder is not None:
            self.recorder(state.n, verified.hidden[0][path_idx],
                          [t[0][path_idx] for t in verified.tapped])
        state.n += len(path)
        f = self._features(verified.hidden, verified.tapped)
        state.feats = None if f is None else f[path_idx]
        out = [tokens[i] for i in path[1:]] + [root_token]
        state.tokens = mx.array(out, dtype=mx.int32)
        state.root = mx.array(root_token)
        state.history += out
        # token j of `out` was drawn from the logits of node path[j] (its parent)
        return Step(out, len(path) - 1, drafted=tree, tree_tokens=tokens,
                    logprobs=self.scores(verified.logits[path_idx], out))

    def plain_step(self, state: State) -> Step:
        """One token without a tree (near the end of the context, where none fits)."""
        with mx.stream(generation_stream):
            hidden, _ = self.target(state.root.reshape(1, 1), state.caches)
            self._quantize(state)
            state.n += 1
            logits = self.target.lm_head(hidden[0, -1])
            state.root = self.sampling.pick(logits, state.key())
        token = state.root.item()  # SYNC: one token per step here
        state.history.append(token)
        return Step([token], 0, logprobs=self.scores(logits[None], [token]))
