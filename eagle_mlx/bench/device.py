"""What speculation buys on this device, for real model shapes, without their weights.

    python -m eagle_mlx.benchmark device [--shapes llama-3.1-8b qwen3.5-9b gpt-oss-20b] [--bits 4]
        [--dtype bfloat16] [--context 512 4096] [--nodes 1 2 4 8 16 32 64]
        [--acceptance 0.5 0.7 0.9] [--chains 1 3 6] [--trees 16/4/4 60/5/10 32/8/8] [--batch 4]
        [--max-tokens 64] [--budget SECONDS] [--output bench_device.json]

For each shape a model is built in memory whose greedy next token is a fixed permutation of
the current one, by a margin far above half precision's and 4-bit's error (its embedding
rows random, its lm_head the same rows permuted, every decoder weight small enough that the
residual stream stays the embedding's): the shapes and costs of the real model, and no
near-tied logits, so every mode's tokens are plain decoding's in float16, bfloat16 and
4-bit. On whatever device MLX runs on (Metal, CUDA, the CPU):

1. the cost curve at each --context: mlx-lm's own forward of n tokens (its causal mask, a
   cache of fixed length), the target's tree forward of n nodes with the engine's explicit
   mask (fixed length), and the engine's whole cycle for a chain of n nodes (a cache that
   grows every cycle) with its phases timed one by one (draft, verify, accept, update: a
   sync after each); with the verify's keys padded to the cache's buffer and without
   (`targets/layers.py: pads_keys`), and with the cycle's small parts uncompiled
   (EAGLE_MLX_COMPILE=0's `decoding/compiled.py`); a batch of --batch rows beside one
   sequence: mlx-lm's forward of [B, n] tokens against the engine's batch verify of n
   nodes a row (`costs.measure_batch`);
2. mlx-lm's `generate_step` (the plain baseline) against the engine's plain decoding and
   speculation at a set acceptance: a drafter that proposes the target's own continuation,
   the right token at each depth ranked r among its candidates with probability a(1-a)^r
   (so a chain keeps each token with probability a), as chains and trees of fixed shapes
   (best-first over those rank probabilities, as a DDTree is built) and as
   `speculate="auto"` choosing among them from the measured costs — tokens per second
   against mlx-lm's in one run, interleaved, with the check that every mode's tokens are
   mlx-lm's.

Every figure goes to the JSON as soon as it exists; a shape that fails is reported (the
error in its entry) and the run goes on; --budget ends the run in time (what is left is
marked skipped). `--tiny` shrinks every shape to two layers (one of each kind) of small
width: what the test suite runs on the CPU.
"""

import argparse
import heapq
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import mlxlm
from ..decoding.adaptive import (PLAIN, AdaptiveDrafter, Costs,
                                         Option, head_chain)
from ..decoding.engine import Engine, SamplingParams
from ..decoding.lookup import build_tree
from ..decoding.profiling import PhaseTimer, profiled_cycle
from ..decoding import compiled
from ..targets import layers
from ..targets.target import Target

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
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, num_local_experts=4,
            num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=2,
            sliding_window=16, layer_types=["sliding_attention", "full_attention"])


def config_of(name: str, tiny: bool) -> dict:
    config = json.loads(json.dumps(SHAPES[name]))
    inner = config.get("text_config", config)
    if tiny:
        for k, v in TINY.items():
            if k in inner or k in ("head_dim",):
                inner[k] = v
    return config


STRIDE = 7919  # the permutation's: x -> (STRIDE * x + 13) mod V (a prime: one cycle of V)
LOGIT = 16.0    # the right token's logit; every other is about LOGIT / sqrt(H) x N(0, 1)


def next_token(x: int, vocab: int) -> int:
    """The built model's greedy next token after x."""
    return (STRIDE * x + 13) % vocab


def build(name: str, bits: int, tiny: bool, dtype=mx.float16, seed: int = 0) -> Target:
    """A model of the shape whose greedy next token is `next_token` of the current one,
    quantized to `bits` (0: not). Its embedding rows are N(0, 1); the lm_head's row of
    next_token(x) is x's embedding row x LOGIT / H, so after the final norm the right
    logit is about LOGIT and the others about LOGIT / sqrt(H) each; every decoder weight is
    N(0, 1) x 0.1 / sqrt(fan-in) (each projection a tenth of its input's size), norms are
    ones and biases zeros, so the layers move the residual stream by a few percent."""
    from mlx.utils import tree_flatten, tree_unflatten

    from ..mlxlm import model_module

    config = config_of(name, tiny)
    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = {}
    embed = None
    for k, v in tree_flatten(model.parameters()):  # (one tensor at a time: no float32 copy)
        if k.endswith("embed_tokens.weight"):
            params[k] = embed = mx.random.normal(v.shape, dtype=dtype)
        elif "norm" in k and v.ndim == 1:
            params[k] = mx.ones(v.shape, dtype)
        elif v.ndim == 1 or k.endswith("lm_head.weight"):
            params[k] = mx.zeros(v.shape, dtype)
        else:
            params[k] = mx.random.normal(v.shape, dtype=dtype) * (0.1 / math.sqrt(v.shape[-1]))
        mx.eval(params[k])
    V, H = embed.shape
    assert math.gcd(STRIDE, V) == 1
    head = [k for k in params if k.endswith("lm_head.weight")]
    if head:  # (row next_token(x) = embedding row x, scaled)
        order = mx.array([next_token(x, V) for x in range(V)])
        inverse = mx.zeros((V,), dtype=mx.int32).at[order].add(mx.arange(V, dtype=mx.int32))
        params[head[0]] = (embed[inverse] * (LOGIT / H)).astype(dtype)
        mx.eval(params[head[0]])
    model.update(tree_unflatten(list(params.items())))
    if bits:  # (every layer that mlx-lm quantizes: linear, embedding, experts)
        nn.quantize(model, group_size=64, bits=bits,
                    class_predicate=lambda p, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % 64 == 0)
    mx.eval(model.parameters())
    return Target(model, config)


def tree_shape(nodes: int, depth: int, top_k: int, a: float) -> List[tuple]:
    """The `nodes - 1` most probable rank paths below the root, parents first: a path
    (r_1, .., r_d) is the node whose token at each depth i is the candidate of rank r_i,
    right with probability a(1 - a)^r_i at each depth (DDTree's best-first construction over
    per-depth marginals; a chain is top_k 1)."""
    lp = [math.log(max(a, 1e-9)) + r * math.log(max(1 - a, 1e-9)) for r in range(top_k)]
    out, frontier = [], [(-lp[0], (0,))] if depth else []
    heapq.heapify(frontier)
    while frontier and len(out) < nodes - 1:
        score, path = heapq.heappop(frontier)
        out.append(path)
        if len(path) < depth:
            heapq.heappush(frontier, (score - lp[0], path + (0,)))
        if path[-1] + 1 < top_k:
            heapq.heappush(frontier, (score + lp[path[-1]] - lp[path[-1] + 1],
                                      path[:-1] + (path[-1] + 1,)))
    return sorted(out, key=lambda p: (len(p), p))


class SetAcceptance(AdaptiveDrafter):
    """Speculation whose drafts hold the target's own continuation (`reference`, the whole
    sequence): at each depth the right token is the candidate of rank r with probability
    a(1 - a)^r (a chain keeps each drafted token with probability a), the other candidates
    wrong: a head that accepts that much. Options: chains and trees (`tree_shape`);
    `forced`: always that one (None: chosen as `speculate="auto"` chooses, from the
    costs)."""

    def __init__(self, costs: Costs, target, reference: List[int], acceptance: float,
                 chains=(1, 2, 3, 4, 6, 8), trees=(), forced: Option = None, seed: int = 0):
        super().__init__(costs, target)  # (no head, no lookup: the options below instead)
        self.head_options = [head_chain(d) for d in chains] + \
            [Option("head", n, d, k) for n, d, k in trees]
        self.max_depth = max(o.depth for o in self.head_options)
        self.reference, self.acceptance, self.seed = reference, acceptance, seed
        self.vocab = target.vocab_size
        self.fixed = forced
        self.shapes = {}

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
        key = (option.nodes, option.depth, option.top_k)
        if key not in self.shapes:
            self.shapes[key] = tree_shape(*key, self.acceptance)
        rng = np.random.default_rng(self.seed * 1_000_003 + pos)  # (the same at a position
        ranks = []                                                  # whatever the option)
        for _ in range(option.depth):
            rank = 0
            while rng.random() >= self.acceptance and rank < 64:
                rank += 1
            ranks.append(rank)
        place, nodes = {(): 0}, []
        for path in self.shapes[key]:
            d = len(path)
            want = self.reference[pos + d] if pos + d < len(self.reference) else 0
            token = want if path[-1] == ranks[d - 1] else \
                (want + 1 + path[-1] * 7 + int(rng.integers(self.vocab - 1))) % self.vocab
            if token == want and path[-1] != ranks[d - 1]:
                token = (want + 1) % self.vocab
            place[path] = len(nodes) + 1
            nodes.append((token, place[path[:-1]], 0.0))
        return _levels(build_tree(r, nodes, option.depth), option.depth)


def _levels(tree, levels):
    tree.levels = levels
    return tree


def run(target, drafter, prompt: List[int], max_tokens: int, plain: bool = False):
    """(tokens after the first, seconds from the first token on, target forwards)."""
    from ..decoding.steps import plain_steps, speculative_steps

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


def run_mlx_lm(target, prompt: List[int], max_tokens: int):
    """mlx-lm's own `generate_step` on the target's model: (tokens, seconds from the first)."""
    out, start = [], None
    for token, _ in mlxlm.generate_step(mx.array(prompt), target.plain_model,
                                        max_tokens=max_tokens):
        out.append(int(token))
        if start is None:
            start = time.perf_counter()
    mx.synchronize()
    return out, time.perf_counter() - start


def _median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 1):  # (the first warms the shape up)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def forwards(target, prompt: List[int], nodes: List[int], reps: int) -> dict:
    """Seconds of mlx-lm's forward of n tokens (its own causal mask) and of the target's
    tree forward of a chain of n nodes (the engine's explicit mask), both after the prompt,
    the cache cut back after each (a cache of fixed length)."""
    model = target.plain_model
    cache = mlxlm.make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=cache))
    tree_caches = target.make_cache()
    hidden, _ = target(mx.array(prompt)[None], tree_caches)
    mx.eval(hidden, target.cache_arrays(tree_caches))
    n0 = len(prompt)
    out = {"mlx_lm": {}, "tree_forward": {}}
    for n in nodes:
        ids = mx.array([prompt[i % n0] for i in range(n)])[None]

        def mlx_lm_forward():
            saved = [None if c.is_trimmable() else c.state for c in cache]
            mx.eval(model(ids, cache=cache))
            for c, s in zip(cache, saved):  # (a recurrent state: put back as it was)
                if s is None:
                    c.trim(n)
                else:
                    c.state = s

        mask = mx.concatenate([mx.ones((n, n0), dtype=mx.bool_),
                               mx.tril(mx.ones((n, n), dtype=mx.bool_))], axis=1)

        def tree_forward():
            saved = [dict(vars(c)) for c in tree_caches]
            h, _ = target(ids, tree_caches, positions=n0 + mx.arange(n), mask=mask)
            mx.eval(target.lm_head(h[0]))
            for c, s in zip(tree_caches, saved):  # (the rows appended forgotten)
                c.__dict__.clear()
                c.__dict__.update(s)

        out["mlx_lm"][n] = _median_seconds(mlx_lm_forward, reps)
        out["tree_forward"][n] = _median_seconds(tree_forward, reps)
    return out


def batch_forwards(target, prompt: List[int], nodes: List[int], batch: int, reps: int) -> dict:
    """A batch of `batch` rows beside one sequence: seconds of mlx-lm's forward of
    [batch, n] tokens (its own causal mask, every row after the prompt, the cache cut back
    after each) and of the engine's batch verify pass of a chain of n nodes per row and its
    accept (`costs.measure_batch`, each row after the prompt, its ragged caches)."""
    from types import SimpleNamespace

    from ..costs import measure_batch

    model = target.plain_model
    cache = mlxlm.make_prompt_cache(model)
    mx.eval(model(mx.array([prompt] * batch), cache=cache))
    n0, out = len(prompt), {"mlx_lm": {}}
    for n in nodes:
        ids = mx.array([[prompt[(i + 31 * b) % n0] for i in range(n)] for b in range(batch)])

        def mlx_lm_forward():
            saved = [None if c.is_trimmable() else c.state for c in cache]
            mx.eval(model(ids, cache=cache))
            for c, s in zip(cache, saved):
                if s is None:
                    c.trim(n)
                else:
                    c.state = s

        out["mlx_lm"][n] = _median_seconds(mlx_lm_forward, reps)
    out["engine_batch_verify"] = measure_batch(SimpleNamespace(target=target), batch,
                                               points=nodes, prompt_len=n0, until_linear=False)
    return out


def cycles(target, prompt: List[int], nodes: List[int], reps: int) -> dict:
    """Seconds of the engine's cycle for a chain of n nodes after the prompt (the median of
    `reps`, the cache growing by what each accepts) and its phases, timed one by one."""
    drafter = SetAcceptance(Costs({1: 1.0}), target, list(prompt) + [0] * 4096, 1.0,
                            chains=tuple(n - 1 for n in nodes if n > 1) or (1,))
    engine = Engine(target, drafter, SamplingParams(), target.max_context)
    out = {"cycle": {}, "phases": {}}
    for n in nodes:
        state = engine.new_state()
        engine.prefill(state, prompt)
        state.drafter.forced = PLAIN if n == 1 else head_chain(n - 1)
        out["cycle"][n] = _median_seconds(lambda: engine.cycle(state), reps)
        timer = PhaseTimer()
        profiled_cycle(engine, state, timer)  # (a warm-up, not counted)
        timer = PhaseTimer()
        for _ in range(reps):
            profiled_cycle(engine, state, timer)
        out["phases"][n] = {k: v / max(timer.cycles, 1) for k, v in timer.seconds.items()}
    return out


def cost_curve(target, prompt: List[int], nodes: List[int], reps: int = 3) -> Dict[int, float]:
    """Seconds of the engine's cycle for a chain of n nodes after the prompt."""
    return cycles(target, prompt, nodes, reps)["cycle"]


def padded_as(on: Optional[bool]):
    """Set whether tree passes pad their keys (None: the device's default)."""
    layers.set_pads_keys(on)


def curves(target, prompt, args, put) -> Dict[int, float]:
    """Every cost figure at this context, put into the report as it is measured; returns
    the engine's cycle costs with the device's default padding (what auto gets)."""
    entry = {}
    put(entry)
    entry.update({k: _keyed(v) for k, v in forwards(target, prompt, args.nodes,
                                                    args.reps_cost).items()})
    put(entry)
    default = layers.pads_keys()
    for on in (default, not default):
        padded_as(on)
        c = cycles(target, prompt, args.nodes, args.reps_cost)
        entry[f"keys padded: {on}"] = {k: _keyed(v) for k, v in c.items()}
        put(entry)
        if on == default:
            chosen = c["cycle"]
    padded_as(None)
    for b in args.batch:
        entry[f"batch {b}"] = {k: _keyed(v) for k, v in batch_forwards(
            target, prompt, args.nodes, b, args.reps_cost).items()}
        put(entry)
    was, compiled.ENABLED = compiled.ENABLED, False  # (EAGLE_MLX_COMPILE=0's cycle)
    try:
        c = cycles(target, prompt, args.nodes, args.reps_cost)
    finally:
        compiled.ENABLED = was
    entry["uncompiled"] = {k: _keyed(v) for k, v in c.items()}
    put(entry)
    return chosen


def _keyed(d: dict) -> dict:
    return {str(k): v for k, v in d.items()}


def modes_of(args) -> Dict[str, Optional[Option]]:
    modes = {"engine plain": None, "auto": None}
    modes.update({f"chain {d}": head_chain(d) for d in args.chains})
    modes.update({f"tree {n}/{d}/{k}": Option("head", n, d, k) for n, d, k in args.trees})
    return modes


def acceptance_rows(target, prompt, curve, args, put, over) -> list:
    """Tokens/s of every mode against mlx-lm's plain decoding, per acceptance."""
    reference, _ = run_mlx_lm(target, prompt, args.max_tokens + 1)
    reference = list(prompt) + reference
    costs = Costs(curve)
    rows = []
    for a in args.acceptance:
        if over():
            rows.append({"acceptance": a, "skipped": "out of --budget"})
            put(rows)
            continue
        modes = modes_of(args)
        times = {m: [] for m in ["mlx-lm plain"] + list(modes)}
        tokens = {}
        for rep in range(args.reps):
            out, secs = run_mlx_lm(target, prompt, args.max_tokens)
            times["mlx-lm plain"].append(secs)
            tokens["mlx-lm plain"] = (out, len(out) - 1)
            for m, option in modes.items():
                if m == "engine plain":
                    out, secs, fw = run(target, None, prompt, args.max_tokens, plain=True)
                else:
                    d = SetAcceptance(costs, target, reference, a, chains=args.chains,
                                      trees=args.trees, forced=option, seed=rep)
                    out, secs, fw = run(target, d, prompt, args.max_tokens)
                times[m].append(secs)
                tokens[m] = (out, fw)
        base = statistics.median(times["mlx-lm plain"])
        row = {"acceptance": a, "modes": {}}
        for m, (out, fw) in tokens.items():
            s = statistics.median(times[m])
            row["modes"][m] = {"speedup": base / s, "tokens_per_second": (len(out) - 1) / s,
                               "tau": (len(out) - 1) / max(fw, 1),
                               "identical": out == tokens["mlx-lm plain"][0]}
        rows.append(row)
        put(rows)
        print(f"  acceptance {a}: " + ", ".join(
            f"{m} {v['speedup']:.2f}x (tau {v['tau']:.2f})" for m, v in row["modes"].items()),
            file=sys.stderr)
    return rows


def bench_shape(name: str, args, put, over) -> dict:
    """One shape's figures, each put into `entry` (and the report written) as it exists."""
    entry = {"shape": name, "config": config_of(name, args.tiny), "bits": args.bits,
             "dtype": args.dtype, "contexts": {}}
    put(entry)
    try:
        target = build(name, args.bits, args.tiny, getattr(mx, args.dtype))
        V = target.vocab_size
        for context in args.context:
            if over():
                entry["contexts"][str(context)] = {"skipped": "out of --budget"}
                put(entry)
                continue
            prompt = [(7 + STRIDE * i) % V for i in range(context)]
            here = entry["contexts"][str(context)] = {}

            def put_costs(costs, here=here):
                here["costs"] = costs
                put(entry)

            curve = curves(target, prompt, args, put_costs)
            base = curve[1]
            print(f"{name} at {context}: a plain step {1000 * base:.1f} ms; cycle(n)/plain: " +
                  ", ".join(f"{n}: {s / base:.2f}" for n, s in curve.items()), file=sys.stderr)

            def put_rows(rows, here=here):
                here["acceptance"] = rows
                put(entry)

            if context == args.context[0]:
                acceptance_rows(target, prompt, curve, args, put_rows, over)
    except Exception as e:  # (reported in its entry; the other shapes go on)
        entry["error"] = f"{type(e).__name__}: {e}"
        entry["traceback"] = traceback.format_exc()[-2000:]
        print(f"{name}: {entry['error']}", file=sys.stderr)
    put(entry)
    mx.clear_cache()
    return entry


def parse_tree(spec: str) -> tuple:
    parts = spec.split("/")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a tree is NODES/DEPTH/TOP_K, each a positive "
                                         f"whole number (got {spec!r})")
    return tuple(map(int, parts))


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark device", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--bits", type=int, default=4, choices=[0, 3, 4, 5, 6, 8])
    p.add_argument("--context", type=int, nargs="+", default=[512, 4096],
                   help="cached positions before each measured pass (the acceptance runs: "
                   "after the first)")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    p.add_argument("--chains", type=int, nargs="+", default=[1, 3, 6])
    p.add_argument("--trees", type=parse_tree, nargs="*",
                   default=[(16, 4, 4), (60, 5, 10), (32, 8, 8)],
                   help="tree shapes NODES/DEPTH/TOP_K (16/4/4 and 60/5/10: EAGLE-2's; 32/8/8 "
                   "a DDTree over a block of 8)")
    p.add_argument("--batch", type=int, nargs="*", default=[4],
                   help="batch sizes whose forwards are timed beside one sequence's")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2, help="runs of every mode (interleaved)")
    p.add_argument("--reps-cost", type=int, default=3, help="timed passes per cost point")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds the run may take: what is not begun by then is skipped")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="the weights' (default: float16; float32 with --tiny, the CPU's "
                   "fastest)")
    p.add_argument("--tiny", action="store_true", help="every shape at a few small layers")
    p.add_argument("--output", default="bench_device.json")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.tiny else "float16")
    bad = [a for a in args.acceptance if not 0 < a <= 1] + \
        [n for n in args.nodes + args.chains + args.context + args.batch +
         [args.max_tokens, args.reps, args.reps_cost] if n < 1]
    if bad or 1 not in args.nodes:
        p.error("--acceptance takes values above 0 up to 1; --nodes must include 1; sizes "
                f"are positive (got {bad or args.nodes}).")
    began = time.perf_counter()
    output = Path(args.output)
    report = {"device": str(mx.default_device()), "machine": platform.platform(),
              "mlx": mx.__version__, "command": sys.argv[1:] if argv is None else argv,
              "keys padded by default": layers.pads_keys(), "shapes": []}

    def put(_=None):
        report["seconds"] = time.perf_counter() - began
        output.write_text(json.dumps(report, indent=1))

    def over() -> bool:
        return args.budget is not None and time.perf_counter() - began > args.budget

    for name in args.shapes:
        if over():
            report["shapes"].append({"shape": name, "skipped": "out of --budget"})
            put()
            continue
        report["shapes"].append(None)
        at = len(report["shapes"]) - 1

        def put_shape(entry, at=at):
            report["shapes"][at] = entry
            put()

        bench_shape(name, args, put_shape, over)
    put()
    print(f"wrote {args.output}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
