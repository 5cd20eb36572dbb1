"""EAGLE draft heads: EAGLE-1 (also drives EAGLE-2 trees) and EAGLE-3.

Both run one decoder layer over (token embedding, feature) pairs with their own KV
cache of real positions, and can run a batch of tree nodes with their own mask and
positions. Parameter names are the published checkpoints' key names.

EAGLE-1:  x = fc(cat(embed(token), feature)); one Llama layer without input norm;
          logits = the target's lm_head(x).
EAGLE-3:  h = fc(cat(low, mid, high)) (skipped when the feature is the head's own
          output); a = cat(input_norm(embed), hidden_norm(h)) -> 2H-wide q/k/v;
          logits = lm_head(norm(out)) over the draft vocab; target id = d + d2t[d].
"""

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import mlxlm
from .cache import TreeKVCache
from .layers import attention


@dataclass
class HeadArgs:
    kind: str  # "eagle1" or "eagle3"
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    bias: bool = True  # EAGLE-1 fc bias
    draft_vocab_size: Optional[int] = None  # EAGLE-3
    has_d2t: bool = False
    qkv_bias: bool = False  # biased q/k/v (the Qwen2 heads)
    target_hidden_size: Optional[int] = None  # EAGLE-3 heads narrower than their target
    explicit_head_dim: Optional[int] = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict, kind: str, has_d2t: bool = False) -> "HeadArgs":
        n_heads = config["num_attention_heads"]
        return cls(
            kind=kind,
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=n_heads,
            num_key_value_heads=config.get("num_key_value_heads") or n_heads,
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta") or 10000.0,
            rope_scaling=config.get("rope_scaling"),
            max_position_embeddings=config.get("max_position_embeddings") or 2048,
            bias=config.get("bias", True),
            draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
            has_d2t=has_d2t,
            qkv_bias=bool(config.get("qkv_bias", False)),
            target_hidden_size=config.get("target_hidden_size") if kind == "eagle3" else None,
            explicit_head_dim=config.get("head_dim"),
        )

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def target_width(self) -> int:
        """The hidden size of the target this head drafts for."""
        return self.target_hidden_size or self.hidden_size


class HeadAttention(nn.Module):
    def __init__(self, args: HeadArgs, in_dims: int):
        super().__init__()
        H, D = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.q_proj = nn.Linear(in_dims, self.n_heads * D, bias=args.qkv_bias)
        self.k_proj = nn.Linear(in_dims, self.n_kv_heads * D, bias=args.qkv_bias)
        self.v_proj = nn.Linear(in_dims, self.n_kv_heads * D, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        self.scale = D**-0.5
        scaling = args.rope_scaling
        if scaling and (scaling.get("type") or scaling.get("rope_type")) not in (
            "linear", "dynamic", "llama3"
        ):
            scaling = None
        self.rope = mlxlm.initialize_rope(D, args.rope_theta, False, scaling,
                                          args.max_position_embeddings)

    def __call__(self, x, cache, positions, mask):
        return self.o_proj(attention(
            self, self.q_proj(x), self.k_proj(x), self.v_proj(x),
            self.n_heads, self.n_kv_heads, cache, positions, mask,
        ))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle1Layer(nn.Module):
    """A Llama decoder layer without its input RMSNorm."""

    def __init__(self, args: HeadArgs):
        super().__init__()
        self.self_attn = HeadAttention(args, args.hidden_size)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, cache, positions, mask):
        h = x + self.self_attn(x, cache, positions, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle1Head(nn.Module):
    kind = "eagle1"

    def __init__(self, args: HeadArgs):
        super().__init__()
        self.args = args
        H = args.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=args.bias)
        self.layers = [Eagle1Layer(args)]

    feature_size = property(lambda self: self.args.hidden_size)
    draft = None  # a DraftVocab: draft over N frequent tokens instead of the whole vocabulary

    @property
    def draft_vocab_size(self) -> int:
        return self.draft.size if self.draft is not None else self.args.vocab_size

    def __call__(self, features, tokens, embed, cache=None, positions=None, mask=None):
        """features [B, T, H] paired with tokens [B, T] -> out_hidden [B, T, H]."""
        e = embed(tokens).astype(features.dtype)
        x = self.fc(mx.concatenate([e, features], axis=-1))
        return self.layers[0](x, cache, positions, mask)

    def logits(self, out_hidden, target) -> mx.array:
        if self.draft is not None:  # the N kept rows of the target's lm_head
            return out_hidden @ self.draft.rows.T.astype(out_hidden.dtype)
        return target.lm_head(out_hidden)

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        return draft_ids if self.draft is None else self.draft.ids[draft_ids]

    def make_cache(self):
        return TreeKVCache()


class Eagle3MidLayer(nn.Module):
    def __init__(self, args: HeadArgs):
        super().__init__()
        H = args.hidden_size
        self.self_attn = HeadAttention(args, 2 * H)
        self.mlp = MLP(H, args.intermediate_size)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.input_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    def __call__(self, emb, h, cache, positions, mask):
        a = mx.concatenate([self.input_layernorm(emb), self.hidden_norm(h)], axis=-1)
        h = h + self.self_attn(a, cache, positions, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    kind = "eagle3"

    def __init__(self, args: HeadArgs):
        super().__init__()
        self.args = args
        H = args.hidden_size
        self.fc = nn.Linear(3 * args.target_width, H, bias=False)
        if args.target_hidden_size is not None:
            # its own embedding (the target's is of another width), as the official head has
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
        self.midlayer = Eagle3MidLayer(args)
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(H, args.draft_vocab_size, bias=False)
        if args.has_d2t:
            self.d2t = mx.zeros((args.draft_vocab_size,), dtype=mx.int64)

    feature_size = property(lambda self: 3 * self.args.target_width)
    draft_vocab_size = property(lambda self: self.args.draft_vocab_size)

    def __call__(self, features, tokens, embed, cache=None, positions=None, mask=None):
        """features: three target taps [B, T, 3 x target width] (through fc) or the head's
        own output [B, T, H] (deeper draft steps, no fc) -> out_hidden [B, T, H]."""
        h = self.fc(features) if features.shape[-1] != self.args.hidden_size else features
        if "embed_tokens" in self:
            embed = self.embed_tokens
        e = embed(tokens).astype(h.dtype)
        return self.midlayer(e, h, cache, positions, mask)

    def logits(self, out_hidden, target) -> mx.array:
        return self.lm_head(self.norm(out_hidden))

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        if "d2t" in self:
            return draft_ids + self.d2t[draft_ids].astype(draft_ids.dtype)
        return draft_ids

    def make_cache(self):
        return TreeKVCache()


HEAD_CLASSES = {"eagle1": Eagle1Head, "eagle3": Eagle3Head}
