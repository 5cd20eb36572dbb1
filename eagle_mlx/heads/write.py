"""Writing heads: the MLX folder `eagle_mlx.load` reads (`save_head`, also what `convert`
writes for a published head), and the published PyTorch-side layout (`export_head`)."""

import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .read import EAGLE3_MIN_TARGET_LAYERS, FORMAT_VERSION, quantize_predicate
from .eagle import HeadArgs
from ..outputs import atomic_dir
from ..targets.dtypes import DTYPES


_OPTIONS_DEFAULTS = {f.name: f.default for f in fields(HeadArgs) if f.name in (
    "aux_layers", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
    "final_norm", "num_layers", "qk_norm", "sliding_window", "layer_types")}


def head_config(head, source_config: dict) -> dict:
    # an MTP module's source config is the model's text config: what rebuilds its layer;
    # an EAGLE head's is in the official key names, whatever the layout it was read from
    source = head.source.config or source_config
    config = {k: v for k, v in source.items()
              if k not in ("eagle", "quantization", "eagle3_options")}
    width, vocab = head.target_width, head.vocab_size
    if head.kind != "mtp":
        a = head.args
        if head.kind == "eagle3":
            options = {k: getattr(a, k) for k, d in _OPTIONS_DEFAULTS.items()
                       if getattr(a, k) != d}
            if options:
                config["eagle3_options"] = {k: list(v) if isinstance(v, tuple) else v
                                            for k, v in options.items()}
    config["eagle"] = {
        "kind": head.kind,
        "format_version": FORMAT_VERSION,
        "target_hidden_size": width,
        "target_vocab_size": vocab,
        "feature_size": head.feature_size,
        "target_min_layers": EAGLE3_MIN_TARGET_LAYERS if head.kind == "eagle3" else 1,
    }
    layout = head.source.layout
    if layout and layout != "eagle_mlx":
        config["eagle"]["layout"] = layout
    if head.source.made_for:
        config["eagle"]["made_for"] = head.source.made_for
    top1 = (source_config.get("eagle") or {}).get("held_out_top1")
    if top1 is not None:  # what its trainer measured: acceptance far below it means a mismatch
        config["eagle"]["held_out_top1"] = top1
    if head.kind == "eagle1":
        config["bias"] = head.args.bias
    return config


def save_head(head, source_config: dict, out: Path, dtype: Optional[str] = None,
              q_bits: Optional[int] = None, q_group_size: int = 64) -> None:
    from tqdm import tqdm

    config = head_config(head, source_config)
    params = dict(tree_flatten(head.parameters()))
    if dtype:
        params = {k: v.astype(DTYPES[dtype]) if mx.issubdtype(v.dtype, mx.floating) else v
                  for k, v in params.items()}
        head.load_weights(list(params.items()))
        config["torch_dtype"] = dtype
    if q_bits:
        nn.quantize(head, group_size=q_group_size, bits=q_bits,
                    class_predicate=quantize_predicate(q_group_size))
        config["quantization"] = {"group_size": q_group_size, "bits": q_bits}
        params = dict(tree_flatten(head.parameters()))
    out_params = {}
    for k, v in tqdm(params.items(), desc="writing head", unit="tensor",
                     disable=not sys.stderr.isatty()):
        mx.eval(v)
        out_params[k] = v

    def write(tmp: Path):
        tmp.mkdir(parents=True)
        mx.save_safetensors(str(tmp / "model.safetensors"), out_params, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    atomic_dir(out, write)


def export_head(head, config: dict, target, dest: Path) -> None:
    """The published PyTorch-side layout: config.json + model.safetensors, official key
    names. EAGLE-1 files carry the target's embedding; EAGLE-3 files carry none, but the
    draft vocabulary both ways: `d2t` (int64 offsets: target id = draft id + d2t) and
    `t2d` (a bool mask over the target's vocabulary)."""
    params = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
              for k, v in tree_flatten(head.parameters())}
    if head.kind == "eagle1":
        params["embed_tokens.weight"] = target.embed_tokens.weight.astype(mx.float32)
    else:
        d2t = params["d2t"].astype(mx.int64)
        t2d = np.zeros(head.args.vocab_size, dtype=bool)
        t2d[np.array(d2t) + np.arange(d2t.shape[0])] = True
        params["d2t"], params["t2d"] = d2t, mx.array(t2d)
    cfg = {k: v for k, v in head_config(head, config).items() if k != "eagle"}

    def write(tmp: Path):
        tmp.mkdir(parents=True)
        mx.save_safetensors(str(tmp / "model.safetensors"), params, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    atomic_dir(dest, write)
