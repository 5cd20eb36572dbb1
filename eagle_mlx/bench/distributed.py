"""Communication and speed of a target sharded over ranks, plain decoding against EAGLE.

    python -m eagle_mlx.benchmark distributed                       # one process (the baseline)
    mlx.launch -n 2 --backend ring -- python -m eagle_mlx.benchmark distributed   # two ranks

Counts the all-reduces and the bytes they carry per target forward and per generated
token (plain decoding: one forward per token; EAGLE: one forward per cycle), and the
tokens per second, on the demo pair by default. Rank 0 prints one JSON line.
"""

import argparse
import json
import time

import mlx.core as mx

PROMPT = "Give me three tips for writing a good email."


def main(argv=None):
    import eagle_mlx
    from .. import distributed
    from ..cli import chat_prompt
    from ..demo import demo_draft_vocab, demo_paths
    from ..model import attach_draft_vocab

    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark distributed", description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--eagle")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode (the best counts)")
    args = p.parse_args(argv)
    group = distributed.group()
    model_path, head_path = args.model, args.eagle
    if model_path is None:
        model_path, head_path = demo_paths()
    model, tok = eagle_mlx.load(str(model_path), eagle=str(head_path), group=group)
    n = demo_draft_vocab(model.head) if args.model is None else None
    if n:  # as the demo drafts
        attach_draft_vocab(model.head, model.target, tok, n)
    ids = chat_prompt(tok, [{"role": "user", "content": PROMPT}])

    calls = {"n": 0, "bytes": 0}
    if group is not None:
        real = mx.distributed.all_sum

        def counting(x, *a, **k):
            calls["n"] += 1
            calls["bytes"] += x.nbytes
            return real(x, *a, **k)

        mx.distributed.all_sum = counting

    result = {"ranks": group.size() if group else 1, "model": str(model_path),
              "max_tokens": args.max_tokens}
    for mode in ("plain", "eagle"):
        best = None
        for _ in range(args.repeats):
            calls.update(n=0, bytes=0)
            start = time.perf_counter()
            last = None
            for r in eagle_mlx.stream_generate(model, tok, ids, max_tokens=args.max_tokens,
                                               speculate=mode == "eagle", seed=0):
                last = r
            seconds = time.perf_counter() - start
            row = {"tokens_per_second": last.generation_tps, "seconds": round(seconds, 3),
                   "tokens": last.generation_tokens, "target_forwards": last.target_forwards + 1,
                   "tau": last.mean_accept_length if mode == "eagle" else 1.0,
                   "all_reduces": calls["n"], "all_reduce_bytes": calls["bytes"]}
            if best is None or row["tokens_per_second"] > best["tokens_per_second"]:
                best = row
        f = best["target_forwards"]
        best["all_reduces_per_forward"] = best["all_reduces"] / f
        best["bytes_per_forward"] = best["all_reduce_bytes"] / f
        best["bytes_per_token"] = best["all_reduce_bytes"] / best["tokens"]
        result[mode] = best
    if distributed.rank(group) == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
