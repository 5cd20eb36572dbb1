"""Import the EAGLE heads published on Hugging Face into MLX.

    python -m eagle_mlx.convert --eagle yuhuili/EAGLE3-LLaMA3.1-Instruct-8B \\
        --mlx-path eagle3-llama3.1-8b-mlx --model meta-llama/Llama-3.1-8B-Instruct -q

Detects EAGLE-1 vs EAGLE-3, checks every key and shape (and the pair, with --model),
optionally casts (--dtype) or quantizes (-q), and writes the folder atomically.
"""

import argparse
import sys
from pathlib import Path

from .checkpoint import DTYPES, _atomic_dir, build_head, read_head, save_head
from .errors import EagleError


def main(argv=None) -> int:
    from .cli import run_cli

    return run_cli(_main, argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.convert",
        description="Convert an EAGLE-1/EAGLE-3 head (PyTorch, local or Hugging Face) to MLX.",
    )
    p.add_argument("--eagle", required=True, help="head folder or Hugging Face repo id")
    p.add_argument("--mlx-path", required=True, help="output folder for the MLX head")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the linear layers")
    p.add_argument("--q-bits", type=int, default=4, choices=[2, 3, 4, 6, 8])
    p.add_argument("--q-group-size", type=int, default=64, choices=[32, 64, 128])
    p.add_argument("--model", help="target folder or repo id: validate the pair and convert "
                                  "the target through mlx-lm with the same --dtype/-q")
    p.add_argument("--model-mlx-path", help="output folder for the converted target "
                                            "(default: MLX_PATH-target)")
    return p


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.mlx_path)
    if out.exists():
        raise EagleError(f"--mlx-path {out} already exists; choose a new folder.")
    model_out = Path(args.model_mlx_path or f"{out}-target") if args.model else None
    if model_out is not None and model_out.exists():
        raise EagleError(f"--model-mlx-path {model_out} already exists; choose a new folder.")
    config, weights, path = read_head(args.eagle)
    target = None
    if args.model:
        from .target import load_target

        target, _ = load_target(args.model, lazy=True)
    head = build_head(config, weights, path, target)
    if args.model:
        from mlx_lm import convert as mlx_convert

        def write_target(tmp: Path):
            mlx_convert(str(target.path), mlx_path=str(tmp), quantize=args.quantize,
                        q_bits=args.q_bits, q_group_size=args.q_group_size, dtype=args.dtype)

        _atomic_dir(model_out, write_target)
    save_head(head, config, out, dtype=args.dtype,
              q_bits=args.q_bits if args.quantize else None, q_group_size=args.q_group_size)
    print(f"wrote {head.kind} head to {out}" + (f" and target to {model_out}" if model_out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
