"""Loading a target: a folder, a Hub repo or a GGUF file into a `Target`, through mlx-lm.

mlx-lm builds and loads the model (HF folders, sharded and mlx-community checkpoints,
quantized weights, the tokenizer with its chat template); this module checks the config,
adapts what mlx-lm's classes need (rope scalings, hybrid and Gemma layer patterns, expert
stacking), chooses the dtype the weights are computed in, and shards across
`mx.distributed` ranks.
"""

import glob
import json
import re
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .. import mlxlm
from ..errors import EagleError, reason
from ..hub import resolve
from .dtypes import DTYPE_CHOICES
from .families import HYBRID_TYPES, text_config
from .gguf import find_gguf, load_gguf
from .target import SUPPORTED_MODEL_TYPES, Target

QUANTIZATION_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")  # what mx.dequantize reads


def read_config(path: Path, what: str = "model") -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise EagleError(
            f"{what} folder {path} has no config.json; expected a Hugging Face or MLX "
            "model folder."
        )
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EagleError(f"{config_file} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise EagleError(f"{config_file} does not hold a JSON object.")
    return config


def _check_weight_files(path: Path) -> None:
    if not glob.glob(str(path / "model*.safetensors")):
        raise EagleError(f"model folder {path} has no model*.safetensors weight files.")
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise EagleError(f"{index_file} is not a valid safetensors index.") from None
        for name in sorted(set(weight_map.values())):
            if not (path / name).is_file():
                raise EagleError(
                    f"weight file {name} listed in {index_file} is missing from {path}."
                )


def _config_overrides(config: dict, path: Path) -> dict:
    """Config keys that transformers >= 5 writes under new names, translated back to the
    names mlx-lm reads (the Hub's own configs use the classic names)."""
    kind = config.get("model_type")
    if kind == "gemma3_text":
        return _gemma3_overrides(config, path)
    if kind == "gemma3" and isinstance(config.get("text_config"), dict):
        text = dict(config["text_config"])
        text.update(_gemma3_overrides(text, path))
        return {"text_config": text}
    if kind == "gemma4_text":
        return gemma4_overrides(config)
    if kind in ("gemma4", "gemma4_unified") and isinstance(config.get("text_config"), dict):
        text = config["text_config"]
        out = {"text_config": {**text, **gemma4_overrides(text)}}
        if "vocab_size" not in config and "vocab_size" in text:  # (mlx-lm reads it here)
            out["vocab_size"] = text["vocab_size"]
        return out
    if kind in ("ministral3", "mistral3"):
        return {}  # mlx-lm reads their rope_parameters itself
    if kind in HYBRID_TYPES:
        if isinstance(config.get("text_config"), dict):
            return {"text_config": {**config["text_config"],
                                    **hybrid_overrides(config["text_config"], path)}}
        return hybrid_overrides(config, path)
    overrides = _rope_overrides(config)
    if kind == "qwen3_moe" and "num_experts" not in config and "num_local_experts" in config:
        overrides["num_experts"] = config["num_local_experts"]
    return overrides


def _gemma3_overrides(text: dict, path: Path) -> dict:
    """Gemma 3: per-layer-type RoPE settings and `layer_types` (transformers >= 5) as
    mlx-lm's `rope_theta`, `rope_local_base_freq`, `rope_scaling` and
    `sliding_window_pattern` (every p-th layer global: the only pattern mlx-lm builds)."""
    out = {}
    params = text.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params and "rope_theta" not in text:
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        out["rope_theta"] = full.get("rope_theta", 1_000_000.0)
        out["rope_local_base_freq"] = local.get("rope_theta", 10_000.0)
        if full.get("rope_type", "default") != "default":
            out["rope_scaling"] = full
    types = text.get("layer_types")
    if types and "sliding_window_pattern" not in text:
        out["sliding_window_pattern"] = _period(types, "sliding_attention", "Gemma 3", path)
    return out


def _period(types: list, other: str, family: str, path: Path) -> int:
    """p where `layer_types` repeats p-1 `other` layers and one full-attention layer (the only
    pattern mlx-lm builds), refused in one sentence otherwise."""
    p = types.index("full_attention") + 1 if "full_attention" in types else 0
    if not p or types != [("full_attention" if (i + 1) % p == 0 else other)
                          for i in range(len(types))]:
        raise EagleError(f"{path / 'config.json'}: {family} layer_types must repeat n-1 "
                         f"{other.replace('_', ' ')} layers and one full-attention layer (mlx-lm "
                         "builds only that pattern).")
    return p




def hybrid_overrides(text: dict, path: Path) -> dict:
    """Qwen3.5 / Qwen3-Next: transformers >= 5 writes `layer_types` (linear_attention /
    full_attention) instead of `full_attention_interval`, and Qwen3-Next's RoPE settings in
    `rope_parameters`; mlx-lm reads the interval and the classic keys."""
    kind = text.get("model_type")
    out = {"model_type": mlxlm.TEXT_ONLY_TYPES[kind]} if kind in mlxlm.TEXT_ONLY_TYPES else {}
    types = text.get("layer_types")
    if types and "full_attention_interval" not in text:
        out["full_attention_interval"] = _period(types, "linear_attention", "Qwen3.5 / Qwen3-Next",
                                                 path)
    params = text.get("rope_parameters")
    if text.get("model_type") == "qwen3_next" and isinstance(params, dict) \
            and "rope_theta" not in text:
        out["rope_theta"] = params.get("rope_theta", 10000.0)
        out["partial_rotary_factor"] = params.get("partial_rotary_factor", 0.25)
        if params.get("rope_type", "default") != "default":
            out["rope_scaling"] = params
    return out


def gemma4_overrides(text: dict) -> dict:
    """Gemma 4: transformers >= 5 writes the full-attention layers' head size (and, with
    `attention_k_eq_v`, their key/value heads) in `per_layer_config`; mlx-lm reads
    `global_head_dim` and `num_global_key_value_heads`."""
    out = {}
    if text.get("model_type") == "gemma4_unified_text":
        # (the 12B's language model: what mlx-lm's defaults, made for the others, would add)
        out = {"hidden_size_per_layer_input": text.get("hidden_size_per_layer_input") or 0,
               "use_double_wide_mlp": bool(text.get("use_double_wide_mlp", False)),
               "final_logit_softcapping": text.get("final_logit_softcapping")}
    per_layer = text.get("per_layer_config")
    if not isinstance(per_layer, dict) or "global_head_dim" in text:
        return out
    types = text.get("layer_types") or []
    full = [per_layer.get(str(i)) or per_layer.get(i) or {}
            for i, t in enumerate(types) if t == "full_attention"]
    if full and "head_dim" in full[0]:
        out["global_head_dim"] = full[0]["head_dim"]
    if full and "num_key_value_heads" in full[0]:
        out["num_global_key_value_heads"] = full[0]["num_key_value_heads"]
    return out


def _model_classes(config: dict):
    """mlx-lm's model class for a config, as its loader picks it; gpt-oss also reads the
    float layout transformers saves (its experts' fused [E, H, 2I] `gate_up_proj`), which
    mlx-lm's `sanitize` takes only in OpenAI's MXFP4 layout or already converted."""
    module = mlxlm.model_module(config["model_type"])
    if config["model_type"] == "qwen3_5_moe":
        class MoeModel(module.Model):
            def sanitize(self, weights):
                return super().sanitize(stacked_experts(weights))

        return MoeModel, module.ModelArgs
    if config["model_type"] != "gpt_oss":
        return module.Model, module.ModelArgs

    class Model(module.Model):
        def sanitize(self, weights):
            return super().sanitize(gpt_oss_float_experts(weights))

    return Model, module.ModelArgs


def stacked_experts(weights: dict, num_experts: Optional[int] = None,
                    what: str = "the checkpoint") -> dict:
    """transformers' per-expert MoE weights (`mlp.experts.<i>.<proj>.weight`, which it saves
    for Qwen3.5-MoE) stacked as mlx-lm's `mlp.switch_mlp.<proj>.weight` [E, out, in]; the
    fused layouts of the Hub's checkpoints pass through for mlx-lm's own `sanitize`.
    num_experts: where given, each projection must have experts 0..num_experts-1."""
    pattern = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups, out = {}, {}
    for k, v in weights.items():
        m = pattern.match(k)
        if m:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = v
        else:
            out[k] = v
    for (prefix, proj), experts in groups.items():
        ids = sorted(experts)
        if num_experts is not None and ids != list(range(num_experts)):
            raise EagleError(f"{what}'s {prefix}.experts.*.{proj} has experts {ids[:4]}..., "
                             f"not 0..{num_experts - 1}.")
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([experts[i] for i in ids])
    return out


def gpt_oss_float_experts(weights: dict) -> dict:
    """transformers' float gpt-oss experts (x @ gate_up_proj [E, H, 2I], gate and up
    interleaved on the last axis; x @ down_proj [E, I, H]) as mlx-lm's SwitchGLU weights
    ([E, out, in]); everything else as given."""
    out = {}
    for k, v in weights.items():
        head, _, name = k.rpartition(".experts.")
        if not head or v.ndim not in (2, 3) or not mx.issubdtype(v.dtype, mx.floating):
            out[k] = v
        elif name == "gate_up_proj" and v.ndim == 3:
            out[f"{head}.experts.gate_proj.weight"] = mx.contiguous(v[..., ::2].swapaxes(1, 2))
            out[f"{head}.experts.up_proj.weight"] = mx.contiguous(v[..., 1::2].swapaxes(1, 2))
        elif name == "gate_up_proj_bias":
            out[f"{head}.experts.gate_proj.bias"] = mx.contiguous(v[..., ::2])
            out[f"{head}.experts.up_proj.bias"] = mx.contiguous(v[..., 1::2])
        elif name == "down_proj" and v.ndim == 3:
            out[f"{head}.experts.down_proj.weight"] = mx.contiguous(v.swapaxes(1, 2))
        elif name == "down_proj_bias":
            out[f"{head}.experts.down_proj.bias"] = v
        else:
            out[k] = v
    return out


def check_config(config: dict, path: Path) -> None:
    """What the tree forward supports, refused in one sentence before any weight is read."""
    where = path / "config.json"
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise EagleError(
            f"model type '{model_type}' in {where} is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    text = config.get("text_config") if model_type in ("gemma3", "gemma4", "gemma4_unified",
                                                       "mistral3") else None
    if model_type == "gemma4_unified" and (text or {}).get("use_bidirectional_attention") == "all":
        raise EagleError(f"{where}: its language model attends bidirectionally over all tokens "
                         "(use_bidirectional_attention \"all\"), which decoding does not.")
    if model_type == "mistral3":
        inner = (text or {}).get("model_type")
        if inner not in ("ministral3", "mistral", "llama"):
            raise EagleError(f"{where}: the language model of this mistral3 checkpoint is "
                             f"'{inner}'; supported: ministral3, mistral, llama.")
    if model_type == "llama" and (config.get("use_sliding_window") or config.get("sliding_window")
                                  or "sliding_attention" in (config.get("layer_types") or ())):
        raise EagleError(f"{where} asks for sliding-window attention, which Llama models do not "
                         "have (transformers ignores it); remove use_sliding_window / "
                         "sliding_window / layer_types.")
    if model_type in ("gemma3_text", "gemma3") and \
            (text or config).get("attn_logit_softcapping") is not None:
        raise EagleError(f"{where} soft-caps the attention logits (attn_logit_softcapping), "
                         "which mlx-lm's Gemma 3 does not; set it to null.")
    quant = config.get("quantization") or {}
    mode = quant.get("mode", "affine") if isinstance(quant, dict) else "affine"
    if mode not in QUANTIZATION_MODES:
        raise EagleError(f"{where}: unknown quantization mode '{mode}'; MLX reads "
                         f"{', '.join(QUANTIZATION_MODES)}.")


def _rope_overrides(config: dict) -> dict:
    """transformers >= 5 saves RoPE settings as `rope_parameters`; mlx-lm reads the
    classic `rope_theta` / `rope_scaling` keys, so translate the new form."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" in config:
        return {}
    params = dict(params)
    overrides = {"rope_theta": params.pop("rope_theta", 10000.0)}
    if params.get("rope_type", "default") != "default":
        overrides["rope_scaling"] = params
    return overrides


def resolve_dtype(dtype: Optional[str]) -> Optional[mx.Dtype]:
    """The float dtype a target is converted to at load time (None: as stored).

    "auto" is float32 on the CPU, where MLX's quantized and half-precision matmuls are
    scalar code and float32 goes through BLAS, and "stored" on a GPU (Metal), where
    quantized weights are the fast path."""
    dtype = "auto" if dtype is None else dtype
    if dtype not in DTYPE_CHOICES:
        raise EagleError(f"dtype must be one of {', '.join(DTYPE_CHOICES)} (got {dtype!r}).")
    if dtype == "auto":
        dtype = "float32" if mx.default_device() == mx.cpu else "stored"
    return None if dtype == "stored" else getattr(mx, dtype)


def convert_dtype(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """Dequantize every quantized layer (in float32, exactly) and cast the float weights.

    mlx-lm's own `dequantize_model` does the dequantizing, so every quantized class it knows
    (linear, embedding, and the experts' `QuantizedSwitchLinear` of MoE models) comes back as
    its float twin; their scales and biases are first taken to float32, so that the
    dequantized weights are exact before the cast."""
    quantized = [name for name, m in model.named_modules() if hasattr(m, "scales")]
    if quantized:
        params = dict(tree_flatten(model.parameters()))
        model.update(tree_unflatten([  # (MX/NV floating-point modes: integer scales, as stored)
            (k, v.astype(mx.float32)) for k, v in params.items()
            if k.rsplit(".", 1)[0] in quantized and k.rsplit(".", 1)[-1] in ("scales", "biases")
            and mx.issubdtype(v.dtype, mx.floating)]))
        model = mlxlm.dequantize_model(model)
    model.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
                          model.parameters()))
    return model


def load_target(path_or_repo: str, lazy: bool = False, dtype: Optional[str] = None,
                group=None):
    """Load a target (see SUPPORTED_MODEL_TYPES) and its tokenizer from a folder, a Hub repo id or a
    GGUF file (or a folder holding one).

    dtype: "auto" (None), "stored", "float32", "float16" or "bfloat16"; see
    `resolve_dtype`. group: an `mx.distributed` group of more than one rank: the target is
    sharded over it (tensor parallel) and this rank materialises only its shard.
    Returns (Target, mlx-lm TokenizerWrapper).
    """
    if not isinstance(path_or_repo, (str, Path)):
        raise EagleError(f"the target must be a folder, a Hugging Face repo id or a GGUF file, "
                         f"given as a string (got {type(path_or_repo).__name__}).")
    convert_to = resolve_dtype(dtype)
    local = Path(str(path_or_repo)).expanduser()
    gguf_file = find_gguf(local) if local.exists() else None
    if gguf_file is not None:
        path = gguf_file
        # a target converted to floats takes every tensor's exact values
        model, config, tokenizer = load_gguf(gguf_file, requantize=convert_to is None)
    else:
        # not a repo's original/ checkpoints
        path = resolve(path_or_repo, "model", allow_patterns=mlxlm.DEFAULT_ALLOW_PATTERNS)
        model, config, tokenizer = _load_mlx_lm(path, lazy or group is not None)
    if convert_to is not None:
        model = convert_dtype(model, convert_to)
    if group is not None:
        shard(model, config, group, path)
    if not lazy:
        mx.eval(model.parameters())
    return Target(model, config, path), tokenizer


def _load_mlx_lm(path: Path, lazy: bool):

    config = read_config(path)
    check_config(config, path)
    _check_weight_files(path)
    try:
        model, config = mlxlm.load_model(path, lazy=lazy,
                                         model_config=_config_overrides(config, path),
                                   get_model_classes=_model_classes)
    except Exception as e:  # mlx-lm raises ValueError/KeyError/RuntimeError on bad weights
        raise EagleError(f"could not load the weights in {path}: {reason(e)}") from None
    try:
        tokenizer = mlxlm.load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        raise EagleError(f"could not load the tokenizer in {path}: {reason(e)}") from None
    return model, config, tokenizer


def shard(model, config: dict, g: mx.distributed.Group, path) -> None:
    """Split the target's decoder layers across the group (mlx-lm's own sharding)."""
    n = g.size()
    if not hasattr(model, "shard"):
        raise EagleError(f"mlx-lm cannot shard {config.get('model_type')} models ({path}) "
                         "across machines; it shards Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, "
                         "gpt-oss, Ministral 3 and Qwen3.5 (dense and MoE).")
    text = text_config(config)
    heads = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or heads
    inter = text.get("intermediate_size") or 0
    for what, v in (("attention heads", heads), ("key/value heads", kv),
                    ("MLP columns", inter)):
        if v % n:
            raise EagleError(f"{path} has {v} {what}, which do not split evenly over {n} ranks.")
    model.shard(g)
