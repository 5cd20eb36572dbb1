"""Public generation API (the shape mlx-lm users know) and `python -m eagle_mlx.generate`.

    model, tokenizer = eagle_mlx.load(target, eagle=head)
    for r in eagle_mlx.stream_generate(model, tokenizer, prompt, max_tokens=256):
        print(r.text, end="")
"""

import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from .errors import EagleError
from .engine import SamplingParams, generation_stream
from .drafters import EagleDrafter
from .lookup import LookupDrafter, MergedDrafter
from .accept import KeyChain
from .speculative import PromptCache, plain_steps, speculative_steps
from .values import GenerationSettings, _check, _is_int, static_top_k


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


def check_tree(model, total_tokens, depth, draft_top_k, tree_choices) -> None:
    """The tree against the head (after loading)."""
    vocab = model.head.draft_vocab_size
    _check(draft_top_k <= vocab,
           f"draft_top_k {draft_top_k} exceeds the head's draft vocabulary of {vocab}.")
    if not tree_choices:  # (a tree deeper than the context left ends in plain steps)
        pool = draft_top_k + depth * draft_top_k ** 2
        _check(total_tokens <= pool + 1,
               f"total_tokens must be at most {pool + 1} for depth {depth} and draft_top_k "
               f"{draft_top_k}, the nodes such a tree can draft (got {total_tokens}).")


def tree_plan(model, total_tokens=None, depth=None, draft_top_k=None, tree_choices=None,
              speculate=None, batch: Optional[int] = None) -> Optional[dict]:
    """The tree a generation will use (None: plain decoding): explicit settings over the
    benchmark's tuning (for a batch of `batch` sequences, where it measured batches) over
    the defaults. speculate as in `stream_generate`."""
    if speculate is None:
        explicit = any(x is not None for x in (total_tokens, depth, draft_top_k, tree_choices))
        speculate = model.head is not None and (explicit or model.speculates_at(batch))
    _check(not speculate or model.head is not None, "speculative decoding needs an EAGLE head.")
    if not speculate:
        return None
    tree = model.tree_settings(batch)
    if draft_top_k is None and tree_choices:  # a static tree's ranks set its top-k
        draft_top_k = max(tree["draft_top_k"], static_top_k(tree_choices))
    for key, value in (("total_tokens", total_tokens), ("depth", depth),
                       ("draft_top_k", draft_top_k)):
        if value is not None:
            tree[key] = value
    if tree_choices:
        tree = {"static": True, "total_tokens": len(tree_choices) + 1, "depth": max(map(len, tree_choices)),
                "draft_top_k": tree["draft_top_k"]}
    return bound_tree(model.target, tree, explicit=total_tokens is not None or bool(tree_choices))


def bound_tree(target, tree: dict, explicit: bool) -> dict:
    """A hybrid target's tree within the memory its nodes' recurrent states may take: a
    tree asked for explicitly is refused beyond it, a default or tuned one is cut to it."""
    limit = target.tree_node_limit()
    if limit is None or tree["total_tokens"] <= limit:
        return tree
    per_node = target.node_state_bytes
    from .target import TREE_STATE_FRACTION, machine_memory

    _check(not explicit,
           f"a tree of {tree['total_tokens']} nodes needs "
           f"{tree['total_tokens'] * per_node / 2**30:.1f} GB of recurrent states on this "
           f"{target.model_type} target ({per_node / 2**20:.1f} MB a node), over the bound of "
           f"{machine_memory() / TREE_STATE_FRACTION / 2**30:.1f} GB (1/{TREE_STATE_FRACTION} of "
           f"this machine's memory); use at most {limit} nodes (total_tokens).")
    return dict(tree, total_tokens=limit)


def encode_prompt(tokenizer, prompt: Union[str, Sequence[int]]) -> List[int]:
    """Token ids of a prompt given as text (tokenized as is) or as token ids."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise EagleError("the prompt is not valid UTF-8 text.") from None
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    if isinstance(prompt, mx.array):
        prompt = prompt.tolist()
    ok = isinstance(prompt, (list, tuple, np.ndarray)) and all(_is_int(t) for t in prompt)
    _check(ok, "the prompt must be a string or a list of token ids (whole numbers), "
               f"not {type(prompt).__name__}" + (" holding other values." if isinstance(
                   prompt, (list, tuple, np.ndarray)) else "."))
    return [int(t) for t in prompt]


@dataclass
class Prepared:
    """What one generation runs, checked: the prompt's ids, the drafter (None: plain
    decoding), the sampling settings, the context and the random keys of its draws."""

    ids: List[int]
    drafter: object
    sampling: SamplingParams
    max_context: int
    keys: KeyChain


def prepare(model, tokenizer, prompt, settings: GenerationSettings,
            prompt_cache: Optional[PromptCache] = None, batch: Optional[int] = None) -> Prepared:
    """Check a request against the model (one sentence for what is wrong) and choose its
    drafter: the head's tree, prompt lookup alone or merged into it, or none (batch: the
    size of the batch it decodes in, whose tuning chooses)."""
    _check(isinstance(settings, GenerationSettings),
           "settings must be an eagle_mlx.GenerationSettings.")
    settings.check()
    s = settings
    temp, seed, max_context = s.temp, s.seed, s.max_context
    total_tokens, depth, draft_top_k, tree_choices = (s.total_tokens, s.depth, s.draft_top_k,
                                                      s.tree_choices)
    _check(prompt_cache is None or isinstance(prompt_cache, PromptCache),
           "prompt_cache must be an eagle_mlx.PromptCache.")
    _check(hasattr(model, "target") and hasattr(model, "head"),
           "model must be the EagleModel that eagle_mlx.load returns.")
    lookup = getattr(model, "lookup", None)  # prompt lookup: alone, or merged with the head
    alone = lookup is not None and model.head is None
    tree = None if alone else tree_plan(model, total_tokens, depth, draft_top_k, tree_choices,
                                        s.speculate, batch)
    speculate = tree is not None
    # where the benchmark found that the head's trees do not pay, lookup drafts alone
    alone = alone or (lookup is not None and not speculate)
    if speculate:
        total_tokens, depth, draft_top_k = tree["total_tokens"], tree["depth"], tree["draft_top_k"]
    target = model.target
    _check(max_context is None or max_context <= target.max_context,
           f"max_context {max_context} exceeds the model's context of {target.max_context} tokens.")
    max_context = max_context or target.max_context
    if speculate:
        check_tree(model, total_tokens, depth, draft_top_k, tree_choices)
    ids = encode_prompt(tokenizer, prompt)
    _check(len(ids) > 0, "the prompt is empty.")
    _check(len(ids) <= max_context,
           f"the prompt has {len(ids)} tokens but the model's context is {max_context} tokens.")
    _check(max(ids) < target.vocab_size and min(ids) >= 0,
           f"the prompt holds token ids outside the model's vocabulary of {target.vocab_size}.")
    group = getattr(model, "group", None)
    if seed is None and group is not None and temp > 0:
        from .distributed import shared_seed

        seed = shared_seed(group)  # every rank must draw the same tokens
    if alone and s.speculate is not False:
        drafter = LookupDrafter(lookup, target.tree_node_limit())
    elif not speculate:
        drafter = None
    else:
        drafter = EagleDrafter(model.head, target, total_tokens, depth, draft_top_k, tree_choices)
        if lookup is not None:
            drafter = MergedDrafter(drafter, LookupDrafter(lookup), total_tokens)
    return Prepared(ids, drafter, SamplingParams(temp, s.top_p, s.top_k, s.min_p), max_context,
                    KeyChain.start(seed))


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, Sequence[int]],
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: Optional[int] = None,
    total_tokens: Optional[int] = None,
    depth: Optional[int] = None,
    draft_top_k: Optional[int] = None,
    tree_choices: Optional[Sequence[Sequence[int]]] = None,
    max_context: Optional[int] = None,
    speculate: Optional[bool] = None,
    min_p: float = 0.0,
    prompt_cache: Optional[PromptCache] = None,
    settings: Optional[GenerationSettings] = None,
) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per target forward pass.

    prompt: a str (tokenized as is, no chat template) or a list of token ids.
    With `model.head` None this is plain autoregressive decoding of the target.
    temp, top_p, min_p, top_k: as mlx-lm's `make_sampler` (filters on the untempered
    distribution, then the temperature); temp 0 is greedy.
    speculate: None decides from the model (its head and the benchmark's tuning; explicit
    tree settings always speculate); False forces plain decoding, True EAGLE.
    tree_choices: EAGLE-1 static tree (list of paths); None: EAGLE-2 dynamic tree of
    `total_tokens` nodes (incl. the root), `depth` levels, `draft_top_k` children.
    prompt_cache: a `PromptCache` kept across calls; a prompt extending what it holds
    (the next turn of a conversation) is prefilled only from where it differs.
    settings: a `GenerationSettings` holding all of the above at once (given, it is used
    instead of the keyword arguments).
    """
    if settings is None:
        settings = GenerationSettings(max_tokens, temp, top_p, top_k, min_p, seed, total_tokens,
                                      depth, draft_top_k, tree_choices, max_context, speculate)
    run = prepare(model, tokenizer, prompt, settings, prompt_cache)
    target, ids, group = model.target, run.ids, getattr(model, "group", None)
    if run.drafter is None:
        steps = plain_steps(target, ids, run.sampling, run.max_context, prompt_cache=prompt_cache,
                            keys=run.keys)
    else:
        steps = speculative_steps(target, run.drafter, ids, run.sampling, run.max_context,
                                  prompt_cache=prompt_cache, keys=run.keys)
    max_tokens = settings.max_tokens
    from . import mlxlm

    with mlxlm.wired_limit(target.model, [generation_stream]):
        try:
            yield from _responses(tokenizer, ids, steps, max_tokens)
        finally:
            if group is not None:
                _settle(steps)


def _settle(steps) -> None:
    """Finish what a generation left queued before anything else communicates: mlx-lm's
    plain decoding evaluates one step ahead on its own stream, and collectives queued on
    two streams could pair up differently on different ranks."""
    from . import mlxlm

    steps.close()
    mx.synchronize(mlxlm.generation_stream)
    mx.synchronize(generation_stream)


def _responses(tokenizer, ids, steps, max_tokens,
               reset_peak: bool = True) -> Iterator[GenerationResponse]:
    stop_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    detok = tokenizer.detokenizer
    detok.reset()
    if reset_peak:
        mx.reset_peak_memory()
    start = time.perf_counter()
    prompt_time = gen_start = None
    produced, forwards, accept_lengths = 0, 0, []

    def response(tokens, accept_length, finish):
        now = time.perf_counter()
        gen_time = now - gen_start
        return GenerationResponse(
            text=detok.last_segment, tokens=tokens, accept_length=accept_length,
            finish_reason=finish, prompt_tokens=len(ids),
            prompt_tps=len(ids) / max(prompt_time, 1e-9),
            generation_tokens=produced,
            # the first token comes from the prefill, so it is not counted here
            generation_tps=(produced - 1) / gen_time if gen_time > 0 else 0.0,
            mean_accept_length=(sum(a + 1 for a in accept_lengths) / len(accept_lengths)
                                if accept_lengths else 0.0),
            target_forwards=forwards, peak_memory=mx.get_peak_memory() / 1e9,
            accept_lengths=list(accept_lengths),
        )

    for step in steps:
        forwards += 1
        if prompt_time is None:
            gen_start = time.perf_counter()
            prompt_time = gen_start - start
        tokens, finish = [], None
        for t in step.tokens:
            tokens.append(t)
            produced += 1
            if t in stop_ids:
                finish = "stop"
                break
            detok.add_token(t)
            if produced >= max_tokens:
                finish = "length"
                break
        if step.accept_length is not None:  # tau counts only the tokens that were output
            accept_lengths.append(min(step.accept_length, len(tokens) - 1))
        if finish is not None:
            detok.finalize()
        yield response(tokens, step.accept_length, finish)
        if finish is not None:
            return
    # the context is full
    detok.finalize()
    yield response([], None, "length")


MIN_CYCLES_TO_JUDGE = 20  # cycles before the acceptance says anything about the head


def acceptance_warning(model, r: GenerationResponse, temp: float = 0.0) -> Optional[str]:
    """One sentence when a generation accepted far fewer drafted tokens than the head's own
    record promises (its trainer's held-out top-1 accuracy, or the benchmark's tau on this
    machine): the sign of a head made for another target."""
    head = model.head
    cycles = r.accept_lengths
    if head is None or len(cycles) < MIN_CYCLES_TO_JUDGE:
        return None
    first = sum(a >= 1 for a in cycles) / len(cycles)  # the first drafted token accepted
    top1 = getattr(head, "held_out_top1", None)
    if temp == 0 and top1 and first < 0.5 * top1:
        return (f"the target accepted the head's first drafted token in {first:.0%} of "
                f"{len(cycles)} cycles, far below the {top1:.0%} the head reached when trained; "
                f"is {model.head_path} a head for this target?")
    tuned = (model.tuning or {}).get("tau")
    if tuned and (model.tuning or {}).get("temp", 0.0) == temp and \
            r.mean_accept_length - 1 < 0.5 * (tuned - 1):
        return (f"tau {r.mean_accept_length:.2f} is far below the {tuned:.2f} the benchmark "
                f"measured for this head; is {model.head_path} a head for this target?")
    return None


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """The whole generated text (a thin wrapper over `stream_generate`)."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))


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
