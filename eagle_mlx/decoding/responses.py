"""The response stream: each target forward's tokens, as text with running stats
(`GenerationResponse`, the shape mlx-lm users know), and stop strings over that text."""

import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import mlx.core as mx

from .logprobs import TokenLogprob


@dataclass
class GenerationResponse:
    """One target forward pass: the tokens it produced and the running stats."""

    text: str
    tokens: List[int]
    accept_length: Optional[int]
    finish_reason: Optional[str]
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    mean_accept_length: float  # tau: tokens per target forward after the prefill
    target_forwards: int
    peak_memory: float  # GB
    accept_lengths: List[int] = field(default_factory=list, repr=False)
    # where asked for: one per token of `tokens`, each with the text it completed
    logprobs: Optional[List[TokenLogprob]] = field(default=None, repr=False)
    # adaptive speculation: the passes so far by what they drafted (plain, lookup, head,
    # merged); empty otherwise
    passes: Dict[str, int] = field(default_factory=dict, repr=False)
    choice: Optional[str] = None  # ... and what this pass drafted
    # of `accept_lengths`, those of the cycles the head drafted (all, without adaptive choice)
    head_accept_lengths: List[int] = field(default_factory=list, repr=False)


def responses(tokenizer, ids, steps, max_tokens,
               reset_peak: bool = True) -> Iterator[GenerationResponse]:
    stop_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    detok = tokenizer.detokenizer
    detok.reset()
    if reset_peak:
        mx.reset_peak_memory()
    start = time.perf_counter()
    prompt_time = gen_start = None
    produced, forwards, accept_lengths, passes = 0, 0, [], {}
    head_lengths = []

    def response(text, tokens, accept_length, finish, scores=None, choice=None):
        now = time.perf_counter()
        gen_time = now - gen_start
        return GenerationResponse(
            text=text, tokens=tokens, accept_length=accept_length,
            finish_reason=finish, prompt_tokens=len(ids),
            prompt_tps=len(ids) / max(prompt_time, 1e-9),
            generation_tokens=produced,
            # the first token comes from the prefill, so it is not counted here
            generation_tps=(produced - 1) / gen_time if gen_time > 0 else 0.0,
            mean_accept_length=(sum(a + 1 for a in accept_lengths) / len(accept_lengths)
                                if accept_lengths else 0.0),
            target_forwards=forwards, peak_memory=mx.get_peak_memory() / 1e9,
            accept_lengths=list(accept_lengths), logprobs=scores, passes=dict(passes),
            choice=choice, head_accept_lengths=list(head_lengths))

    for step in steps:
        forwards += 1
        if prompt_time is None:
            gen_start = time.perf_counter()
            prompt_time = gen_start - start
        tokens, finish, text = [], None, ""
        scores = step.logprobs
        for t in step.tokens:
            tokens.append(t)
            produced += 1
            if t in stop_ids:
                finish = "stop"
                break
            detok.add_token(t)
            if scores is not None:  # the text each token completes, read token by token
                piece = scores[len(tokens) - 1].text = detok.last_segment
                text += piece
            if produced >= max_tokens:
                finish = "length"
                break
        if step.accept_length is not None:  # tau counts only the tokens that were output
            accept_lengths.append(min(step.accept_length, len(tokens) - 1))
            # (a plain step near the context's end drafted nothing and chose nothing)
            kind = step.choice.split()[0] if step.choice else None
            if kind in ("head", "merged") or (kind is None and step.drafted is not None):
                head_lengths.append(accept_lengths[-1])
        if step.choice is not None:
            kind = step.choice.split()[0]
            passes[kind] = passes.get(kind, 0) + 1
        if finish is not None:
            detok.finalize()
        rest = detok.last_segment  # (with scores: what finalize let out, the last token's)
        text += rest
        if scores is not None:
            scores = scores[: len(tokens)]
            own = [i for i, t in enumerate(tokens) if t not in stop_ids]
            if rest and own:
                scores[own[-1]].text += rest
        yield response(text, tokens, step.accept_length, finish, scores, step.choice)
        if finish is not None:
            return
    # the context is full
    detok.finalize()
    yield response(detok.last_segment, [], None, "length")


class StopFilter:
    """A generation's text through its stop strings: text that might begin one is held back
    until the next tokens tell; the first stop string ends the text before it."""

    def __init__(self, stops: List[str]):
        self.stops, self.held = list(stops), ""

    def feed(self, text: str, finish: Optional[str]):
        """(text to emit now, finish reason: "stop" at a stop string, else `finish`)."""
        self.held += text
        cut = _find_stop(self.held, self.stops)
        if cut is not None:
            emit, self.held = self.held[:cut], ""
            return emit, "stop"
        keep = _partial_stop(self.held, self.stops) if finish is None else 0
        emit, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return emit, finish


def _find_stop(text: str, stops: List[str]) -> Optional[int]:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def _partial_stop(text: str, stops: List[str]) -> int:
    """Length of the longest end of `text` that begins some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best


class ScoreRelease:
    """The tokens' log-probabilities (`TokenLogprob`) handed out with the text they made, as
    a `StopFilter` lets the text out: a token's entry goes out once all of its text has been
    emitted; at the end, the entries of the tokens whose text begins before the end of the
    emitted text (a stop string cuts it), the others dropped."""

    def __init__(self):
        self.pending, self.made, self.emitted = [], 0, 0

    def feed(self, scores, emitted: str, finish: Optional[str]) -> list:
        """scores: the entries of a response's tokens (None: none); emitted: the text the
        StopFilter let out of it; finish: its finish reason. Returns the entries to send, as
        (where the token's text begins in the whole text, entry)."""
        for s in scores or ():
            start = self.made
            self.made += len(s.text)
            self.pending.append((start, self.made, s))
        self.emitted += len(emitted)
        if finish is not None:
            out = [(start, s) for start, _, s in self.pending if start < self.emitted]
            self.pending = []
            return out
        n = 0
        while n < len(self.pending) and self.pending[n][1] <= self.emitted:
            n += 1
        out = [(start, s) for start, _, s in self.pending[:n]]
        self.pending = self.pending[n:]
        return out
