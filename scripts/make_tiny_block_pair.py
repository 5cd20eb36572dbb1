"""A tiny Qwen3 target and a DFlash drafter trained for it (z-lab's `dflash` package, PyTorch),
plus a prompts file: a pair to measure block drafters on where no published pair runs.

    python scripts/make_tiny_block_pair.py OUT [--block-size 8] [--steps 400]
    python -m eagle_mlx.benchmark --model OUT/target --eagle OUT/drafter \\
        --prompts OUT/prompts.jsonl --ignore-chat-template --trees 8/6/1,8/6/4,...

Needs torch, transformers and `pip install --no-deps dflash` (what the tests install)."""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--num-prompts", type=int, default=8)
    args = p.parse_args(argv)
    if args.block_size < 2 or args.steps < 0 or args.num_prompts < 1:
        p.error("--block-size must be at least 2, --steps at least 0, --num-prompts at least 1")
    out = Path(args.out)
    if out.exists():
        p.error(f"{out} exists; give a new folder")
    import importlib.util

    if importlib.util.find_spec("dflash") is None:
        p.error("the dflash package is not installed (pip install --no-deps dflash)")
    from tiny import make_dflash_drafter, make_hf_model

    out.mkdir(parents=True)
    target = make_hf_model(out / "target", "qwen3", seed=1, vocab_size=64, num_hidden_layers=3,
                           num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True,
                           scale=4.0)
    make_dflash_drafter(out / "drafter", target, layer_ids=(0, 2), block_size=args.block_size,
                        steps=args.steps)
    rng = np.random.default_rng(11)
    with open(out / "prompts.jsonl", "w") as f:
        for _ in range(args.num_prompts):
            words = " ".join(f"t{i}" for i in rng.integers(3, 63, 6))
            f.write(json.dumps({"prompt": words}) + "\n")
    print(f"wrote {out}/target, {out}/drafter and {out}/prompts.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
