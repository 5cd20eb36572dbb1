"""Tree-capable targets: mlx-lm's Llama, Mistral, Mixtral, Qwen2, Qwen3 and Qwen3-MoE models,
verified a whole tree at a time.

mlx-lm builds and loads the model (HF folders, sharded and mlx-community checkpoints,
quantized weights, the tokenizer with its chat template). `Target` runs the same
modules with what verification needs and mlx-lm's forward lacks: per-token position
ids, an explicit mask over cache + new tokens, the post-norm hidden state (EAGLE-1/2
features) and the inputs of chosen decoder layers (EAGLE-3 features).
"""

import glob
import json
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .cache import TreeKVCache
from .errors import EagleError, reason
from .gguf import find_gguf, load_gguf
from .hub import resolve
from .layers import attention
from .values import DTYPE_CHOICES

# mlx-lm decoders of the standard shape (norm -> attention with q/k/v/o and RoPE, optional
# q/k norms -> norm -> MLP or sparse MoE), each tested against transformers
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")


class AttentionMechanism:
    """The layer mechanism of a standard decoder layer (norm -> attention -> norm -> MLP or
    MoE): what it needs in a tree verify (per-token positions, the tree mask) and what its
    cache does after acceptance (keep the accepted rows). Other kinds of layer (sliding
    windows, recurrent state) bring their own mechanism with the same four methods."""

    def make_cache(self):
        return TreeKVCache()

    def __call__(self, target, layer, h, cache, positions, mask):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        r = attention(
            attn, attn.q_proj(x), attn.k_proj(x), attn.v_proj(x),
            target.n_heads, target.n_kv_heads, cache, positions, mask,
        )
        h = h + attn.o_proj(r)
        ffn = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
        return h + ffn(layer.post_attention_layernorm(h))

    def accept(self, cache, start: int, rows: mx.array) -> None:
        cache.keep(start, rows)

    def truncate(self, cache, length: int) -> None:
        cache.truncate(length)


ATTENTION = AttentionMechanism()


class Target:
    """A loaded mlx-lm model plus the tree forward pass."""

    def __init__(self, model: nn.Module, config: dict, path: Optional[Path] = None):
        self.model = model
        self.config = config
        self.path = path
        self.layers = model.layers
        self.num_layers = len(self.layers)
        self.hidden_size = config["hidden_size"]
        self.vocab_size = config["vocab_size"]
        self.model_type = config["model_type"]
        self.max_context = int(config.get("max_position_embeddings") or 4096)
        attn = self.layers[0].self_attn
        self.n_heads = getattr(attn, "n_heads", None) or attn.num_heads
        self.n_kv_heads = getattr(attn, "n_kv_heads", None) or attn.num_key_value_heads
        self.mechanisms = [ATTENTION] * self.num_layers  # one per decoder layer

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.model.embed_tokens

    @property
    def dtype(self) -> mx.Dtype:
        return self.model.model.norm.weight.dtype

    @property
    def eagle3_taps(self) -> Tuple[int, ...]:
        """Decoder layers whose inputs feed an EAGLE-3 head: low, middle, high."""
        L = self.num_layers
        return tuple(sorted({2, L // 2, L - 3}))

    def make_cache(self) -> list:
        return [m.make_cache() for m in self.mechanisms]

    def accept(self, caches, start: int, rows: mx.array) -> None:
        """After a verify pass: every layer keeps the accepted tree rows `rows` (absolute
        positions, root first) at start.."""
        for m, c in zip(self.mechanisms, caches):
            m.accept(c, start, rows)

    def truncate(self, caches, length: int) -> None:
        """Every layer forgets what follows the first `length` positions."""
        for m, c in zip(self.mechanisms, caches):
            m.truncate(c, length)

    @staticmethod
    def cache_arrays(caches) -> list:
        return [a for c in caches for a in c.arrays()]

    def lm_head(self, hidden: mx.array) -> mx.array:
        if hasattr(self.model, "lm_head"):
            return self.model.lm_head(hidden)
        return self.embed_tokens.as_linear(hidden)

    def __call__(
        self,
        tokens: mx.array,
        cache: Optional[Sequence[TreeKVCache]] = None,
        positions: Optional[mx.array] = None,
        mask=None,
        taps: Sequence[int] = (),
    ) -> Tuple[mx.array, List[mx.array]]:
        """Run `tokens` [B, T] after what `cache` holds.

        positions: [T] position ids (default: cache length + 0..T-1).
        mask: boolean [T, cache length + T], True where a token may attend
              (default: causal). A tree passes its ancestor mask here.
        taps: decoder layers whose *input* hidden states to return (EAGLE-3).
        Returns the final hidden state after the last RMSNorm [B, T, H] and the
        tapped states in the order of `taps`; logits are `lm_head(hidden)`.
        """
        h = self.embed_tokens(tokens)
        cache = cache if cache is not None else [None] * self.num_layers
        tapped = {}
        for i, (mech, layer, c) in enumerate(zip(self.mechanisms, self.layers, cache)):
            if i in taps:
                tapped[i] = h
            h = mech(self, layer, h, c, positions, mask)
        return self.model.model.norm(h), [tapped[i] for i in taps]


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


def _config_overrides(config: dict) -> dict:
    """Config keys that transformers >= 5 writes under new names, translated back to the
    names mlx-lm reads (the Hub's own configs use the classic names)."""
    overrides = _rope_overrides(config)
    if config.get("model_type") == "qwen3_moe" and "num_experts" not in config \
            and "num_local_experts" in config:
        overrides["num_experts"] = config["num_local_experts"]
    return overrides


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
    from mlx.utils import tree_flatten, tree_map, tree_unflatten

    from . import mlxlm

    quantized = [name for name, m in model.named_modules() if hasattr(m, "scales")]
    if quantized:
        params = dict(tree_flatten(model.parameters()))
        model.update(tree_unflatten([
            (k, v.astype(mx.float32)) for k, v in params.items()
            if k.rsplit(".", 1)[0] in quantized and k.rsplit(".", 1)[-1] in ("scales", "biases")]))
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
        model, config, tokenizer = load_gguf(gguf_file)
    else:
        from . import mlxlm

        # not a repo's original/ checkpoints
        path = resolve(path_or_repo, "model", allow_patterns=mlxlm.DEFAULT_ALLOW_PATTERNS)
        model, config, tokenizer = _load_mlx_lm(path, lazy or group is not None)
    if convert_to is not None:
        model = convert_dtype(model, convert_to)
    if group is not None:
        from .distributed import shard

        shard(model, config, group, path)
    if not lazy:
        mx.eval(model.parameters())
    return Target(model, config, path), tokenizer


def _load_mlx_lm(path: Path, lazy: bool):
    from .mlxlm import load_model, load_tokenizer

    config = read_config(path)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise EagleError(
            f"model type '{model_type}' in {path / 'config.json'} is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    if config.get("use_sliding_window"):
        raise EagleError(
            f"{path / 'config.json'} asks for sliding-window attention (use_sliding_window), "
            "which the tree forward does not implement; set it to false to attend to the whole "
            "context."
        )
    _check_weight_files(path)
    try:
        model, config = load_model(path, lazy=lazy, model_config=_config_overrides(config))
    except Exception as e:  # mlx-lm raises ValueError/KeyError/RuntimeError on bad weights
        raise EagleError(f"could not load the weights in {path}: {reason(e)}") from None
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        raise EagleError(f"could not load the tokenizer in {path}: {reason(e)}") from None
    return model, config, tokenizer
