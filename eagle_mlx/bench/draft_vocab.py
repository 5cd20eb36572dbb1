"""τ and draft cost against the draft vocabulary size N on the demo pair (or --model/--eagle).

    python -m eagle_mlx.benchmark draft-vocab --sizes 4096 8192 16384 32768 0 --num-prompts 4

For each N (0: the whole vocabulary) the same MT-bench and HumanEval prompts are decoded
greedily with the default tree, the phases of every cycle timed (draft, verify, accept,
update; one sync per phase, so the split is exact and the total a little slower than an
untimed run). Prints τ, the draft seconds per cycle and tokens/s per N, runs interleaved
prompt by prompt so that machine noise falls on every N alike.
"""

import argparse
import statistics
import sys
import time



def main(argv=None):
    import eagle_mlx
    from .prompts import load_prompts
    from ..cli import chat_prompt
    from ..demo import demo_head, demo_target
    from ..model import attach_draft_vocab
    from ..decoding.steps import PhaseTimer, SamplingParams, eagle_steps

    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark draft-vocab", description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--eagle")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 0])
    p.add_argument("--num-prompts", type=int, default=4, help="per dataset")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    # (an EAGLE-1 question: an EAGLE-3 head drafts over the vocabulary it was trained with)
    target, head = (args.model, args.eagle) if args.model else (demo_target(), demo_head("eagle1"))
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    drafts = {}
    for n in args.sizes:
        if n:
            attach_draft_vocab(model.head, model.target, tok, n)
            drafts[n] = model.head.draft
    tree = model.tree_settings().asdict()
    prompts = load_prompts(["mt-bench", "humaneval"], args.num_prompts)
    rows = {n: [] for n in args.sizes}
    for src, text in prompts:
        ids = chat_prompt(tok, [{"role": "user", "content": text}])
        for n in args.sizes:
            model.head.use_draft_vocab(drafts.get(n))
            timer, out, taus = PhaseTimer(), [], []
            start = time.perf_counter()
            for step in eagle_steps(model.target, model.head, ids, SamplingParams(),
                                    timer=timer, **tree):
                out += step.tokens
                if step.accept_length is not None:
                    taus.append(step.accept_length + 1)
                if len(out) >= args.max_tokens:
                    break
            seconds = time.perf_counter() - start
            rows[n].append({"tau": sum(taus) / len(taus), "tokens": len(out), "seconds": seconds,
                            "draft": timer.seconds["draft"] / max(timer.cycles, 1),
                            "cycle": sum(timer.seconds.values()) / max(timer.cycles, 1)})
        print(f"[{src}] " + ", ".join(f"N={n or 'full'}: tau {rows[n][-1]['tau']:.2f}"
                                      for n in args.sizes), file=sys.stderr, flush=True)
    print(f"{len(prompts)} prompts (MT-bench + HumanEval), {args.max_tokens} tokens, greedy, tree "
          f"{tree['total_tokens']}/{tree['depth']}/{tree['draft_top_k']}")
    print("| N | tau | draft s/cycle | cycle s | tokens/s |\n| --- | --- | --- | --- | --- |")
    for n in args.sizes:
        r = rows[n]
        print(f"| {n or 'full'} | {statistics.mean(x['tau'] for x in r):.3f} | "
              f"{statistics.mean(x['draft'] for x in r):.3f} | "
              f"{statistics.mean(x['cycle'] for x in r):.3f} | "
              f"{sum(x['tokens'] for x in r) / sum(x['seconds'] for x in r):.2f} |")


if __name__ == "__main__":
    main()
