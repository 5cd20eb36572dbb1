"""Public generation API (the shape mlx-lm users know) and `python -m eagle_mlx.generate`.

    model, tokenizer = eagle_mlx.load(target, eagle=head)
    for r in eagle_mlx.stream_generate(model, tokenizer, prompt, max_tokens=256):
        print(r.text, end="")
"""

import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .errors import EagleError
from .speculative import SamplingParams, eagle_steps, plain_steps


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


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise EagleError(message)


def validate_settings(model, max_tokens, temp, top_p, top_k, total_tokens, depth,
                      draft_top_k, tree_choices) -> None:
    _check(isinstance(max_tokens, int) and max_tokens >= 1,
           f"max_tokens must be a whole number of at least 1 (got {max_tokens}).")
    _check(temp >= 0, f"temp must be 0 (greedy) or positive (got {temp}).")
    _check(0 < top_p <= 1, f"top_p must be in (0, 1] (got {top_p}).")
    _check(isinstance(top_k, int) and top_k >= 0, f"top_k must be 0 (off) or positive (got {top_k}).")
    if model is None:  # plain decoding: no tree
        return
    _check(isinstance(draft_top_k, int) and draft_top_k >= 1,
           f"draft_top_k must be at least 1 (got {draft_top_k}).")
    vocab = getattr(model.head.args, "draft_vocab_size", None) or model.head.args.vocab_size
    _check(draft_top_k <= vocab,
           f"draft_top_k {draft_top_k} exceeds the head's draft vocabulary of {vocab}.")
    if tree_choices:
        return
    _check(isinstance(depth, int) and depth >= 1, f"depth must be at least 1 (got {depth}).")
    pool = draft_top_k + depth * draft_top_k ** 2
    _check(isinstance(total_tokens, int) and 2 <= total_tokens <= pool + 1,
           f"total_tokens must be between 2 and {pool + 1} for depth {depth} and "
           f"draft_top_k {draft_top_k} (got {total_tokens}).")


def encode_prompt(tokenizer, prompt: Union[str, Sequence[int]]) -> List[int]:
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    else:
        ids = [int(t) for t in prompt]
    return list(ids)


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
) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per target forward pass.

    prompt: a str (tokenized as is, no chat template) or a list of token ids.
    With `model.head` None this is plain autoregressive decoding of the target.
    speculate: None decides from the model (its head and the benchmark's tuning; explicit
    tree settings always speculate); False forces plain decoding, True EAGLE.
    tree_choices: EAGLE-1 static tree (list of paths); None: EAGLE-2 dynamic tree of
    `total_tokens` nodes (incl. the root), `depth` levels, `draft_top_k` children.
    """
    if speculate is None:
        explicit = any(x is not None for x in (total_tokens, depth, draft_top_k, tree_choices))
        speculate = model.head is not None and (explicit or model.speculates)
    _check(not speculate or model.head is not None, "speculative decoding needs an EAGLE head.")
    tree = model.tree_settings()
    total_tokens = tree["total_tokens"] if total_tokens is None else total_tokens
    depth = tree["depth"] if depth is None else depth
    draft_top_k = tree["draft_top_k"] if draft_top_k is None else draft_top_k
    validate_settings(model if speculate else None, max_tokens, temp, top_p, top_k, total_tokens, depth,
                      draft_top_k, tree_choices)
    ids = encode_prompt(tokenizer, prompt)
    _check(len(ids) > 0, "the prompt is empty.")
    target = model.target
    max_context = max_context or target.max_context
    _check(len(ids) <= max_context,
           f"the prompt has {len(ids)} tokens but the model's context is {max_context} tokens.")
    _check(max(ids) < target.vocab_size and min(ids) >= 0,
           f"the prompt holds token ids outside the model's vocabulary of {target.vocab_size}.")
    if seed is not None:
        mx.random.seed(seed)
    sampling = SamplingParams(temp, top_p, top_k)
    if not speculate:
        steps = plain_steps(target, ids, sampling, max_context)
    else:
        try:
            steps = eagle_steps(target, model.head, ids, sampling, total_tokens, depth,
                                draft_top_k, tree_choices, max_context)
        except ValueError as e:  # a malformed static tree
            raise EagleError(str(e)) from None

    stop_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    detok = tokenizer.detokenizer
    detok.reset()
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
        if step.accept_length is not None:
            accept_lengths.append(step.accept_length)
        if finish is not None:
            detok.finalize()
        yield response(tokens, step.accept_length, finish)
        if finish is not None:
            return
    # the context is full
    detok.finalize()
    yield response([], None, "length")


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """The whole generated text (a thin wrapper over `stream_generate`)."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))
