"""The one place the package reaches mlx-lm: every name it imports, and the few private
members of mlx-lm objects it touches.

mlx-lm builds, loads and runs the models; this module names what the package takes from it,
so the version contract lives in one file (pyproject's lower bound is the oldest mlx-lm the
suite passes with). Importing mlx-lm costs seconds, so each name is imported when first
used (`mlxlm.load_model`), not when this module is: a tool refuses a bad flag before that.

The imported names are public. Four private members are used where mlx-lm keeps inside a
model's own call what the tree forward must run itself; each is reached only through a
function below (listed in PRIVATE, with why), so that an mlx-lm upgrade that changes one
breaks here, and tests/test_boundary.py fails on a private access anywhere else.
"""

import importlib

# name -> the public mlx-lm module that defines it
_NAMES = {
    "ArraysCache": "mlx_lm.models.cache",
    "KVCache": "mlx_lm.models.cache",
    "QuantizedKVCache": "mlx_lm.models.cache",
    "RotatingKVCache": "mlx_lm.models.cache",
    "load_prompt_cache": "mlx_lm.models.cache",
    "save_prompt_cache": "mlx_lm.models.cache",
    "maybe_quantize_kv_cache": "mlx_lm.generate",
    "quantized_scaled_dot_product_attention": "mlx_lm.models.base",
    "make_prompt_cache": "mlx_lm.models.cache",
    "create_causal_mask": "mlx_lm.models.base",
    "DynamicNTKScalingRoPE": "mlx_lm.models.rope_utils",
    "initialize_rope": "mlx_lm.models.rope_utils",
    "YarnRoPE": "mlx_lm.models.rope_utils",
    "gated_delta_update": "mlx_lm.models.gated_delta",
    "normalize_qk": "mlx_lm.models.gated_delta",
    "apply_min_p": "mlx_lm.sample_utils",
    "apply_top_k": "mlx_lm.sample_utils",
    "apply_top_p": "mlx_lm.sample_utils",
    "generate_step": "mlx_lm.generate",
    "generation_stream": "mlx_lm.generate",
    "wired_limit": "mlx_lm.generate",
    "DEFAULT_ALLOW_PATTERNS": "mlx_lm.utils",
    "dequantize_model": "mlx_lm.utils",
    "MODEL_REMAPPING": "mlx_lm.utils",
    "load": "mlx_lm.utils",
    "load_model": "mlx_lm.utils",
    "load_tokenizer": "mlx_lm.utils",
    "quantize_model": "mlx_lm.utils",
    "save_config": "mlx_lm.utils",
    "save_model": "mlx_lm.utils",
    "BPEStreamingDetokenizer": "mlx_lm.tokenizer_utils",
    "SPMStreamingDetokenizer": "mlx_lm.tokenizer_utils",
    "TokenizerWrapper": "mlx_lm.tokenizer_utils",
}


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value
    return value


# transformers' text-only model types whose configs mlx-lm's multimodal modules read
TEXT_ONLY_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def model_module(model_type: str):
    """mlx-lm's module for a model type (`mlx_lm.models.<type>`: its Model and ModelArgs),
    through mlx-lm's own remapping (mistral is its llama module) and TEXT_ONLY_TYPES."""
    model_type = TEXT_ONLY_TYPES.get(model_type, model_type)
    model_type = __getattr__("MODEL_REMAPPING").get(model_type, model_type)
    return importlib.import_module(f"mlx_lm.models.{model_type}")


def convert(*args, **kwargs):
    """mlx-lm's own converter (`mlx_lm.convert`)."""
    return importlib.import_module("mlx_lm").convert(*args, **kwargs)


# private member -> why the package needs it (checked against mlx-lm 0.32.2)
PRIVATE = {
    "mlx_lm.models.ministral3._get_llama_4_attn_scale":
        "Ministral 3 scales queries by position inside its attention call; a tree verify "
        "passes per-node positions, so the scale is computed for them (`llama4_attn_scale`).",
    "gemma4_text.Gemma4TextModel._get_per_layer_inputs, ._project_per_layer_inputs":
        "Gemma 4's E-models add per-layer input embeddings inside the model call; the tree "
        "forward runs the layers one by one (`gemma4_per_layer_inputs`).",
    "mlx_lm.models.rope_utils.YarnRoPE._freqs":
        "mlx-lm's YaRN always rounds its correction range; configs with `truncate: false` "
        "(gpt-oss) need transformers' frequencies (`set_rope_freqs`).",
    "mlx_lm.tokenizer_utils.TokenizerWrapper._tokenizer":
        "the wrapped Hugging Face tokenizer's batch encoding, to count a draft vocabulary's "
        "tokens in thousands of answers (`batch_encoder`).",
}


def llama4_attn_scale():
    """Ministral 3's `_get_llama_4_attn_scale(T, offset, beta, length)`."""
    return model_module("ministral3")._get_llama_4_attn_scale


def gemma4_per_layer_inputs(inner, tokens, h):
    """Gemma 4's per-layer inputs [B, T, layers, D] for `tokens` embedded as `h`."""
    return inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(tokens))


def set_rope_freqs(rope, freqs) -> None:
    """Replace a YarnRoPE's frequencies."""
    rope._freqs = freqs


def batch_encoder(tokenizer):
    """The wrapped Hugging Face tokenizer where it encodes batches (called with a list of
    texts), else None."""
    fast = getattr(tokenizer, "_tokenizer", None)
    return fast if callable(fast) else None
