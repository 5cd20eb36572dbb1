"""Writing heads: the MLX folder `eagle_mlx.load` reads (`save_head`, also what `convert`
writes for a published head), the official PyTorch-side layout (`export_head`) and vLLM
speculators' layout (`export_speculators`), which vLLM, SGLang and mlx-vlm read."""

import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from ..errors import EagleError
from ..outputs import atomic_dir
from ..targets.dtypes import DTYPES
from .eagle import HeadArgs
from .read import EAGLE3_MIN_TARGET_LAYERS, FORMAT_VERSION, quantize_predicate


_OPTIONS_DEFAULTS = {f.name: f.default for f in fields(HeadArgs) if f.name in (
    "aux_layers", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
    "final_norm", "num_layers", "qk_norm", "sliding_window", "layer_types")}


def head_config(head, source_config: dict) -> dict:
    # an MTP module's source config is the model's text config: what rebuilds its layer;
    # an EAGLE head's is in the official key names, whatever the layout it was read from
    source = head.source.config or source_config
    config = {k: v for k, v in source.items()
              if k not in ("eagle", "quantization", "eagle3_options")}
    if getattr(head, "block", False) or getattr(head, "reads_kv", False):
        # a block drafter or a Gemma 4 assistant: its own config says all it is
        config["eagle"] = {"kind": head.kind, "format_version": FORMAT_VERSION}
        return config
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


def _vocab_maps(head, params: dict) -> None:
    """The draft vocabulary both ways, as the published EAGLE-3 files carry it: `d2t`
    (int64 offsets: target id = draft id + d2t) and `t2d` (a bool mask over the target's
    vocabulary)."""
    d2t = params["d2t"].astype(mx.int64)
    t2d = np.zeros(head.vocab_size, dtype=bool)
    t2d[np.array(d2t) + np.arange(d2t.shape[0])] = True
    params["d2t"], params["t2d"] = d2t, mx.array(t2d)


def _write_pt(dest: Path, params: dict, config: dict) -> None:
    def write(tmp: Path):
        tmp.mkdir(parents=True)
        mx.save_safetensors(str(tmp / "model.safetensors"), params, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    atomic_dir(dest, write)


def _target_embedding(target) -> mx.array:
    """The target's embedding matrix in float32 (dequantized where it is quantized)."""
    e = target.embed_tokens
    if isinstance(e, nn.QuantizedEmbedding):
        return mx.dequantize(e.weight, e.scales, e.biases, e.group_size, e.bits,
                             mode=e.mode).astype(mx.float32)
    return e.weight.astype(mx.float32)


def _float32(head) -> dict:
    return {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in tree_flatten(head.parameters())}


def export_head(head, config: dict, target, dest: Path) -> None:
    """The published PyTorch-side layout: config.json + model.safetensors, official key
    names. EAGLE-1 files carry the target's embedding; EAGLE-3 files carry none, but the
    draft vocabulary both ways (`_vocab_maps`)."""
    params = _float32(head)
    if head.kind == "eagle1":
        params["embed_tokens.weight"] = _target_embedding(target)
    else:
        _vocab_maps(head, params)
    _write_pt(dest, params, {k: v for k, v in head_config(head, config).items() if k != "eagle"})


def speculators_config(head) -> dict:
    """The config of an EAGLE-3 head in vLLM speculators' layout (`Eagle3SpeculatorConfig`);
    EagleError where the head has a variant that layout cannot say."""
    where = f"the {head.kind} head" + (f" {head.source.path}" if head.source.path else "")
    if head.kind != "eagle3":
        raise EagleError(f"the speculators layout holds EAGLE-3 heads; {where} is not one.")
    a = head.args
    if not a.final_norm or a.qkv_bias != a.o_bias:
        raise EagleError(f"{where} has " + ("no final norm" if not a.final_norm else
                                            "biased q/k/v without a biased o_proj") +
                         ", which the speculators layout cannot express.")
    layer = {"model_type": "qwen3" if a.qk_norm else "llama", "hidden_size": a.hidden_size,
             "intermediate_size": a.intermediate_size,
             "num_attention_heads": a.num_attention_heads,
             "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
             "vocab_size": a.vocab_size, "num_hidden_layers": a.num_layers,
             "max_position_embeddings": a.max_position_embeddings,
             "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
             "rope_scaling": a.rope_scaling, "attention_bias": a.qkv_bias, "mlp_bias": False,
             "hidden_act": "silu", "tie_word_embeddings": False}
    if a.layer_types:
        layer.update(layer_types=list(a.layer_types), sliding_window=a.sliding_window)
    made_for = head.source.made_for
    return {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
        "draft_vocab_size": a.draft_vocab_size, "target_hidden_size": a.target_width,
        "norm_before_residual": a.norm_before_residual, "norm_before_fc": a.norm_before_fc,
        "fc_norm": a.fc_norm, "norm_output": a.norm_output,
        "eagle_aux_hidden_state_layer_ids": list(a.aux_layers) if a.aux_layers else None,
        "transformer_layer_config": layer, "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": None,
                         "architectures": [made_for] if made_for else []}},
    }


def export_speculators(head, target, dest: Path, dtype: Optional[str] = None) -> None:
    """An EAGLE-3 head in vLLM speculators' layout: its config (`speculators_config`),
    `layers.N.*` tensors, the embedding it drafts with (its own, or the target's: `target`,
    where the head has none) and the draft vocabulary both ways."""
    config = speculators_config(head)
    params = _float32(head)
    if dtype:
        params = {k: v.astype(DTYPES[dtype]) if mx.issubdtype(v.dtype, mx.floating) else v
                  for k, v in params.items()}
    if "embed_tokens.weight" not in params:
        if target is None:
            raise EagleError("the speculators layout carries the embedding the head drafts "
                             "with, the target's for this head: give its target (--model).")
        params["embed_tokens.weight"] = _target_embedding(target).astype(
            params["fc.weight"].dtype)
    if "d2t" in params:
        _vocab_maps(head, params)
    renamed = {}
    for k, v in params.items():
        if k.startswith("midlayer."):
            k = "layers.0." + k[len("midlayer."):]
        elif k.startswith("extra_layers."):
            _, n, rest = k.split(".", 2)
            k = f"layers.{int(n) + 1}.{rest}"
        renamed[k] = v
    _write_pt(dest, renamed, config)
