"""The engine's plain pass against mlx-lm's, side by side in one run.

    python -m eagle_mlx.benchmark plain-pass [--model M --eagle H] [--lengths 128 2048]
        [--kv-bits 4] [--runs 5] [--max-tokens 33]

On prompts of each length (token ids cycled through the vocabulary), three modes decode the
same greedy tokens, interleaved, `--runs` times each: `speculate=False` (mlx-lm's own
`generate_step`), auto under costs that make nothing pay (so it decodes plainly throughout,
through the engine's cycle, its plain passes decided and built ahead), and the same with the
caches snapshotted on every pass (what the engine did before a pass decided ahead stopped
taking one: every layer's buffers copied). Prints each mode's speed against
`speculate=False`'s (medians of the runs, tokens/s from the first token on). Without --model:
the demo pair.
"""

import argparse
import statistics
import time

import eagle_mlx
from .context import PLAIN_COSTS
from ..decoding.adaptive import Costs
from ..decoding.engine import Engine

MODES = ("never", "auto, plain", "auto, plain, a snapshot every pass")


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark plain-pass", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--eagle", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--kv-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=33)
    args = p.parse_args(argv)
    if args.runs < 1 or args.max_tokens < 2 or min(args.lengths) < 1:
        p.error("--runs, --max-tokens (at least 2) and --lengths are positive.")
    if args.model is None:
        from ..demo import demo_head, demo_target

        args.model, args.eagle = str(demo_target()), args.eagle or str(demo_head())
    model, tok = eagle_mlx.load(args.model, eagle=args.eagle)
    tok.eos_token_ids = set()
    kv = {} if args.kv_bits is None else dict(kv_bits=args.kv_bits, quantized_kv_start=0)
    model.measured = Costs(PLAIN_COSTS)  # (nothing pays: auto decodes plainly)
    if args.kv_bits is not None:
        model.measured_kv[(args.kv_bits, 64)] = Costs(PLAIN_COSTS)
    prebuild = Engine.prebuild

    def run(mode, prompt):
        Engine.prebuild = prebuild if "snapshot" not in mode else \
            (lambda self, state, tree, accepted, keep=True:
             prebuild(self, state, tree, accepted, True))
        try:
            start, out = None, []
            for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=args.max_tokens,
                                               speculate=False if mode == "never" else "auto",
                                               **kv):
                start = start or time.perf_counter()
                out += r.tokens
            return (len(out) - 1) / (time.perf_counter() - start), out, r.passes
        finally:
            Engine.prebuild = prebuild

    V = model.target.vocab_size
    for length in args.lengths:
        prompt = [(7 + 7919 * i) % V for i in range(length)]
        speed = {m: [] for m in MODES}
        texts, passes = {}, {}
        for i in range(args.runs):
            for m in (MODES if i % 2 == 0 else MODES[::-1]):
                tps, texts[m], passes[m] = run(m, prompt)
                speed[m].append(tps)
        base = statistics.median(speed["never"])
        print(f"{length} positions, {'float' if args.kv_bits is None else f'{args.kv_bits}-bit'}"
              " KV: " + "; ".join(
                  f"{m} {statistics.median(v) / base:.3f}x" for m, v in speed.items()) +
              f" (never {base:.2f} tok/s; texts equal: "
              f"{all(t == texts['never'] for t in texts.values())}; auto's passes "
              f"{passes['auto, plain']})", flush=True)


if __name__ == "__main__":
    main()
