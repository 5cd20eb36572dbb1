"""Import the EAGLE heads published on Hugging Face into MLX, and targets (Hugging Face
folders, repo ids, GGUF files) into MLX folders.

    python -m eagle_mlx.convert --eagle yuhuili/EAGLE3-LLaMA3.1-Instruct-8B \\
        --mlx-path eagle3-llama3.1-8b-mlx --model meta-llama/Llama-3.1-8B-Instruct -q
    python -m eagle_mlx.convert --model smollm2.Q4_1.gguf --mlx-path smollm2-mlx

Detects EAGLE-1 vs EAGLE-3, checks every key and shape (and the pair, with --model),
optionally casts (--dtype) or quantizes (-q), and writes the folders atomically.
"""

import sys
from pathlib import Path

from .cli import ArgumentParser
from .errors import EagleError
from .outputs import atomic_dir, check_new_dir
from .targets.dtypes import DTYPES


def main(argv=None) -> int:
    from .cli import run_cli

    return run_cli(_main, argv)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m eagle_mlx.convert",
        description="Convert an EAGLE-1/EAGLE-3 head (official, SpecForge, vLLM speculators or "
                    "NVIDIA Model-Optimizer layout, local or Hugging Face), or the MTP module "
                    "of a Qwen3.5/3.6/Qwen3-Next checkpoint, to MLX.",
    )
    p.add_argument("--eagle", help="head folder or Hugging Face repo id (or a model checkpoint "
                                  "whose MTP module to write out as a head)")
    p.add_argument("--mlx-path", required=True,
                   help="output folder for the MLX head (for the target, without --eagle)")
    p.add_argument("--layout", choices=["mlx", "speculators"], default="mlx",
                   help="how to write the head: an MLX folder (default), or vLLM speculators' "
                        "layout (EAGLE-3 heads; what vLLM, SGLang and mlx-vlm read)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the linear layers")
    p.add_argument("--q-bits", type=int, default=4, choices=[2, 3, 4, 6, 8])
    p.add_argument("--q-group-size", type=int, default=64, choices=[32, 64, 128])
    p.add_argument("--model", help="target folder, repo id or GGUF file: validate the pair and "
                                  "convert the target with the same --dtype/-q")
    p.add_argument("--model-mlx-path", help="output folder for the converted target "
                                            "(default: MLX_PATH-target)")
    return p


def save_target(target, tokenizer, out: Path, dtype=None, q_bits=None, q_group_size=64) -> None:
    """An MLX model folder (config.json, safetensors, tokenizer) for a loaded target, as
    mlx-lm writes it; per-layer bits of a GGUF's quantized tensors are kept."""
    from .mlxlm import quantize_model, save_config, save_model

    from .targets.gguf import FreqsRoPE, quantization_config
    from .targets.load import convert_dtype

    if isinstance(target.layers[0].self_attn.rope, FreqsRoPE):
        raise EagleError(f"{target.path} scales RoPE with llama.cpp frequency factors "
                         "(rope_freqs), which an MLX config cannot express; load the GGUF file "
                         "directly instead.")
    model, config = target.model, {k: v for k, v in target.config.items()
                                   if k not in ("quantization", "quantization_config")}
    if dtype or q_bits:
        convert_dtype(model, DTYPES[dtype or "float16"])
    if q_bits:
        model, config = quantize_model(model, config, q_group_size, q_bits)
    quant = quantization_config(model)
    if quant:
        config["quantization"] = config["quantization_config"] = quant

    def write(tmp: Path):
        tmp.mkdir(parents=True)
        save_model(tmp, model)
        save_config(config, config_path=tmp / "config.json")
        tokenizer.save_pretrained(str(tmp))

    atomic_dir(out, write)


def _main(argv) -> int:
    from .cli import UsageError

    args = build_parser().parse_args(argv)
    if not args.eagle and not args.model:
        raise UsageError("give --eagle (a head to convert), --model (a target to convert), or both.")
    if args.layout == "speculators" and (not args.eagle or args.quantize):
        raise UsageError("--layout speculators writes a head (--eagle) in PyTorch-side tensors, "
                         "which MLX's quantization (-q) is not.")
    out = check_new_dir(args.mlx_path, "--mlx-path")
    model_out = (Path(args.model_mlx_path or f"{out}-target") if args.eagle else out) \
        if args.model else None
    if args.eagle and model_out is not None:
        check_new_dir(model_out, "--model-mlx-path")
        if model_out.absolute() == out.absolute():
            raise EagleError("--model-mlx-path must differ from --mlx-path.")
    from .heads.read import build_head, read_head
    from .heads.write import export_speculators, save_head, speculators_config

    head = target = None
    if args.eagle:
        config, weights, path = read_head(args.eagle)
    if args.model:
        from .targets.load import load_target

        target, tokenizer = load_target(args.model, lazy=True, dtype="stored")
    if args.eagle:
        head = build_head(config, weights, path, target)
        if args.layout == "speculators":
            speculators_config(head)  # (a head the layout cannot hold: refused before writing)
    from .cli import started

    started()  # writing: Ctrl-C now cleans up what is half-written
    if args.model:
        q_bits = args.q_bits if args.quantize else None
        if str(target.path).lower().endswith(".gguf"):
            save_target(target, tokenizer, model_out, args.dtype, q_bits, args.q_group_size)
        else:
            from .mlxlm import convert as mlx_convert

            def write_target(tmp: Path):
                mlx_convert(str(target.path), mlx_path=str(tmp), quantize=args.quantize,
                            q_bits=args.q_bits, q_group_size=args.q_group_size, dtype=args.dtype)

            atomic_dir(model_out, write_target)
    if head is not None:
        try:
            if args.layout == "speculators":
                export_speculators(head, target, out, dtype=args.dtype)
            else:
                save_head(head, config, out, dtype=args.dtype,
                          q_bits=args.q_bits if args.quantize else None,
                          q_group_size=args.q_group_size)
        except BaseException:
            if model_out is not None and model_out != out:
                import shutil

                shutil.rmtree(model_out, ignore_errors=True)  # nothing half-done is left
            raise
    from .cli import describe_head

    wrote = ([f"{describe_head(head)} to {out}"] if head else []) + \
        ([f"target to {model_out}"] if model_out else [])
    print("wrote " + " and ".join(wrote))
    return 0


if __name__ == "__main__":
    sys.exit(main())
