#!/usr/bin/env python3
"""What speculation buys on this device, for real model shapes, without their weights.

    python scripts/bench_device.py [--shapes llama-3.1-8b qwen3.5-9b gpt-oss-20b] [--bits 4]
        [--context 512] [--nodes 1 2 4 8 16 32 64] [--acceptance 0.5 0.7 0.9]
        [--max-tokens 64] [--output bench_device.json]

For each shape a model with random weights (quantized to --bits, 0: the dtype's floats) is
built in memory, and on whatever device MLX runs on (Metal, CUDA, the CPU):

1. the verify cost curve: the engine's cycle for a chain of n nodes after --context cached
   positions, over a plain step's (what `speculate="auto"` measures for itself);
2. plain decoding against speculation at a set acceptance: a drafter that proposes the
   target's own greedy continuation, each token kept with probability a and otherwise
   replaced by another (so the target accepts a prefix whose length is geometric in a), as
   chains of fixed lengths and as `speculate="auto"` choosing among them from the measured
   costs and the acceptance it sees — tokens per second against plain decoding's, in one
   run, interleaved, with the check that every mode's tokens are plain decoding's.

`--tiny` shrinks every shape to a few layers of small width: what the test suite runs on
the CPU. A random model's greedy text repeats soon; the drafter's acceptance is what the
acceptance column says whatever the text, so the speedups are those of a head that accepts
that much on this shape.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_mlx.decoding.adaptive import (PLAIN, AdaptiveDrafter, Costs,  # noqa: E402
                                         Option, head_chain)
from eagle_mlx.decoding.engine import Engine, SamplingParams  # noqa: E402
from eagle_mlx.decoding.lookup import build_tree  # noqa: E402
from eagle_mlx.targets.target import Target  # noqa: E402

# published shapes (config.json values; Qwen3.5's linear-attention sizes as its family's)
SHAPES = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                         intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=131072,
                         tie_word_embeddings=False),
    "qwen3.5-9b": dict(model_type="qwen3_5", text_config=dict(
        model_type="qwen3_5_text", hidden_size=4096, num_hidden_layers=32,
        intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        vocab_size=248320, linear_num_value_heads=32, linear_num_key_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        full_attention_interval=4, max_position_embeddings=262144, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24,
                        intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                        vocab_size=201088, sliding_window=128, rope_theta=150000.0,
                        rms_norm_eps=1e-5, max_position_embeddings=131072,
                        layer_types=["sliding_attention", "full_attention"] * 12),
}
TINY = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, num_local_experts=4,
            num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=2,
            sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2)


def config_of(name: str, tiny: bool) -> dict:
    config = json.loads(json.dumps(SHAPES[name]))
    inner = config.get("text_config", config)
    if tiny:
        for k, v in TINY.items():
            if k in inner or k in ("head_dim",):
                inner[k] = v
    return config


def build(name: str, bits: int, tiny: bool, dtype=mx.float16, seed: int = 0) -> Target:
    """A model of the shape with random weights, quantized to `bits` (0: not)."""
    from eagle_mlx.mlxlm import model_module

    config = config_of(name, tiny)
    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = {}
    from mlx.utils import tree_flatten, tree_unflatten

    for k, v in tree_flatten(model.parameters()):  # (one tensor at a time: no float32 copy)
        if "norm" in k and v.ndim == 1:
            params[k] = mx.ones(v.shape, dtype)
        else:
            params[k] = mx.random.normal(v.shape, dtype=dtype) * 0.02
        mx.eval(params[k])
    model.update(tree_unflatten(list(params.items())))
    if bits:  # (every layer that mlx-lm quantizes: linear, embedding, experts)
        nn.quantize(model, group_size=64, bits=bits,
                    class_predicate=lambda p, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % 64 == 0)
    mx.eval(model.parameters())
    return Target(model, config)


class SetAcceptance(AdaptiveDrafter):
    """Speculation whose drafts are the target's own greedy continuation (`reference`, the
    whole sequence), each drafted token kept with probability `acceptance` and otherwise
    replaced by another: a head that accepts that much. `forced`: always that chain (None:
    chosen as `speculate="auto"` chooses, among the chains, from the costs)."""

    def __init__(self, costs: Costs, target, reference: List[int], acceptance: float,
                 chains=(1, 2, 3, 4, 6, 8), forced: Option = None, seed: int = 0):
        super().__init__(costs, target)  # (no head, no lookup: the chains below instead)
        self.head_options = [head_chain(d) for d in chains]
        self.max_depth = max(chains)
        self.reference, self.acceptance, self.seed = reference, acceptance, seed
        self.vocab = target.vocab_size
        self.fixed = forced

    def new_state(self):
        state = super().new_state()
        state.forced = self.fixed
        return state

    def propose(self, state, features, tokens, root):
        seq = state.lookup.automaton.tokens  # (the sequence after its first token, the
        seq += tokens.tolist()                # root last: the root's position is its length)
        pos = len(seq)
        if state.forced is not None:
            option = state.forced
        else:
            if state.decided is not None:  # (a plain pass decided ahead: `plain_ahead`)
                state.choice, state.decided = state.decided, None
            else:
                state.choice = state.controller.choose()
            option = state.choice.option
        r = int(root.item())
        if option.kind == "plain":
            return _levels(build_tree(r, [], 0), 0)
        rng = np.random.default_rng(self.seed * 1_000_003 + pos)  # (the same at a position
        chain = []                                                   # whatever the option)
        for d in range(1, option.depth + 1):
            want = self.reference[pos + d] if pos + d < len(self.reference) else 0
            keep = rng.random() < self.acceptance
            chain.append(want if keep else (want + 1 + int(rng.integers(self.vocab - 1)))
                         % self.vocab)
        return _levels(build_tree(r, [(t, i, 0.0) for i, t in enumerate(chain)], len(chain)),
                       len(chain))


def _levels(tree, levels):
    tree.levels = levels
    return tree


def run(target, drafter, prompt: List[int], max_tokens: int, plain: bool = False):
    """(tokens after the first, seconds from the first token on, target forwards)."""
    from eagle_mlx.decoding.steps import plain_steps, speculative_steps

    steps = plain_steps(target, prompt, SamplingParams(), target.max_context) if plain else \
        speculative_steps(target, drafter, prompt, SamplingParams())
    out, start, forwards = [], None, 0
    for step in steps:
        out += step.tokens
        if start is None:
            start = time.perf_counter()
        else:
            forwards += 1
        if len(out) >= max_tokens:
            break
    mx.synchronize()
    return out[:max_tokens], time.perf_counter() - start, forwards


def cost_curve(target, prompt: List[int], nodes: List[int], reps: int = 3) -> Dict[int, float]:
    """Seconds of the engine's cycle for a chain of n nodes after the prompt (the median of
    `reps` after one that warms the shape up)."""
    drafter = SetAcceptance(Costs({1: 1.0}), target, list(prompt) + [0] * 1024, 1.0,
                            chains=tuple(n - 1 for n in nodes if n > 1) or (1,))
    engine = Engine(target, drafter, SamplingParams(), target.max_context)
    out = {}
    for n in nodes:
        state = engine.new_state()
        engine.prefill(state, prompt)
        state.drafter.forced = PLAIN if n == 1 else head_chain(n - 1)
        times = []
        for _ in range(reps + 1):  # (the context grows by what each accepts: a few tokens)
            start = time.perf_counter()
            engine.cycle(state)
            times.append(time.perf_counter() - start)
        out[n] = statistics.median(times[1:])
    return out


def bench_shape(name: str, args) -> dict:
    target = build(name, args.bits, args.tiny, getattr(mx, args.dtype))
    V = target.vocab_size
    prompt = [(7 + 7919 * i) % V for i in range(args.context)]
    curve = cost_curve(target, prompt, args.nodes)
    base = curve[1]
    print(f"{name}: a plain step {1000 * base:.1f} ms; verify(n)/plain: " +
          ", ".join(f"{n}: {s / base:.2f}" for n, s in curve.items()), file=sys.stderr)
    reference, _, _ = run(target, None, prompt, args.max_tokens + 1, plain=True)
    reference = list(prompt) + reference
    costs = Costs(curve)
    rows = []
    for a in args.acceptance:
        modes = {"plain": None, "auto": None}
        modes.update({f"chain {d}": head_chain(d) for d in args.chains})
        times = {m: [] for m in modes}
        tokens = {}
        for rep in range(args.reps):
            for m, option in modes.items():
                if m == "plain":
                    out, secs, fw = run(target, None, prompt, args.max_tokens, plain=True)
                else:
                    d = SetAcceptance(costs, target, reference, a, chains=args.chains,
                                      forced=option, seed=rep)
                    out, secs, fw = run(target, d, prompt, args.max_tokens)
                times[m].append(secs)
                tokens[m] = (out, fw)
        plain_s = statistics.median(times["plain"])
        row = {"acceptance": a, "modes": {}}
        for m in modes:
            out, fw = tokens[m]
            s = statistics.median(times[m])
            row["modes"][m] = {"speedup": plain_s / s, "tokens_per_second": (len(out) - 1) / s,
                               "tau": (len(out) - 1) / max(fw, 1),
                               "identical": out == tokens["plain"][0]}
        rows.append(row)
        print(f"  acceptance {a}: " + ", ".join(
            f"{m} {v['speedup']:.2f}x (tau {v['tau']:.2f})" for m, v in row["modes"].items()),
            file=sys.stderr)
    return {"shape": name, "config": config_of(name, args.tiny), "bits": args.bits,
            "dtype": args.dtype,
            "context": args.context, "verify_seconds": {str(n): s for n, s in curve.items()},
            "plain_step_seconds": base, "acceptance": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--bits", type=int, default=4, choices=[0, 3, 4, 5, 6, 8])
    p.add_argument("--context", type=int, default=512, help="cached positions before each "
                   "measured pass")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    p.add_argument("--chains", type=int, nargs="+", default=[1, 3, 6])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2, help="runs of every mode (interleaved)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="the weights' (default: float16; float32 with --tiny, the CPU's "
                   "fastest)")
    p.add_argument("--tiny", action="store_true", help="every shape at a few small layers")
    p.add_argument("--output", default="bench_device.json")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.tiny else "float16")
    bad = [a for a in args.acceptance if not 0 <= a <= 1] + \
        [n for n in args.nodes + args.chains + [args.context, args.max_tokens] if n < 1]
    if bad or 1 not in args.nodes:
        p.error("--acceptance takes values from 0 to 1; --nodes must include 1; sizes are "
                f"positive (got {bad or args.nodes}).")
    report = {"device": str(mx.default_device()), "machine": platform.platform(),
              "mlx": mx.__version__, "shapes": [bench_shape(s, args) for s in args.shapes]}
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
