"""The layouts EAGLE heads are published in, read into one form.

* official (yuhuili) EAGLE-1: `fc` (2H -> H, biased), `layers.0.*` without an input norm;
* official EAGLE-3 and SpecForge (`LlamaForCausalLMEagle3`, flat config, `midlayer.*`,
  `d2t` offsets, `t2d` mask; SpecForge adds `eagle_config.eagle_aux_hidden_state_layer_ids`
  and `target_model_type`);
* vLLM speculators (`speculators_model_type: "eagle3"`, a nested `transformer_layer_config`,
  `layers.N.*`, flags for its variants);
* NVIDIA Model-Optimizer (`LlamaForCausalLMEagle3` with a nested `eagle_config` of its own
  keys, `layers.N.*`, no `t2d`, no embedding).

`translate` gives the config in the official key names (`hidden_size`, ...) with the
EAGLE-3 variants under "eagle3_options" (`heads.HeadArgs`), the tensors in the official
names (first layer `midlayer.*`, further layers `extra_layers.N.*`), the layout's name and
the target family the head says it was made for (None where it does not say).

Which layer a tap id names differs by producer: speculators (and vLLM) count the hidden
state *entering* layer id, as this project does (`Target.__call__`'s taps); SpecForge (and
SGLang, which adds 1) and Model-Optimizer (a hook on layer id's output) count the state
*leaving* layer id, i.e. entering id + 1. Each is read by its own rule.
"""

from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx

from ..errors import EagleError, is_int

# keys a speculators eagle3 config may hold besides the flags this head honours
_SPECULATORS_META = {
    "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version",
    "speculators_version", "speculators_config", "speculators_model_type",
    "transformer_layer_config", "has_no_defaults_at_init", "embed_requires_grad",
    "tie_word_embeddings", "_name_or_path", "name_or_path",
}
_SPECULATORS_FLAGS = {"draft_vocab_size", "norm_before_residual", "target_hidden_size",
                      "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm",
                      "norm_output"}
_LAYER_TYPES = ("llama", "qwen3")  # speculators' eagle3 layer classes

# Model-Optimizer's eagle_config keys, and the values this head reads them at
_MODELOPT_KEYS = {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state",
                  "use_input_layernorm_in_first_layer", "use_last_layernorm",
                  "use_mtp_layernorm", "next_layer_regular", "parallel_draft_step",
                  "parallel_draft_heads_num_layers"}


def family_name(name: Optional[str]) -> Optional[str]:
    """A model family from a model_type or an architecture class name, in one spelling:
    "Qwen3MoeForCausalLM" and "qwen3_moe" -> "qwen3moe"; "gemma3_text" -> "gemma3"."""
    if not isinstance(name, str) or not name:
        return None
    s = name.lower()
    for suffix in ("forcausallmeagle3", "forcausallm", "forconditionalgeneration", "model"):
        if s.endswith(suffix):
            s = s[: -len(suffix)]
    s = s.replace("_", "").replace("-", "")
    return s[: -len("text")] if s.endswith("text") else s


def _where(path: Path) -> Path:
    return path / "config.json"


def _rope(tl: dict) -> Tuple[float, Optional[dict]]:
    """rope_theta and rope_scaling from a transformers 4 or 5 config."""
    params = tl.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
        return params["rope_theta"], scaling
    return tl.get("rope_theta", 10000.0), tl.get("rope_scaling")


def _layer_config(tl: dict, path: Path, what: str) -> dict:
    """The official head config keys from a decoder-layer config (HF style)."""
    where = _where(path)
    if tl.get("mlp_bias"):
        raise EagleError(f"{where}: {what} has mlp_bias true, which no EAGLE head has and this "
                         "head does not take.")
    act = tl.get("hidden_act", "silu")
    if act != "silu":
        raise EagleError(f"{where}: {what} uses the {act!r} activation; EAGLE heads here run "
                         "SiLU-gated MLPs.")
    theta, scaling = _rope(tl)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "rms_norm_eps", "max_position_embeddings", "head_dim")
    out = {k: tl[k] for k in keys if tl.get(k) is not None}
    out.update(rope_theta=theta, rope_scaling=scaling,
               qkv_bias=bool(tl.get("attention_bias", False)), layer_type=tl.get("model_type"))
    if out["qkv_bias"]:
        out["o_bias"] = True  # a Llama/Qwen3 layer's attention_bias biases o_proj too
    return out


def _rename_layers(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """layers.0.* -> midlayer.*, layers.N.* -> extra_layers.(N-1).*"""
    out = {}
    for k, v in weights.items():
        if k.startswith("layers."):
            _, n, rest = k.split(".", 2)
            k = f"midlayer.{rest}" if n == "0" else f"extra_layers.{int(n) - 1}.{rest}"
        out[k] = v
    return out


def _layers_in(weights) -> int:
    return 1 + len({k.split(".")[1] for k in weights if k.startswith("extra_layers.")})


def _aux(ids, path: Path, key: str, shift: int) -> Optional[list]:
    if ids is None or ids == []:
        return None
    if not (isinstance(ids, list) and all(is_int(i) and i >= 0 for i in ids)
            and len(set(ids)) == len(ids)):
        raise EagleError(f"{_where(path)}: \"{key}\" must be a list of distinct layer numbers "
                         f"(got {ids!r}).")
    return [i + shift for i in ids]


def _sliding(tl: dict, n_layers: int, path: Path) -> dict:
    types = tl.get("layer_types")
    if not types or "sliding_attention" not in types:
        return {}
    if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise EagleError(f"{_where(path)}: layer_types must name full_attention or "
                         f"sliding_attention for each of the {n_layers} draft layers "
                         f"(got {types!r}).")
    window = tl.get("sliding_window")
    if not (isinstance(window, int) and window > 0):
        raise EagleError(f"{_where(path)}: sliding draft layers need a positive sliding_window "
                         f"(got {window!r}).")
    return {"layer_types": list(types), "sliding_window": window}


def _speculators(config: dict, weights, path: Path):
    where = _where(path)
    kind = config.get("speculators_model_type")
    if kind != "eagle3":
        raise EagleError(f"{where} is a speculators {kind!r} model; the heads this tool drafts "
                         "with are speculators' eagle3 ones.")
    unknown = sorted(set(config) - _SPECULATORS_META - _SPECULATORS_FLAGS)
    if unknown:
        raise EagleError(f"{where}: the speculators eagle3 setting \"{unknown[0]}\" is not one "
                         "this head knows, so it cannot draft as that head was trained.")
    tl = config.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise EagleError(f"{where}: \"transformer_layer_config\" must be an object.")
    tl_type = tl.get("model_type", "qwen3")
    if tl_type not in _LAYER_TYPES:
        raise EagleError(f"{where}: transformer_layer_config model_type {tl_type!r} is not a "
                         f"layer speculators' eagle3 builds ({', '.join(_LAYER_TYPES)}).")
    flags = {k: config.get(k, False) for k in ("norm_before_residual", "norm_before_fc",
                                                "fc_norm", "norm_output")}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise EagleError(f"{where}: \"{k}\" must be true or false (got {v!r}).")
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise EagleError(f"{where}: norm_before_fc and fc_norm exclude each other.")
    out = _layer_config(tl, path, "transformer_layer_config")
    n_layers = tl.get("num_hidden_layers", 1)
    out.update(draft_vocab_size=config.get("draft_vocab_size", 32000),
               target_hidden_size=config.get("target_hidden_size"))
    out["eagle3_options"] = dict(
        flags, aux_layers=_aux(config.get("eagle_aux_hidden_state_layer_ids"), path,
                               "eagle_aux_hidden_state_layer_ids", 0),
        num_layers=n_layers, qk_norm=tl_type == "qwen3", **_sliding(tl, n_layers, path))
    weights = {k: v for k, v in weights.items() if not k.startswith("verifier_")}
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    archs = verifier.get("architectures") or []
    return out, _rename_layers(weights), "vLLM speculators eagle3", \
        (archs[0] if archs else None)


def _modelopt(config: dict, weights, path: Path):
    where = _where(path)
    ec = config.get("eagle_config") or {}
    if not isinstance(ec, dict):
        raise EagleError(f"{where}: \"eagle_config\" must be an object.")
    archs = config.get("architectures") or []
    if archs and archs[0] != "LlamaForCausalLMEagle3":
        raise EagleError(f"{where}: {archs[0]} heads (Model-Optimizer's Kimi-K2 MLA drafts and "
                         "others) are not Llama-shaped EAGLE-3 heads, which are the ones this "
                         "tool drafts with.")
    unknown = sorted(set(ec) - _MODELOPT_KEYS)
    if unknown:
        raise EagleError(f"{where}: the Model-Optimizer eagle_config setting \"{unknown[0]}\" is "
                         "not one this head knows.")
    refuse = [("use_aux_hidden_state", False, "an EAGLE-1-style Model-Optimizer head (no fc over "
               "target taps)"),
              ("use_mtp_layernorm", True, "Model-Optimizer's MTP-style layer norms"),
              ("use_input_layernorm_in_first_layer", False, "a first layer without its "
               "embedding norm"),
              ("next_layer_regular", False, "irregular further layers")]
    for key, bad, what in refuse:
        if key in ec and ec[key] is not None and bool(ec[key]) == bad:
            raise EagleError(f"{where}: {key} {str(ec[key]).lower()} makes {what}, which this "
                             "head does not run.")
    if (ec.get("parallel_draft_step") or 1) > 1:
        raise EagleError(f"{where}: parallel_draft_step {ec['parallel_draft_step']} adds "
                         "parallel draft heads, which this head does not run.")
    out = _layer_config(config, path, "the head config")
    out["draft_vocab_size"] = config.get("draft_vocab_size") or config["vocab_size"]
    weights = _rename_layers(weights)
    n_layers = config.get("num_hidden_layers") or _layers_in(weights)
    out["eagle3_options"] = dict(
        aux_layers=_aux(ec.get("eagle_aux_hidden_state_layer_ids"), path,
                        "eagle_config.eagle_aux_hidden_state_layer_ids", 1),
        num_layers=n_layers, final_norm=ec.get("use_last_layernorm", True) is not False
        and "norm.weight" in weights, **_sliding(config, n_layers, path))
    return out, weights, "NVIDIA Model-Optimizer EAGLE-3", None


def _specforge(config: dict, weights, path: Path):
    """Official EAGLE-3 and SpecForge: the official key names already."""
    where = _where(path)
    archs = config.get("architectures") or []
    if any(a != "LlamaForCausalLMEagle3" and "Eagle3" in a for a in archs):
        raise EagleError(f"{where}: {archs[0]} heads are not Llama-shaped EAGLE-3 heads, which "
                         "are the ones this tool drafts with.")
    ec = config.get("eagle_config") or {}
    if not isinstance(ec, dict):
        raise EagleError(f"{where}: \"eagle_config\" must be an object.")
    out = {k: v for k, v in config.items() if k not in ("eagle_config",)}
    aux = _aux(ec.get("eagle_aux_hidden_state_layer_ids"), path,
               "eagle_config.eagle_aux_hidden_state_layer_ids", 1)
    n_layers = config.get("num_hidden_layers", 1)
    if n_layers not in (None, 1):
        raise EagleError(f"{where}: num_hidden_layers {n_layers}: an official/SpecForge EAGLE-3 "
                         "head has the one midlayer.")
    options = dict(aux_layers=aux) if aux else {}
    if options:
        out["eagle3_options"] = options
    sf = bool(ec) or "target_model_type" in config
    return out, weights, "SpecForge EAGLE-3" if sf else "official EAGLE-3", \
        config.get("target_model_type")


def translate(config: dict, weights: Dict[str, mx.array], path: Path):
    """(config, weights, layout, made_for) in this project's form; see the module docstring."""
    if config.get("eagle") is not None:  # written by this project
        eagle = config["eagle"] if isinstance(config["eagle"], dict) else {}
        return config, weights, eagle.get("layout", "eagle_mlx"), eagle.get("made_for")
    if "speculators_model_type" in config:
        return _speculators(config, weights, path)
    if "layers.0.hidden_norm.weight" in weights:  # an EAGLE-3 first layer named layers.0
        return _modelopt(config, weights, path)
    if "midlayer.self_attn.q_proj.weight" in weights:
        return _specforge(config, weights, path)
    return config, weights, "official EAGLE-1", None
