"""Timed runs: one generation timed from the prefill's token on, one run of a mode as the
tree tuning compares them, a function's median time, acceptance by draft depth."""

import statistics
import time

def median_time(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_one(model, tokenizer, ids, max_tokens, temp, seed, tree=None, timer=None):
    from ..generation import stream_generate
    from ..decoding.steps import SamplingParams, eagle_steps

    if timer is not None:  # profiling run: the engine itself, with syncs after each phase
        steps = eagle_steps(model.target, model.head, ids, SamplingParams(temp), timer=timer,
                            **tree)
        t0 = time.perf_counter()
        produced, cycles = 0, 0
        for step in steps:
            produced += len(step.tokens)
            cycles += step.accept_length is not None
            if produced >= max_tokens:
                break
        return {"seconds": time.perf_counter() - t0, "cycles": cycles}
    speculate = tree is not None
    kwargs = dict(tree or {})
    r = None
    tokens = []
    for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, temp=temp, seed=seed,
                             speculate=speculate, **kwargs):
        tokens += r.tokens
    return {"tokens": tokens, "generation_tokens": r.generation_tokens,
            "tokens_per_second": r.generation_tps, "tau": r.mean_accept_length if speculate else 1.0,
            "target_forwards": r.target_forwards,
            **({"accept_lengths": r.accept_lengths} if speculate else {})}


def timed_generation(model, tokenizer, ids, **settings) -> dict:
    """One generation (`stream_generate`'s keyword arguments), timed from the prefill's
    token on: its tokens, seconds, the prefill's seconds, tokens/s as the responses say,
    target passes, passes by kind and peak memory."""
    from ..generation import stream_generate

    tokens, r, start, first = [], None, time.perf_counter(), None
    for r in stream_generate(model, tokenizer, ids, **settings):
        tokens += r.tokens
        first = first or time.perf_counter()
    return {"tokens": tokens, "seconds": time.perf_counter() - first,
            "prefill_seconds": first - start, "generation_tps": r.generation_tps,
            "target_forwards": r.target_forwards, "passes": dict(r.passes),
            "peak_memory_gb": r.peak_memory}


def depth_acceptance(accept_lengths, depth: int):
    """Of the cycles whose accepted path reached depth d-1, the share that reached depth d
    (d = 1..depth): how well the draft holds up deeper in the tree."""
    rates = []
    for d in range(1, depth + 1):
        reached = sum(a >= d - 1 for a in accept_lengths)
        rates.append(sum(a >= d for a in accept_lengths) / reached if reached else None)
    return rates
