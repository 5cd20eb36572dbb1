"""Tree-capable targets: mlx-lm's models of the families in SUPPORTED_MODEL_TYPES, verified
a whole tree at a time.

mlx-lm builds and loads the model (HF folders, sharded and mlx-community checkpoints,
quantized weights, the tokenizer with its chat template). `Target` runs the same
modules with what verification needs and mlx-lm's forward lacks: per-token position
ids, an explicit mask over cache + new tokens (each sliding-window layer: within its
window), the post-norm hidden state (EAGLE-1/2 features) and the inputs of chosen decoder
layers (EAGLE-3 features). How each family runs its layers: `families.py`.
"""

import glob
import json
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .cache import RaggedKVCache, TreeKVCache
from .errors import EagleError, reason
from .families import FAMILIES, AttentionMechanism, Forward, LinearAttentionMechanism, \
    RopeContext, family_of, install_positions, untruncated_yarn
from .gguf import find_gguf, load_gguf
from .hub import resolve
from .values import DTYPE_CHOICES

# mlx-lm decoders whose tree forward is tested against transformers: the standard shape
# (norm -> attention with q/k/v/o and RoPE, optional q/k norms -> norm -> MLP or sparse
# MoE) and the sliding-window / attention-sink families
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
QUANTIZATION_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")  # what mx.dequantize reads

ATTENTION = AttentionMechanism()


TREE_STATE_FRACTION = 8  # a tree's recurrent states may take 1/8 of the machine's memory


def machine_memory() -> int:
    """Bytes of memory the device has (a GPU's working set where MLX reports one)."""
    import os

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    size = info.get("max_recommended_working_set_size") or info.get("memory_size")
    return int(size or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def tree_state_budget() -> int:
    return machine_memory() // TREE_STATE_FRACTION


class TargetLM:
    """The target's own forward as an mlx-lm model (`model(inputs, cache=...)` -> logits),
    for plain decoding where mlx-lm's forward lacks what the config asks for."""

    def __init__(self, target: "Target"):
        self.target = target

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        hidden, _ = self.target(inputs, cache)
        return self.target.lm_head(hidden)


class Target:
    """A loaded mlx-lm model plus the tree forward pass."""

    def __init__(self, model: nn.Module, config: dict, path: Optional[Path] = None):
        self.model = model
        self.config = config
        self.path = path
        self.family = family_of(model, config)
        text = self.family.text_config()
        self.layers = self.family.inner.layers
        self.num_layers = len(self.layers)
        self.hidden_size = text["hidden_size"]
        emb = self.embed_tokens
        self.vocab_size = getattr(emb, "num_embeddings", None) or emb.weight.shape[0]
        self.model_type = config["model_type"]
        self.max_context = int(text.get("max_position_embeddings")
                               or config.get("max_position_embeddings") or 4096)
        attn = getattr(self.layers[0], "self_attn", None)  # (the standard decoders' heads)
        self.n_heads = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None) \
            or getattr(attn, "num_attention_heads", None)
        self.n_kv_heads = getattr(attn, "n_kv_heads", None) \
            or getattr(attn, "num_key_value_heads", None)
        self.windows = self.family.windows()
        self.mechanisms = self.family.mechanisms(ATTENTION)
        self._rope = RopeContext()
        untruncated_yarn(self.family)
        install_positions(self.family, self._rope)

    @property
    def embed_tokens(self) -> nn.Module:
        return self.family.inner.embed_tokens

    @property
    def dtype(self) -> mx.Dtype:
        return self.family.inner.norm.weight.dtype

    @property
    def eagle3_taps(self) -> Tuple[int, ...]:
        """Decoder layers whose inputs feed an EAGLE-3 head: low, middle, high."""
        L = self.num_layers
        return tuple(sorted({2, L // 2, L - 3}))

    @property
    def plain_model(self):
        """What plain decoding runs: mlx-lm's own model where its forward computes what the
        config says, else the tree forward of this target (one token at a time)."""
        return self.model if self.family.mlx_lm_exact(self.windows) else TargetLM(self)

    @property
    def node_state_bytes(self) -> int:
        """Bytes a tree node costs in recurrent state: every linear-attention layer keeps
        each node's [heads, d_v, d_k] float32 state (and its projected row) until the
        acceptance picks one. 0 for attention-only targets (a node's keys and values are
        a few KB there)."""
        total = 0
        for m, layer in zip(self.mechanisms, self.layers):
            if isinstance(m, LinearAttentionMechanism):
                a = layer.linear_attn
                total += a.num_v_heads * a.head_v_dim * a.head_k_dim * 4 + \
                    a.conv_dim * self.dtype.size
        return total

    def tree_node_limit(self) -> Optional[int]:
        """The most tree nodes whose recurrent states fit in TREE_STATE_FRACTION of this
        machine's memory (None: no bound, attention-only)."""
        per_node = self.node_state_bytes
        return None if not per_node else max(2, tree_state_budget() // per_node)

    def make_cache(self) -> list:
        """One cache per layer that keeps one (KV-shared layers read another's)."""
        return [m.make_cache() for m in self.mechanisms if m.source is None]

    def accept(self, caches, start: int, rows: mx.array) -> None:
        """After a verify pass: every layer keeps the accepted tree rows `rows` (absolute
        positions, root first) at start.."""
        for m, c in zip(self.mechanisms, caches):
            m.accept(c, start, rows)

    def reusable(self, caches, length: int) -> bool:
        """Whether every layer can be cut back to its first `length` positions exactly (a
        sliding-window layer has dropped what its window no longer sees)."""
        return all(m.reusable(c, length) for m, c in zip(self.mechanisms, caches))

    def truncate(self, caches, length: int) -> None:
        """Every layer forgets what follows the first `length` positions."""
        for m, c in zip(self.mechanisms, caches):
            m.truncate(c, length)

    # ---------------------------------------------------------------- batches
    def make_batch_cache(self) -> list:
        """Per layer (as `make_cache`), the cache of a batch of sequences: rows join from a
        sequence's own caches (`batch_join`) and leave (`batch_filter`) between cycles."""
        return [m.make_batch_cache() for m in self.mechanisms if m.source is None]

    @staticmethod
    def batch_join(batch, caches) -> None:
        """Add a sequence (its own caches after its prefill) as the batch's last row."""
        for bc, c in zip(batch, caches):
            bc.extend(c)

    def batch_extract(self, batch, b: int, length: int) -> list:
        """Row b of a batch (holding `length` positions) as a sequence's own caches."""
        kept = [m for m in self.mechanisms if m.source is None]
        return [bc.extract(b, m.window) if isinstance(bc, RaggedKVCache) else
                bc.extract(b, length) for m, bc in zip(kept, batch)]

    @staticmethod
    def batch_filter(batch, rows) -> None:
        for bc in batch:
            bc.filter(rows)

    @staticmethod
    def batch_accept(batch, kept) -> None:
        """After a batch verify: row b keeps its accepted tree nodes kept[b] (indices in its
        tree, root first)."""
        for bc in batch:
            bc.commit(kept)

    def verify_batch(self, tokens: mx.array, batch, lengths, positions: mx.array,
                     tree: mx.array, taps: Sequence[int] = (),
                     max_depth: Optional[int] = None) -> Tuple[mx.array, List[mx.array]]:
        """A tree per row, after what each row holds: tokens, positions [B, T] (row b's
        nodes at lengths[b] + depth), tree [B, T, T] each row's ancestor-or-self mask
        (padding nodes see themselves). Returns as `__call__`, for every row."""
        fwd = Forward(tokens.shape[1], list(lengths), positions, None, tree=tree)
        if max_depth is not None:
            fwd.max_depth = max_depth
        return self._run(tokens, batch, fwd, taps)

    @staticmethod
    def cache_arrays(caches) -> list:
        return [a for c in caches for a in c.arrays()]

    def lm_head(self, hidden: mx.array) -> mx.array:
        return self.family.logits(hidden)

    def __call__(
        self,
        tokens: mx.array,
        cache: Optional[Sequence[TreeKVCache]] = None,
        positions: Optional[mx.array] = None,
        mask=None,
        taps: Sequence[int] = (),
        max_depth: Optional[int] = None,
    ) -> Tuple[mx.array, List[mx.array]]:
        """Run `tokens` [B, T] after what `cache` holds.

        positions: [T] position ids (default: cache length + 0..T-1).
        mask: boolean [T, cache length + T], True where a token may attend
              (default: causal). A tree passes its ancestor mask here; each
              sliding-window layer narrows it to its window.
        taps: decoder layers whose *input* hidden states to return (EAGLE-3); L (the
              number of layers) is the last layer's output, before the final norm.
        max_depth: a bound on the tree's depth below the root (recurrent layers scan
              that many levels and the root's; default T - 1).
        Returns the final hidden state after the last RMSNorm [B, T, H] and the
        tapped states in the order of `taps`; logits are `lm_head(hidden)`.
        """
        caches = list(cache) if cache is not None else []
        caches += [None] * (self.num_layers - len(caches))
        fwd = Forward(tokens.shape[1], caches[0].offset if caches[0] is not None else 0,
                      positions, mask)
        if max_depth is not None:
            fwd.max_depth = max_depth
        return self._run(tokens, caches, fwd, taps)

    def _run(self, tokens, caches, fwd: Forward, taps):
        caches = list(caches) + [None] * (self.num_layers - len(caches))
        positions, family, tapped = fwd.positions, self.family, {}
        self._rope.positions = positions
        try:
            h = family.embed(self, tokens, fwd)
            for i, (mech, layer, c) in enumerate(zip(self.mechanisms, self.layers, caches)):
                if i in taps:
                    tapped[i] = h
                h = family.layer(self, i, layer, h, c, mech.mask(fwd, c), fwd)
        finally:
            self._rope.positions = None
        tapped[self.num_layers] = h  # "the input of layer L": the last layer's output
        return family.inner.norm(h), [tapped[i] for i in taps]


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
        return _gemma4_overrides(config)
    if kind == "gemma4" and isinstance(config.get("text_config"), dict):
        return {"text_config": {**config["text_config"], **_gemma4_overrides(config["text_config"])}}
    if kind in ("ministral3", "mistral3"):
        return {}  # mlx-lm reads their rope_parameters itself
    if kind in HYBRID_TYPES:
        if isinstance(config.get("text_config"), dict):
            return {"text_config": {**config["text_config"],
                                    **_hybrid_overrides(config["text_config"], path)}}
        return _hybrid_overrides(config, path)
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


HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def _hybrid_overrides(text: dict, path: Path) -> dict:
    """Qwen3.5 / Qwen3-Next: transformers >= 5 writes `layer_types` (linear_attention /
    full_attention) instead of `full_attention_interval`, and Qwen3-Next's RoPE settings in
    `rope_parameters`; mlx-lm reads the interval and the classic keys."""
    from .mlxlm import TEXT_ONLY_TYPES

    kind = text.get("model_type")
    out = {"model_type": TEXT_ONLY_TYPES[kind]} if kind in TEXT_ONLY_TYPES else {}
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


def _gemma4_overrides(text: dict) -> dict:
    """Gemma 4: transformers >= 5 writes the full-attention layers' head size (and, with
    `attention_k_eq_v`, their key/value heads) in `per_layer_config`; mlx-lm reads
    `global_head_dim` and `num_global_key_value_heads`."""
    per_layer = text.get("per_layer_config")
    if not isinstance(per_layer, dict) or "global_head_dim" in text:
        return {}
    types = text.get("layer_types") or []
    full = [per_layer.get(str(i)) or per_layer.get(i) or {}
            for i, t in enumerate(types) if t == "full_attention"]
    out = {}
    if full and "head_dim" in full[0]:
        out["global_head_dim"] = full[0]["head_dim"]
    if full and "num_key_value_heads" in full[0]:
        out["num_global_key_value_heads"] = full[0]["num_key_value_heads"]
    return out


def _model_classes(config: dict):
    """mlx-lm's model class for a config, as its loader picks it; gpt-oss also reads the
    float layout transformers saves (its experts' fused [E, H, 2I] `gate_up_proj`), which
    mlx-lm's `sanitize` takes only in OpenAI's MXFP4 layout or already converted."""
    from .mlxlm import model_module

    module = model_module(config["model_type"])
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


def stacked_experts(weights: dict) -> dict:
    """transformers' per-expert MoE weights (`mlp.experts.<i>.<proj>.weight`, which it saves
    for Qwen3.5-MoE) stacked as mlx-lm's `mlp.switch_mlp.<proj>.weight` [E, out, in]; the
    fused layouts of the Hub's checkpoints pass through for mlx-lm's own `sanitize`."""
    import re

    pattern = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups, out = {}, {}
    for k, v in weights.items():
        m = pattern.match(k)
        if m:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = v
        else:
            out[k] = v
    for (prefix, proj), experts in groups.items():
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([experts[i] for i in sorted(experts)])
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
    text = config.get("text_config") if model_type in ("gemma3", "gemma4", "mistral3") else None
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
    from mlx.utils import tree_flatten, tree_map, tree_unflatten

    from . import mlxlm

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
    check_config(config, path)
    _check_weight_files(path)
    try:
        model, config = load_model(path, lazy=lazy, model_config=_config_overrides(config, path),
                                   get_model_classes=_model_classes)
    except Exception as e:  # mlx-lm raises ValueError/KeyError/RuntimeError on bad weights
        raise EagleError(f"could not load the weights in {path}: {reason(e)}") from None
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        raise EagleError(f"could not load the tokenizer in {path}: {reason(e)}") from None
    return model, config, tokenizer
