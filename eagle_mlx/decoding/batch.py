"""Continuous batching with speculation: many sequences in one cycle, each exactly its own
output.

    batch = BatchGenerator(model, tokenizer, max_batch=8)
    uid = batch.add(prompt, settings)          # joins at the next cycle boundary
    while batch.busy:
        for uid, response in batch.step():     # one GenerationResponse per sequence a step
            ...

Every active sequence keeps its own drafter state, features and tree (the head's dynamic
or static tree, prompt lookup, both merged, or the root alone for plain decoding). A
cycle drafts each sequence's tree, pads them to the widest, verifies all of them in one
target forward over [B, T] (`Target.verify_batch`: every attention layer's ragged cache
gives each row its own prefix, within its window for a sliding layer; linear-attention
layers run every row's nodes in one recurrence), accepts per sequence with the rules and
random keys it would use alone (`accept.KeyChain`), and keeps each row's accepted nodes in
place (`Target.batch_accept`). A sequence joins at a cycle boundary: its prompt is
prefilled alone, one chunk per step while the others keep decoding, then its caches
become the batch's last row; it leaves when it finishes (or is cancelled).

So a sequence's tokens are those of `stream_generate` with the same settings: greedy,
the same tokens; sampling, the target's distribution, and with a seed the same draws.
"""

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence as Seq, Tuple, Union

import mlx.core as mx
import numpy as np

from ..errors import check, is_int
from ..targets.cache import BatchHeadCache
from ..targets.layers import log_softmax
from .drafters import Drafter, DraftRow
from .engine import Engine, State, Step, Verified, generation_stream
from .plan import prepare
from .responses import responses
from .settings import GenerationSettings
from .steps import PromptCache
from .tree import Tree

BATCH_PREFILL_CHUNK = 512  # prompt tokens a step prefills while a batch decodes
DEFAULT_MAX_BATCH = 8


class RootDrafter(Drafter):
    """Plain decoding inside a batch: the tree is the root alone (the verify pass is the
    next decoding step)."""

    features = None
    max_depth = 0
    owner = None

    def new_state(self):
        return None

    def offset(self, state) -> int:
        return 0


@dataclass
class _Sequence:
    uid: int
    ids: List[int]
    settings: GenerationSettings
    engine: Optional[Engine] = None   # (made when it joins: its tree is the batch size's)
    state: Optional[State] = None
    plain: bool = True
    prompt_cache: Optional[object] = None  # a PromptCache reused at the join, left at the end
    start: int = 0                          # prompt tokens the prompt cache held at the join
    record: Optional[object] = None         # the engine's recorder
    steps: deque = field(default_factory=deque)
    responses: Optional[Iterator] = None
    prefill: Optional[Iterator] = None
    done: bool = False
    costed: int = 1                         # the batch size its choices are priced for


def _root_tree(root: mx.array) -> Tree:
    z = mx.zeros((1,), dtype=mx.int32)
    return Tree(root.reshape(1).astype(mx.int32), z, mx.ones((1, 1), dtype=mx.bool_), z)


def _timing(rows, trees, speculative, seconds: Optional[float]):
    """A batch's cycle is timed whole, and each row that chose with costs learns its
    choice's share of it (`Drafter.observe_in_batch`): the cycle's `seconds` (None where
    some row's drafting has no costs to share it out by, or it was not timed), each row's
    tree size, the widest, and all rows' drafting as their costs say."""
    drafting = [s.engine.drafter.drafting(s.state.drafter) if sp else 0.0
                for s, sp in zip(rows, speculative)]
    if any(d is None for d in drafting):
        seconds = None
    sizes = [int(t.tokens.shape[0]) for t in trees]
    return seconds, sizes, max(sizes), sum(d or 0.0 for d in drafting)


def _padded(trees: List[Tree]):
    """Every row's tree padded to the widest: tokens, depths [B, T] and ancestor masks
    [B, T, T] (a padding node sees only itself); and each tree's own size."""
    sizes = [int(t.tokens.shape[0]) for t in trees]
    T = max(sizes)
    tokens, depth, anc = [], [], []
    for t, n in zip(trees, sizes):
        pad = T - n
        tokens.append(mx.pad(t.tokens.astype(mx.int32), (0, pad)))
        depth.append(mx.pad(t.depth.astype(mx.int32), (0, pad)))
        a = mx.pad(t.anc, [(0, pad), (0, pad)])
        if pad:
            a = a | mx.pad(mx.eye(pad, dtype=mx.bool_), [(n, 0), (n, 0)])
        anc.append(a)
    return mx.stack(tokens), mx.stack(depth), mx.stack(anc), sizes


class BatchRows:
    """The sequences decoding in a batch, in row order, and the caches they decode with:
    the target's (one ragged cache per layer) and the head's, where the head drafts the
    batch's rows in one pass (`drafts_batched`: then its caches live in the batch too). A
    sequence joins after its prefill; a leaving one takes its rows back into its prompt
    cache, for its next turn."""

    def __init__(self, target, head):
        self.target, self.head = target, head
        self.batched_head = head is not None and head.drafts_batched
        self.seqs: List[_Sequence] = []
        self.caches = None       # the target's batch caches
        self.head_caches = None  # a BatchHeadCache where the head drafts batched

    @staticmethod
    def _head_layers(seq: _Sequence) -> Optional[list]:
        """The sequence's own head caches, one per head layer (None: no head)."""
        return seq.engine.drafter.head_caches(seq.state.drafter)

    def join(self, seq: _Sequence) -> None:
        """The prefilled sequence's caches become the batch's last row."""
        if self.caches is None:
            self.caches = self.target.make_batch_cache()
        self.target.batch_join(self.caches, seq.state.caches)
        seq.state.caches = None  # the batch holds them now
        if self.batched_head:
            if self.head_caches is None:
                self.head_caches = BatchHeadCache(self.head.num_layers)
                for _ in self.seqs:
                    self.head_caches.join(None)
            self.head_caches.join(self._head_layers(seq))
        self.seqs.append(seq)

    def keep(self, keep: List[int]) -> None:
        """Only rows `keep` stay; the others leave (their caches to their prompt caches)."""
        for b, s in enumerate(self.seqs):
            if b not in keep and s.prompt_cache is not None:
                pc = s.prompt_cache
                pc.target = self.target.batch_extract(self.caches, b, s.state.n)
                own = self._head_layers(s)
                if own is not None and self.head_caches is not None:
                    self.head_caches.copy_out(b, own)
                pc.record(s.state)
        self.seqs = [self.seqs[i] for i in keep]
        mx.clear_cache()  # (the batch's buffers change size as rows leave: free MLX's cached ones)
        if not self.seqs:
            self.caches = self.head_caches = None
        else:
            self.target.batch_filter(self.caches, keep)
            if self.head_caches is not None:
                self.head_caches.filter(keep)

    def arrays(self) -> list:
        """What a cycle leaves to evaluate: every cache buffer and the rows' features."""
        return [a for c in self.caches for a in c.arrays()] + \
            ([] if self.head_caches is None else list(self.head_caches.arrays())) + \
            [s.state.feats for s in self.seqs if s.state.feats is not None]


class BatchGenerator:
    """Continuous batching of speculative (or plain) generations over one model: a queue
    of sequences, prefilled one chunk a step while the batch (`BatchRows`) decodes."""

    def __init__(self, model, tokenizer, max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_chunk: int = BATCH_PREFILL_CHUNK, taps: Optional[Seq[int]] = None):
        """taps: the target layers whose inputs every forward returns (default: the head's;
        what `add(record=...)` records besides the post-norm hidden state)."""
        check(hasattr(model, "target") and hasattr(model, "head"),
              "model must be the EagleModel that eagle_mlx.load returns.")
        check(is_int(max_batch) and max_batch >= 1,
              f"max_batch must be a whole number of at least 1 (got {max_batch!r}).")
        check(getattr(model, "group", None) is None,
              "batched generation runs on one machine; it does not shard over mx.distributed.")
        self.model, self.tokenizer, self.target = model, tokenizer, model.target
        self.max_batch, self.prefill_chunk = int(max_batch), int(prefill_chunk)
        self.waiting: deque = deque()     # added, not yet prefilled
        self.joining: Optional[_Sequence] = None  # being prefilled, chunk by chunk
        self.rows = BatchRows(self.target, model.head)
        self._uid = 0
        head = model.head
        self.taps = tuple(head.feature_taps(self.target) or ()) if head is not None else ()
        if taps is not None:
            check(head is None or not self.taps or tuple(taps) == self.taps,
                  "taps must be the head's own taps where the head reads taps.")
            self.taps = tuple(taps)

    # the batch's rows and caches, as the tests and tools read them
    active = property(lambda self: self.rows.seqs)
    caches = property(lambda self: self.rows.caches)
    head_caches = property(lambda self: self.rows.head_caches)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.joining or self.active)

    def __len__(self) -> int:
        return len(self.active)

    # ---------------------------------------------------------------- the queue
    def add(self, prompt: Union[str, Seq[int]], settings: Optional[GenerationSettings] = None,
            prompt_cache=None, record=None, **kwargs) -> int:
        """Queue a generation (checked now: a bad request raises EagleError and nothing is
        queued); returns its id. settings (or stream_generate's keyword arguments).
        prompt_cache: a `PromptCache` (as stream_generate's) — the prompt is prefilled only
        from where it differs from what the cache holds, and the cache holds this sequence
        when it leaves the batch (the next turn of a conversation reuses it).
        record: `Engine.recorder` for this sequence — called with the target's features of
        every position it feeds (prefill chunks, then each cycle's kept nodes)."""
        check(prompt_cache is None or isinstance(prompt_cache, PromptCache),
              "prompt_cache must be an eagle_mlx.PromptCache.")
        check(record is None or callable(record),
              "record must be a function of (position, hidden, tapped), or None.")
        if settings is None:
            settings = GenerationSettings(**kwargs)
        else:
            check(not kwargs, "give the settings either as a GenerationSettings or as keyword "
                              "arguments, not both.")
        run = prepare(self.model, self.tokenizer, prompt, settings)
        check(run.kv is None, "kv_bits quantizes one sequence's caches; a batch keeps float "
                              "caches (generate with stream_generate for kv_bits).", "kv_bits")
        check(run.max_kv_size is None, "max_kv_size bounds one sequence's caches; a batch "
                                       "keeps every position (generate with stream_generate "
                                       "for max_kv_size).", "max_kv_size")
        self._uid += 1
        seq = _Sequence(self._uid, run.ids, settings, prompt_cache=prompt_cache, record=record)
        seq.responses = responses(self.tokenizer, run.ids, self._pull(seq), settings.max_tokens,
                                  reset_peak=False)
        self.waiting.append(seq)
        return seq.uid

    @staticmethod
    def _pull(seq: _Sequence):
        while seq.steps:
            yield seq.steps.popleft()

    def cancel(self, uid: int) -> None:
        """Drop a sequence (waiting, joining or decoding) at once."""
        self.waiting = deque(s for s in self.waiting if s.uid != uid)
        if self.joining is not None and self.joining.uid == uid:
            self.joining = None
        keep = [i for i, s in enumerate(self.active) if s.uid != uid]
        if len(keep) != len(self.active):
            self.rows.keep(keep)

    def _start(self, seq: _Sequence, batch: int) -> None:
        """A sequence's drafter, sampling and state as it joins a batch of `batch`: the
        benchmark's choice for that size (where it measured batches) picks the tree."""
        run = prepare(self.model, self.tokenizer, seq.ids, seq.settings, batch=batch)
        seq.plain = run.drafter is None
        drafter = RootDrafter() if seq.plain else run.drafter
        seq.engine = Engine(self.target, drafter, run.sampling, run.max_context, run.logprobs)
        seq.engine.taps = self.taps if drafter.features is not None or seq.record else ()
        seq.engine.recorder = seq.record
        pc, seq.start = seq.prompt_cache, 0
        if pc is None:
            seq.state = State(self.target.make_cache(), drafter.new_state(), keys=run.keys)
        else:
            seq.start = pc.reuse(self.target, None if seq.plain else drafter, seq.ids)
            seq.state = pc.state()
            seq.state.keys = run.keys

    def _prefill_step(self) -> Optional[_Sequence]:
        """One chunk of the joining sequence's prefill (the next waiting one starts where
        there is room); the sequence once it has joined the batch."""
        if self.joining is None:
            if not self.waiting or len(self.active) >= self.max_batch:
                return None
            self.joining = seq = self.waiting.popleft()
            self._start(seq, len(self.active) + 1)
            seq.prefill = seq.engine.prefill_chunks(seq.state, seq.ids, seq.start,
                                                    self.prefill_chunk)
        seq = self.joining
        try:
            next(seq.prefill)
            return None  # more chunks to go
        except StopIteration:
            pass
        self.joining = None
        seq.steps.append(Step([seq.state.history[-1]], None, logprobs=seq.engine.root_logprobs))
        self.rows.join(seq)
        return seq

    # ---------------------------------------------------------------- a step
    def step(self) -> List[Tuple[int, object]]:
        """One prefill chunk of the next joining sequence (while there is room) and one cycle
        of the batch. Returns (id, GenerationResponse) for every sequence that produced
        tokens; a sequence whose response has a finish_reason has left."""
        out = []
        with mx.stream(generation_stream):
            joined = self._prefill_step()
            if joined is not None:
                out += self._emit(joined)
                if joined.done:  # done with its first token (max_tokens 1, or a stop token)
                    self.rows.keep(list(range(len(self.active) - 1)))
            if self.active:  # (timed where no prefill shares the step)
                out += self._cycle(timed=joined is None and self.joining is None)
        return out

    def _emit(self, seq: _Sequence) -> List[Tuple[int, object]]:
        r = next(seq.responses)
        if r.finish_reason is not None:
            seq.done = True
        return [(seq.uid, r)]

    def _draft(self, rows, speculative) -> List[Tree]:
        """Every row's tree through its drafter: rows whose drafters share a batch key in
        one `propose_batch` call, the others alone; the root alone where a row does not
        speculate this cycle."""
        trees = [None] * len(rows)
        groups = {}
        for b, (s, spec) in enumerate(zip(rows, speculative)):
            if not spec:
                trees[b] = _root_tree(s.state.root)
                continue
            drafter = s.engine.drafter
            if drafter.reads_kv:  # (its row of the batch's caches)
                drafter.take_kv(s.state.drafter, self.caches, s.state.n, row=b)
            key = drafter.batch_key()
            groups.setdefault(("alone", b) if key is None else key, []).append(b)
        for members in groups.values():
            draft_rows = [DraftRow(b, rows[b].engine.drafter, rows[b].state) for b in members]
            drafted = draft_rows[0].drafter.propose_batch(draft_rows, self.head_caches)
            for b, t in zip(members, drafted):
                trees[b] = rows[b].engine.sampled(rows[b].state, t)
        return trees

    def _verify(self, rows, trees, speculative):
        """One target forward over every row's tree; each row's Verified and what it
        accepts (its accepted-node mask and next token, as it would alone)."""
        tokens, depth, anc, sizes = _padded(trees)
        lengths = [s.state.n for s in rows]
        positions = mx.array(lengths)[:, None] + depth
        max_depth = max(s.engine.drafter.max_depth if sp else 0
                        for s, sp in zip(rows, speculative))
        hidden, tapped = self.target.verify_batch(tokens, self.caches, lengths, positions, anc,
                                                  taps=self.taps, max_depth=max_depth)
        logits = self.target.lm_head(hidden)                               # [B, T, V]
        results, verified = [], []
        for b, (s, t, n, sp) in enumerate(zip(rows, trees, sizes, speculative)):
            v = Verified(hidden[b: b + 1], [x[b: b + 1] for x in tapped], logits[b, :n])
            verified.append(v)
            if sp:
                results.append(s.engine.accept(t, v, s.state.key()))
            else:  # the next token as plain decoding picks it
                lp = logits[b, 0]
                if s.plain:  # (mlx-lm's generate_step hands its sampler log-probabilities)
                    lp = log_softmax(lp)
                results.append((mx.ones((1,), dtype=mx.bool_), s.engine.sampling.pick(
                    lp, s.state.key()).reshape(())))
        return verified, results

    @staticmethod
    def _batch_costs(rows) -> None:
        """Each greedy adaptive row's choices priced for the batch it is in now: its share of
        the batch's verify pass at each width (`EagleModel.costs(batch=...)`), taken afresh
        whenever the batch's size crosses a measured one."""
        from .adaptive import batch_size_measured

        size = batch_size_measured(len(rows))
        for s in rows:
            d = s.engine.drafter
            if getattr(d, "batch_costs", None) is not None and s.costed != size:
                s.costed = size
                s.state.drafter.controller.costs = (d.costs if size == 1
                                                    else d.batch_costs(size)).copy()

    def _cycle(self, timed: bool = True) -> List[Tuple[int, object]]:
        rows = self.active
        self._batch_costs(rows)
        start = time.perf_counter()
        speculative = [not s.plain and s.engine.fits(s.state) for s in rows]
        trees = self._draft(rows, speculative)
        verified, results = self._verify(rows, trees, speculative)
        for s, t, sp in zip(rows, trees, speculative):  # (as each row would alone)
            if sp:
                s.engine.decides_plain(s.state, t)
        # SYNC (once per cycle): every row's accepted nodes and next token
        mx.eval([r for pair in results for r in pair], [t.tokens for t in trees])
        seconds, sizes, width, drafted = _timing(rows, trees, speculative, time.perf_counter()
                                                 - start if timed else None)
        kept, out = [], []
        for s, t, (mask, bonus), v, sp, n in zip(rows, trees, results, verified, speculative,
                                                 sizes):
            path = np.flatnonzero(np.array(mask)).tolist()
            kept.append(path)
            step = s.engine.advance(s.state, t, v, path, bonus.item())
            if not sp:
                step.accept_length = None if s.plain else 0
            else:
                s.engine.drafter.observe_in_batch(s.state.drafter, step.tokens[:-1],
                                                  seconds if n == width else None, width,
                                                  drafted)
                step.choice = s.engine.drafter.chosen(s.state.drafter)
            s.steps.append(step)
        self.target.batch_accept(self.caches, kept)
        mx.async_eval(self.rows.arrays())
        for s in rows:
            out += self._emit(s)
        for s in rows:  # a sequence at the end of its context finishes there
            if not s.done and s.state.n >= s.engine.max_context:
                s.steps.clear()
                r = next(s.responses, None)  # (the step iterator is empty: "length")
                if r is not None:
                    out.append((s.uid, r))
                s.done = True
        keep = [i for i, s in enumerate(rows) if not s.done]
        if len(keep) != len(rows):
            self.rows.keep(keep)
        return out
