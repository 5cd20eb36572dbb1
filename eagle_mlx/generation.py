"""The public generation API, in the shape mlx-lm users know: `stream_generate`, `generate`,
`batch_generate`.

    model, tokenizer = eagle_mlx.load(target, eagle=head)
    for r in eagle_mlx.stream_generate(model, tokenizer, prompt, max_tokens=256):
        print(r.text, end="")
"""

import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from . import mlxlm
from .decoding.batch import DEFAULT_MAX_BATCH, BatchGenerator
from .decoding.engine import generation_stream
from .decoding.logprobs import TokenLogprob
from .decoding.plan import prepare
from .decoding.responses import GenerationResponse, StopFilter, responses
from .decoding.settings import GenerationSettings
from .errors import check
from .decoding.steps import PromptCache, plain_steps, speculative_steps
from .distributed import shared_seed


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
    speculate: Union[str, bool, None] = "auto",
    min_p: float = 0.0,
    prompt_cache: Optional[PromptCache] = None,
    settings: Optional[GenerationSettings] = None,
    logprobs: Optional[int] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
    max_kv_size: Optional[int] = None,
) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per target forward pass.

    prompt: a str (tokenized as is, no chat template) or a list of token ids.
    With `model.head` None this is plain autoregressive decoding of the target.
    temp, top_p, min_p, top_k: as mlx-lm's `make_sampler` (filters on the untempered
    distribution, then the temperature); temp 0 is greedy.
    speculate: "auto" (the default) chooses every target forward between plain
    decoding, prompt lookup (unless loaded with lookup=False) and the head's chains and
    trees, from this machine's costs (measured at first use, then cached) and the
    acceptance so far; True always drafts (the head's tree; lookup where loaded with
    lookup=True); False is plain decoding; None runs the benchmark's saved choice for this
    machine (its tree, or plain decoding where it found none pays). Explicit tree settings
    mean True, with that tree.
    tree_choices: EAGLE-1 static tree (list of paths); None: EAGLE-2 dynamic tree of
    `total_tokens` nodes (incl. the root), `depth` levels, `draft_top_k` children.
    prompt_cache: a `PromptCache` kept across calls; a prompt extending what it holds
    (the next turn of a conversation) is prefilled only from where it differs.
    logprobs: None, or report every token's log-probability (`GenerationResponse.logprobs`)
    with that many top alternatives (0-20): under the target's distribution in greedy
    decoding, under the one drawn from (after the filters and temperature) when sampling.
    kv_bits, kv_group_size, quantized_kv_start: quantized KV caches, as mlx-lm's
    generate_step takes them (every full-attention cache packed to kv_bits once it holds
    quantized_kv_start positions; sliding windows and recurrent states stay in float).
    max_kv_size: bounded caches, as mlx-lm's (the 4 first positions kept, then a window of
    the latest; for models whose layers all attend to every position).
    settings: a `GenerationSettings` holding all of the above at once (given, it is used
    instead of the keyword arguments).
    """
    if settings is None:
        settings = GenerationSettings(max_tokens, temp, top_p, top_k, min_p, seed, total_tokens,
                                      depth, draft_top_k, tree_choices, max_context, speculate,
                                      logprobs, kv_bits, kv_group_size, quantized_kv_start,
                                      max_kv_size)
    group = getattr(model, "group", None)
    if group is not None and isinstance(settings, GenerationSettings) and \
            settings.check().seed is None and settings.temp > 0:
        settings = settings.replace(seed=shared_seed(group))  # every rank draws the same tokens
    run = prepare(model, tokenizer, prompt, settings, prompt_cache)
    target, ids = model.target, run.ids
    if run.drafter is None:
        steps = plain_steps(target, ids, run.sampling, run.max_context, prompt_cache=prompt_cache,
                            keys=run.keys, logprobs=run.logprobs, kv=run.kv,
                            max_kv_size=run.max_kv_size)
    else:
        steps = speculative_steps(target, run.drafter, ids, run.sampling, run.max_context,
                                  prompt_cache=prompt_cache, keys=run.keys,
                                  logprobs=run.logprobs, kv=run.kv,
                                  max_kv_size=run.max_kv_size)
    max_tokens = settings.max_tokens
    with mlxlm.wired_limit(target.model, [generation_stream]):
        try:
            yield from responses(tokenizer, ids, steps, max_tokens)
        finally:
            if group is not None:
                _settle(steps)


def _settle(steps) -> None:
    """Finish what a generation left queued before anything else communicates: mlx-lm's
    plain decoding evaluates one step ahead on its own stream, and collectives queued on
    two streams could pair up differently on different ranks."""
    steps.close()
    mx.synchronize(mlxlm.generation_stream)
    mx.synchronize(generation_stream)


MIN_CYCLES_TO_JUDGE = 20  # cycles before the acceptance says anything about the head


def acceptance_warning(model, r: GenerationResponse, temp: float = 0.0) -> Optional[str]:
    """One sentence when a generation accepted far fewer drafted tokens than the head's own
    record promises (its trainer's held-out top-1 accuracy, or the benchmark's tau on this
    machine): the sign of a head made for another target. Only the cycles the head drafted
    count (adaptive speculation decodes plainly or copies where the head does not pay)."""
    head = model.head
    cycles = r.head_accept_lengths
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
            sum(cycles) / len(cycles) < 0.5 * (tuned - 1):
        return (f"tau {1 + sum(cycles) / len(cycles):.2f} is far below the {tuned:.2f} the benchmark "
                f"measured for this head; is {model.head_path} a head for this target?")
    return None


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """The whole generated text (a thin wrapper over `stream_generate`)."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))


@dataclass
class BatchResult:
    """One sequence of a `batch_generate`: its text, tokens and statistics."""

    text: str
    tokens: List[int]
    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    mean_accept_length: float
    target_forwards: int
    accept_lengths: List[int] = field(default_factory=list, repr=False)
    # where asked for (settings' logprobs): one per token of `tokens`
    logprobs: Optional[List[TokenLogprob]] = field(default=None, repr=False)
    # adaptive speculation: its passes by what they drafted (see GenerationResponse.passes)
    passes: Dict[str, int] = field(default_factory=dict, repr=False)


@dataclass
class BatchResponse:
    """mlx-lm's `batch_generate` result: the texts in prompt order, and statistics."""

    texts: List[str]
    stats: Dict[str, float]
    results: List[BatchResult]


def batch_generate(model, tokenizer, prompts: Sequence[Union[str, Sequence[int]]],
                   max_tokens: Union[int, Sequence[int]] = 128, max_batch: Optional[int] = None,
                   settings: Optional[Sequence[GenerationSettings]] = None,
                   stop: Optional[Sequence[Sequence[str]]] = None, verbose: bool = False,
                   **kwargs) -> BatchResponse:
    """Generate for every prompt, continuously batched (at most `max_batch` at once;
    default: all of them up to DEFAULT_MAX_BATCH); one result per prompt, in order.

    max_tokens: one for all or one per prompt. settings: one GenerationSettings per prompt
    (temperatures, seeds, trees ...), or stream_generate's keyword arguments for all.
    stop: per prompt, strings that end its text (the text is cut before the first)."""
    check(isinstance(prompts, (list, tuple)) and len(prompts) > 0,
          "prompts must be a non-empty list of prompts.")
    check(stop is None or (isinstance(stop, (list, tuple)) and all(
        isinstance(s, (list, tuple)) and all(isinstance(x, str) for x in s) for s in stop)),
        f"stop must be a list holding one list of stop strings per prompt (got {stop!r}).",
        "stop")
    check(settings is None or (isinstance(settings, (list, tuple)) and all(
        isinstance(s, GenerationSettings) for s in settings)),
        "settings must be a list holding one eagle_mlx.GenerationSettings per prompt.",
        "settings")
    check(isinstance(verbose, bool), f"verbose must be True or False (got {verbose!r}).",
          "verbose")
    n = len(prompts)
    if settings is None:
        per_max = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * n
        check(len(per_max) == n, f"max_tokens has {len(per_max)} values for {n} prompts.")
        settings = [GenerationSettings(max_tokens=m, **kwargs) for m in per_max]
    else:
        check(not kwargs, "give the settings either per prompt (settings=) or as keyword "
                           "arguments, not both.")
        check(len(settings) == n, f"settings has {len(settings)} entries for {n} prompts.")
    stop = [[] for _ in range(n)] if stop is None else [list(s) for s in stop]
    check(len(stop) == n, f"stop has {len(stop)} entries for {n} prompts.")
    gen = BatchGenerator(model, tokenizer,
                         min(n, DEFAULT_MAX_BATCH) if max_batch is None else max_batch)
    uids = [gen.add(p, s) for p, s in zip(prompts, settings)]
    order = {u: i for i, u in enumerate(uids)}
    filters = [StopFilter(s) for s in stop]
    texts, tokens = [""] * n, [[] for _ in range(n)]
    scores = [None if s.logprobs is None else [] for s in settings]
    last = [None] * n
    start = time.perf_counter()
    mx.reset_peak_memory()
    with mlxlm.wired_limit(model.target.model, [generation_stream]):
        while gen.busy:
            for uid, r in gen.step():
                i = order[uid]
                tokens[i] += r.tokens
                if r.logprobs is not None:
                    scores[i] += r.logprobs
                emit, finish = filters[i].feed(r.text, r.finish_reason)
                texts[i] += emit
                last[i] = (r, finish)
                if verbose and emit:
                    print(emit, end="", flush=True)
                if finish is not None and r.finish_reason is None:  # a stop string
                    gen.cancel(uid)
    elapsed = time.perf_counter() - start
    results = []
    for i in range(n):
        r, finish = last[i]
        results.append(BatchResult(texts[i], tokens[i], finish, r.prompt_tokens,
                                   r.generation_tokens, r.mean_accept_length, r.target_forwards,
                                   r.accept_lengths, scores[i], r.passes))
    produced = sum(r.generation_tokens for r in results)
    stats = {"prompt_tokens": sum(r.prompt_tokens for r in results), "generation_tokens": produced,
             "seconds": elapsed, "generation_tps": produced / max(elapsed, 1e-9),
             "peak_memory": mx.get_peak_memory() / 1e9}
    return BatchResponse(texts, stats, results)
