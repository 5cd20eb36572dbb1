"""Training tokens/s with the target in the loop against training from cached features.

    OPENBLAS_NUM_THREADS=1 python ../shared/tools/fastblas.py -m eagle_mlx.benchmark train

One run, one process: ShareGPT conversations rendered for the demo target (or --model),
their features recorded once (`regen --answers data`: that pass's tokens/s is reported
too), then the same batches trained (warm-up step first, then --steps timed steps) in
each mode: the target's forward in the loop (today's `train --data`), and `train
--features` with soft labels (the target's lm_head over the cached features), hard labels
(no lm_head), each over the whole vocabulary (EAGLE-3: its default draft vocabulary) and
over a --draft-vocab one; with --unroll, each of those unroll steps in turn. Prints a
markdown table of tokens/s and the ratio to the first (in the loop, whole vocabulary) run of
the same kind and unroll.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path



def _record(a, tmp: Path):
    """Features of --conversations recorded with regen (timed), and their texts as a
    conversations file: (features folder, text file, tokens recorded, seconds)."""
    from ..regen import main as regen_main

    feats = tmp / "features"
    t0 = time.perf_counter()
    assert regen_main(["--model", a.model, "--out", str(feats), "--answers", "data",
                       "--num-conversations", str(a.conversations), "--max-len", str(a.max_len),
                       "--quiet"]) == 0
    record_s = time.perf_counter() - t0
    index = json.loads((feats / "index.json").read_text())
    recorded = sum(s["tokens"] for s in index["shards"])
    text = tmp / "conversations.jsonl"
    text.write_text("".join((feats / s["text"]).read_text() for s in index["shards"]))
    return feats, text, recorded, record_s


def _timed_steps(target, tokenizer, argv, source, text, feats, a):
    """--steps training steps of the train tool's flags `argv` after a warm-up, from the
    target in the loop or the recorded features: (tokens, seconds)."""
    from ..train import build_parser, check_args
    from ..training.data import ConversationData, FeatureData, load_conversations
    from ..training.features import FeatureShards
    from ..training.trainer import Trainer

    args = build_parser().parse_args(argv)
    check_args(args)
    if source == "loop":
        data = ConversationData(target, tokenizer, load_conversations(str(text)), args)
    else:
        data = FeatureData(target, tokenizer, FeatureShards(feats, target), args)
    trainer = Trainer(target, data, args)
    order = data.epoch_order(0)
    batches = [data.batch(order[s: s + a.batch_size])
               for s in range(0, (a.steps + 1) * a.batch_size, a.batch_size)]
    trainer.train_step(batches[0])  # warm-up
    t = time.perf_counter()
    for b in batches[1:]:
        trainer.train_step(b)
    return sum(b[3] for b in batches[1:]), time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark train", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="target (default: the demo target)")
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--kinds", nargs="+", default=["eagle1", "eagle3"])
    p.add_argument("--unroll", type=int, nargs="+",
                   help="also time these --unroll steps (default: each kind's recipe alone)")
    p.add_argument("--modes", nargs="+", type=int, help="only these of the modes (0-5)")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    from ..train import MAX_UNROLL

    if any(not 1 <= u <= MAX_UNROLL for u in a.unroll or []):
        p.error(f"--unroll must be from 1 to {MAX_UNROLL} steps (got {a.unroll}).")

    from ..targets.load import load_target

    if a.model is None:
        from ..demo import demo_target

        a.model = str(demo_target())
    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    feats, text, recorded, record_s = _record(a, tmp)
    target, tokenizer = load_target(a.model)
    modes = [("target in the loop", "loop", "soft", None),
             (f"target in the loop, loss over {a.draft_vocab} tokens", "loop", "soft",
              a.draft_vocab),
             ("cached, soft labels", "features", "soft", None),
             (f"cached, soft labels, loss over {a.draft_vocab} tokens", "features", "soft",
              a.draft_vocab),
             ("cached, hard labels", "features", "hard", None),
             (f"cached, hard labels, loss over {a.draft_vocab} tokens", "features", "hard",
              a.draft_vocab)]
    rows = []
    for kind, unroll in [(k, u) for k in a.kinds for u in (a.unroll or [None])]:
        base = None
        for m, (name, source, labels, vocab) in enumerate(modes):
            if a.modes and m not in a.modes:
                continue
            argv = ["--kind", kind, "--out", str(tmp / "unused"), "--labels", labels,
                    "--batch-size", str(a.batch_size), "--max-len", str(a.max_len)]
            if vocab:
                argv += ["--draft-vocab", str(vocab)]
            if unroll:
                argv += ["--unroll", str(unroll)]
                name += f", unroll {unroll}"
            tokens, seconds = _timed_steps(target, tokenizer, argv, source, text, feats, a)
            tps = tokens / seconds
            base = base or tps
            rows.append({"kind": kind, "mode": name, "tokens": tokens, "seconds": round(seconds, 2),
                         "tokens_per_s": round(tps, 1), "x_loop": round(tps / base, 2)})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nfeatures recorded (regen --answers data): {recorded} tokens in {record_s:.1f} s "
          f"({recorded / record_s:.0f} tokens/s)\n")
    print("| head | mode | training tokens/s | x target in the loop |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['kind']} | {r['mode']} | {r['tokens_per_s']} | {r['x_loop']} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"record_tokens_per_s": recorded / record_s,
                                            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
