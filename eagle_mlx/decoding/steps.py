"""Driving the engine: prompt caches, plain decoding, and speculative decoding with any
drafter (`speculative_steps`) or an EAGLE head (`eagle_steps`), one Step per target forward.

The engine (`engine.py`) runs prefill and cycles over an explicit state; what lies around
them (reusing and leaving behind a prompt cache, tracing the verified trees, profiling the
phases) is layered here, outside the cycle.
"""

from typing import Iterator, List, Optional, Sequence

import mlx.core as mx

from .accept import KeyChain
from .registry import head_drafter
from .engine import PREFILL_STEP_SIZE, Engine, SamplingParams, State, Step
from .logprobs import score
from ..mlxlm import generate_step
from .profiling import PhaseTimer, profiled_cycle
from .settings import KVQuantization


class PromptCache:
    """The target's and the drafter's caches after a generation, kept for the next call.

    Pass the same PromptCache to successive `stream_generate` calls (a chat, a server's
    conversation): a prompt that starts with the tokens the caches hold is prefilled
    only from where it differs. `tokens` are the ids fed so far, in order (the target cache
    holds the first `offset` of them: a generation records its list, not a copy, after each
    step); the drafter's state holds fewer positions, and `features` are the target features
    of the positions between the two (the drafter's pending input).
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.owner = None      # (target, drafter's owner or None): what the caches belong to
        self.tokens: List[int] = []
        self.target = None     # the target's per-layer caches
        self.drafter = None    # the drafter that made `draft` (speculative decoding only)
        self.draft = None      # the drafter's state
        self.features = None   # [target offset - drafter offset, F]
        self.length = 0        # positions the target caches hold
        self.valid = False     # False while a cycle is under way (or was interrupted)
        self.reused = 0        # prompt tokens the last call found in the caches
        # read from a file (`cache_file.load`): the target's features of every position and
        # the taps they were read with (the first drafter reading those takes them), and how
        # many leading positions hold tokens it does not know (a file mlx-lm wrote)
        self.saved = None
        self.opaque = 0
        self.max_kv_size = None  # the bound its full-attention caches were made with

    def shared_prefix(self, prompt: Sequence[int]) -> int:
        """Tokens at the start of `prompt` this cache holds (at most all but its last)."""
        n, limit = 0, min(self.length, len(prompt) - 1)
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        return n

    def reuse(self, target, drafter, prompt: Sequence[int],
              max_kv_size: Optional[int] = None) -> int:
        """Make the caches hold a prefix of `prompt` (at most all but its last token) and
        return its length; 0 when nothing can be reused (then the caches are fresh, bounded
        to `max_kv_size` positions where given)."""
        owner = (target, None if drafter is None else drafter.owner)
        if self.valid and self.max_kv_size != max_kv_size:
            self.valid = False  # (caches of another bound: start over)
        if self.valid and self.owner is not None and self.owner[0] is target and \
                self.owner[1] is None and drafter is not None and self.draft is None and \
                self._adopts(drafter):
            self.owner, self.drafter, self.draft = owner, drafter, drafter.new_state()
            self.features = None if drafter.features is None else self.saved[0]
        if not self.valid or self.owner is None or not _same(self.owner, owner):
            self.reset()
            self.owner, self.drafter, self.max_kv_size = owner, drafter, max_kv_size
            self.target = target.make_cache(max_kv_size)
            self.draft = None if drafter is None else drafter.new_state()
            return 0
        agree, most = 0, min(len(self.tokens), len(prompt))
        while agree < most and self.tokens[agree] == prompt[agree]:
            agree += 1
        common = min(agree, self.length, len(prompt) - 1)
        if self.draft is not None:
            # the drafter's entry p pairs position p's features with token p + 1, so it may
            # keep only the entries whose next token agrees too; where it holds more, it
            # forgets back to those and the target to the same point (the features of the
            # positions in between are no longer held)
            seen = self.drafter.offset(self.draft)
            if seen > max(agree - 1, 0) or common < seen:
                common = max(min(common, agree - 1), 0)
                self.drafter.truncate(self.draft, common)
                self.features = None
            elif self.features is not None:
                keep = common - seen
                self.features = self.features[:keep] if keep > 0 else None
        if not target.reusable(self.target, common):
            # a sliding window has dropped positions the new tokens would see, or a
            # recurrent state cannot go back: start over
            self.target = target.make_cache(max_kv_size)
            self.draft = None if drafter is None else drafter.new_state()
            self.features, common = None, 0
        target.truncate(self.target, common)
        self.tokens, self.length = self.tokens[:common], common
        self.valid, self.reused = False, common
        return common

    def _adopts(self, drafter) -> bool:
        """Whether a drafter can start on caches read from a file: one that reads nothing, or
        the features the file holds (of every position, from the first)."""
        if self.opaque:
            return False
        if drafter.features is None:
            return True
        return self.saved is not None and self.length == self.saved[0].shape[0] and \
            tuple(drafter.features) == (self.saved[1] or ())

    def state(self) -> State:
        """The engine state over these caches (after `reuse`)."""
        return State(self.target, self.draft, self.length, self.features)

    def record(self, state: State) -> None:
        """The caches are consistent again after a step: remember them for the next call."""
        self.tokens, self.features, self.length = state.history, state.feats, state.n
        self.valid = True


def _same(a, b) -> bool:
    """Whether two owners are the same objects (owners are objects, or tuples of them: a
    merged drafter's is its parts')."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b


def plain_steps(target, prompt: Sequence[int], sampling: SamplingParams,
                max_context: int, prompt_cache: Optional[PromptCache] = None,
                keys: Optional[KeyChain] = None,
                logprobs: Optional[int] = None,
                kv: Optional[KVQuantization] = None,
                max_kv_size: Optional[int] = None) -> Iterator[Step]:
    """Autoregressive decoding of the target alone through mlx-lm's `generate_step`
    (keys: the random keys of its draws; None: MLX's global random state; logprobs: report
    each token's log-probability with that many alternatives; kv: quantized KV caches, as
    generate_step's kv_bits, kv_group_size and quantized_kv_start)."""
    pc = prompt_cache if prompt_cache is not None else PromptCache()

    def sampler(logprobs):  # [1, V]: drawn as a row of a batch draws it, over [V]
        key = None if keys is None else keys.next()
        return sampling.pick(logprobs[0], key).reshape(logprobs.shape[:-1])

    start = pc.reuse(target, None, prompt, max_kv_size)
    cached = list(prompt)
    n = len(prompt)  # tokens in the cache once the last yielded token is fed
    for token, lp in generate_step(mx.array(list(prompt[start:])), target.plain_model,
                                   max_tokens=-1, sampler=sampler, prompt_cache=pc.target,
                                   prefill_step_size=PREFILL_STEP_SIZE,
                                   **({} if kv is None else dict(
                                       kv_bits=kv.bits, kv_group_size=kv.group_size,
                                       quantized_kv_start=kv.start))):
        token = int(token)
        cached.append(token)
        # generate_step has fed the token it yields (it computes one step ahead)
        pc.tokens, pc.length, pc.valid = cached, len(cached), True
        scores = None if logprobs is None else score(sampling, lp[None], [token], logprobs)
        yield Step([token], None, logprobs=scores)  # nothing drafted
        pc.valid = False
        n += 1
        if n > max_context:  # the next token would need a position past the context
            return


def speculative_steps(target, drafter, prompt: Sequence[int], sampling: SamplingParams,
                      max_context: Optional[int] = None, trace: bool = False,
                      timer: Optional[PhaseTimer] = None,
                      prompt_cache: Optional[PromptCache] = None,
                      keys: Optional[KeyChain] = None,
                      logprobs: Optional[int] = None,
                      pipeline: Optional[bool] = None,
                      kv: Optional[KVQuantization] = None,
                      max_kv_size: Optional[int] = None) -> Iterator[Step]:
    """Speculative decoding with any drafter (`drafters.Drafter`); yields one Step per
    target forward (keys: the random keys of its draws; None: MLX's global state;
    logprobs: as `plain_steps`).

    trace: attach the verified tree to every Step. timer: profile the phases of each cycle
    (`profiling.profiled_cycle`: a sync after every phase). prompt_cache: reuse (and leave
    behind) the caches of an earlier call. pipeline: let a drafter that `drafts_ahead` draft
    and verify the next cycle before the caller has this one's tokens (`Engine`); default:
    where nothing is profiled, and with a prompt cache only where every layer's cache can be
    cut back (the caches then hold the pass drafted ahead too, which the next call's `reuse`
    cuts off; a recurrent state cannot be), and not under mx.distributed (a pass running
    ahead would meet, with its collectives, what rank 0 sends the others between
    responses)."""
    if pipeline is None:
        pipeline = timer is None and (prompt_cache is None or not target.node_state_bytes) \
            and getattr(drafter, "group", None) is None
    engine = Engine(target, drafter, sampling, max_context or target.max_context, logprobs,
                    pipeline=pipeline, kv=kv, split_prompt=max_kv_size is not None)
    pc = prompt_cache if prompt_cache is not None else PromptCache()
    start = pc.reuse(target, drafter, prompt, max_kv_size)
    state = pc.state()
    state.keys = keys
    root = engine.prefill(state, prompt, start)
    pc.record(state)
    yield Step([root], None, logprobs=engine.root_logprobs)
    pc.valid = False
    while engine.fits(state):
        step = engine.cycle(state) if timer is None else profiled_cycle(engine, state, timer)
        if trace:
            step.tree = {"tokens": step.tree_tokens, "parents": step.drafted.parents.tolist(),
                         "depth": step.drafted.depth.tolist()}
        pc.record(state)
        yield step
        pc.valid = False
    # near the context limit no tree fits: finish with plain steps (the caches are not kept)
    while state.n < engine.max_context:
        yield engine.plain_step(state)


def eagle_steps(target, head, prompt: Sequence[int], sampling: SamplingParams,
                total_tokens: int, depth: int, draft_top_k: int,
                tree_choices=None, max_context: Optional[int] = None,
                trace: bool = False, timer: Optional[PhaseTimer] = None,
                prompt_cache: Optional[PromptCache] = None,
                keys: Optional[KeyChain] = None,
                kv: Optional[KVQuantization] = None) -> Iterator[Step]:
    """Speculative decoding with a head (dynamic tree, or static `tree_choices`; a block
    drafter's DDTree); kv: quantized KV caches."""
    drafter = head_drafter(head, target, total_tokens, depth, draft_top_k, tree_choices)
    return speculative_steps(target, drafter, prompt, sampling, max_context, trace, timer,
                             prompt_cache, keys, kv=kv)
