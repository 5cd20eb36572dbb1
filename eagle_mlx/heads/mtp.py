"""The MTP module a Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoint carries, as a draft head.

The module (`mtp.*` in the Hugging Face checkpoint) is an EAGLE-style head: at each
position it reads the target's post-norm hidden state and the embedding of the token that
follows, `fc(cat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)))`, runs one
full-attention decoder layer of the target's own kind (attention with its output gate,
query/key norms, partial RoPE; an MLP or the target's MoE), and a final norm; the target's
`lm_head` gives the logits. Deeper tree levels read the module's own (normed) output in
place of the target's hidden state, as vLLM and mlx-vlm drive it. RMSNorm weights are
stored zero-centred (1 + w) like the target's, and shifted here as mlx-lm shifts those.

mlx-lm's conversions drop `mtp.*`, so the module is read from the original checkpoint:
only the `mtp.*` tensors, from only the shards its safetensors index names (a Hub repo
downloads those files alone).
"""

import json
import re
import struct
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import mlxlm
from ..errors import EagleError
from ..tensorfiles import SAFETENSORS_DTYPES, safetensors_header
from ..targets.cache import HeadCache
from ..targets.load import hybrid_overrides, stacked_experts
from ..targets.families import HYBRID_TYPES, PositionedRoPE, RopeContext, text_config
from .base import DraftHead, HeadSource, check_weights

INDEX = "model.safetensors.index.json"
PREFIX = "mtp."
_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
          ".k_norm.weight")
_TOP_NORMS = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")



def is_mtp_config(config: dict) -> bool:
    """Whether a config is a model's own (one of the families whose checkpoints carry an
    MTP module), not an EAGLE head's."""
    return config.get("model_type") in HYBRID_TYPES and "eagle" not in config


def safetensors_keys(path: Path) -> List[str]:
    try:
        header, _ = safetensors_header(path)
    except (OSError, ValueError, struct.error) as e:
        raise EagleError(f"{path} is not a readable safetensors file ({e}).") from None
    return [k for k in header if k != "__metadata__"]


def read_tensors(path: Path, wanted) -> Dict[str, mx.array]:
    """The tensors of one safetensors file whose names `wanted(name)` accepts, reading only
    their bytes."""
    try:
        header, start = safetensors_header(path)
        out = {}
        with open(path, "rb") as f:
            for name, info in header.items():
                if name == "__metadata__" or not wanted(name):
                    continue
                if info["dtype"] not in SAFETENSORS_DTYPES:
                    raise EagleError(f"tensor {name} in {path} is stored as {info['dtype']}, "
                                     "which this reader does not take (a quantized checkpoint's "
                                     "MTP tensors: use the unquantized one).")
                a, b = info["data_offsets"]
                f.seek(start + a)
                arr = np.frombuffer(f.read(b - a), dtype=SAFETENSORS_DTYPES[info["dtype"]])
                arr = arr.reshape(info["shape"])
                x = mx.array(arr)
                out[name] = x.view(mx.bfloat16) if info["dtype"] == "BF16" else x
        return out
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise EagleError(f"{path} is not a readable safetensors file ({e}).") from None


def mtp_shards(folder: Path) -> Optional[List[str]]:
    """The checkpoint files that hold `mtp.*` tensors, by the safetensors index (None
    without an index)."""
    index = folder / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EagleError(f"{index} is not a safetensors index ({e}).") from None
    return sorted({f for k, f in weight_map.items() if k.startswith(PREFIX)})


def read_mtp_weights(folder: Path, shards: Optional[Iterable[str]] = None) -> Dict[str, mx.array]:
    """The `mtp.*` tensors of a checkpoint folder, their prefix removed, from the shards the
    index names (or the one model.safetensors)."""
    if shards is None:
        shards = mtp_shards(folder)
    if shards is None:
        single = folder / "model.safetensors"
        shards = ["model.safetensors"] if single.is_file() else []
    weights = {}
    for shard in shards:
        path = folder / shard
        if not path.is_file():
            raise EagleError(f"{folder / INDEX} names {shard}, which {folder} lacks.")
        weights.update(read_tensors(path, lambda k: k.startswith(PREFIX)))
    if not weights:
        raise EagleError(
            f"checkpoint {folder} has no mtp.* tensors, so it carries no MTP module to draft "
            "with (mlx-lm's conversions drop it: point the head at the original Hugging Face "
            "checkpoint).")
    return {k[len(PREFIX):]: v for k, v in weights.items()}


def _layer_module(config: dict, path: Path):
    """(decoder layer class, mlx-lm args, full-attention layer index) for the family."""
    text = text_config(config)
    text = {**text, **hybrid_overrides(text, path)}
    kind = text.get("model_type")
    if kind == "qwen3_next":
        module = mlxlm.model_module("qwen3_next")
        return module.Qwen3NextDecoderLayer, module.ModelArgs.from_dict(text)
    module = mlxlm.model_module("qwen3_5")  # (its text model serves the MoE checkpoints too)
    return module.DecoderLayer, module.TextModelArgs.from_dict(text)


def sanitize(weights: Dict[str, mx.array], num_experts: int) -> Dict[str, mx.array]:
    """Checkpoint names and values (prefix removed) -> this module's: zero-centred norms
    shifted, experts (one tensor each, or fused gate_up) stacked as mlx-lm's switch_mlp."""
    out = {}
    for k, v in weights.items():
        if (k.endswith(_NORMS) or k in _TOP_NORMS) and v.ndim == 1:
            v = v + 1.0
        out[k] = v
    for k in [k for k in out if k.endswith(".mlp.experts.gate_up_proj")]:
        prefix = k[: -len(".experts.gate_up_proj")]
        gate, up = mx.split(out.pop(k), 2, axis=-2)
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate
        out[f"{prefix}.switch_mlp.up_proj.weight"] = up
        out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
    return stacked_experts(out, num_experts, "the MTP module")


class MTPHead(DraftHead):
    kind = "mtp"

    def __init__(self, config: dict, num_layers: int, own_embedding: bool, path: Path,
                 source: Optional[HeadSource] = None):
        super().__init__(source)
        layer_cls, args = _layer_module(config, path)
        H = args.hidden_size
        self.model_type = text_config(config).get("model_type")
        self.hidden_size, self.target_vocab = H, args.vocab_size
        self.num_experts = getattr(args, "num_experts", 0)
        if own_embedding:
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=args.rms_norm_eps)
        full = args.full_attention_interval - 1  # an index whose layer is full attention
        self.layers = [layer_cls(args, full) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self._rope = RopeContext()
        for layer in self.layers:
            layer.self_attn.rope = PositionedRoPE(layer.self_attn.rope, self._rope)

    feature_size = property(lambda self: self.hidden_size)
    vocab_size = draft_vocab_size = property(lambda self: self.target_vocab)
    num_layers = property(lambda self: len(self.layers))

    def __call__(self, features, tokens, embed, cache=None, positions=None, mask=None,
                 fed_back=None):
        """features [1, T, H] (the target's post-norm hidden states, or this module's own
        output at deeper levels) paired with tokens [1, T] -> normed output [1, T, H]."""
        if "embed_tokens" in self:
            embed = self.embed_tokens
        e = embed(tokens).astype(features.dtype)
        h = self.fc(mx.concatenate([self.pre_fc_norm_embedding(e),
                                    self.pre_fc_norm_hidden(features)], axis=-1))
        if mask is None and h.shape[1] > 1:
            mask = "causal"
        elif isinstance(mask, mx.array) and mask.ndim == 2:
            mask = mask[None, None]  # (mlx-lm's layers are handed [B, heads, T, keys])
        caches = cache.layers if cache is not None else [None] * len(self.layers)
        self._rope.positions = positions
        try:
            for layer, c in zip(self.layers, caches):
                h = layer(h, mask, c)
        finally:
            self._rope.positions = None
        return self.norm(h)

    def logits(self, out_hidden, target) -> mx.array:
        return target.lm_head(out_hidden)

    def make_cache(self):
        return HeadCache(len(self.layers), window=self.draft_window)


def layer_count(config: dict, weights: Dict[str, mx.array]) -> int:
    found = {int(m[1]) for k in weights if (m := re.match(r"layers\.(\d+)\.", k))}
    n = text_config(config).get("mtp_num_hidden_layers") or len(found)
    return n if found == set(range(n)) else -1


def build_mtp(config: dict, weights: Dict[str, mx.array], path: Path, converted: bool,
              layout: Optional[str] = None):
    """An MTPHead from a model config and its `mtp.*` tensors (prefix removed), or from a
    folder `convert` wrote (`converted`: names and values already this module's)."""
    n = layer_count(config, weights)
    if n < 1:
        raise EagleError(f"the MTP module in {path} has layers "
                         f"{sorted({k.split('.')[1] for k in weights if k.startswith('layers.')})}"
                         f", not the {text_config(config).get('mtp_num_hidden_layers')} "
                         "its config names.")
    text = dict(text_config(config))
    source = HeadSource(path=path, layout=layout or f"{config.get('model_type')} MTP module",
                        model_type=text.get("model_type"), config=text)
    head = MTPHead(config, n, "embed_tokens.weight" in weights, path, source)
    if not converted:
        weights = sanitize(weights, head.num_experts)
    quant = config.get("quantization")
    if quant:
        nn.quantize(head, group_size=quant["group_size"], bits=quant["bits"],
                    class_predicate=lambda p, m: isinstance(m, (nn.Linear, nn.Embedding))
                    and f"{p}.scales" in weights)
    check_weights(head, weights, f"the MTP module in {path}")
    head.load_weights(list(weights.items()))
    head.eval()
    return head
