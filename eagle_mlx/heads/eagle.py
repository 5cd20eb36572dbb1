"""EAGLE draft heads: EAGLE-1 (also drives EAGLE-2 trees) and EAGLE-3.

Both run one decoder layer over (token embedding, feature) pairs with their own KV
cache of real positions, and can run a batch of tree nodes with their own mask and
positions. Parameter names are the published checkpoints' key names.

EAGLE-1:  x = fc(cat(embed(token), feature)); one Llama layer without input norm;
          logits = the target's lm_head(x).
EAGLE-3:  h = fc(cat(taps)) (skipped when the feature is the head's own output);
          a = cat(input_norm(embed), hidden_norm(h)) -> 2H-wide q/k/v; then any further
          decoder layers; logits = lm_head(norm(out)) over the draft vocab; target id =
          d + d2t[d]. The variants the published layouts use are options of the same head
          (`HeadArgs`): the taps named by the head, norms before fc (one over the
          concatenation, or one per tap), the normed hidden as the residual of the first
          layer or as what deeper levels read, Qwen3 query/key norms, sliding layers.
"""

from dataclasses import dataclass, field
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .. import mlxlm
from ..targets.cache import DraftWindowKVCache, HeadCache, TreeKVCache
from ..targets.layers import as_rows, attention
from .base import DraftHead, HeadSource


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
    o_bias: bool = False    # biased o_proj too (Llama/Qwen3 layers with attention_bias)
    target_hidden_size: Optional[int] = None  # EAGLE-3 heads narrower than their target
    explicit_head_dim: Optional[int] = None
    # EAGLE-3 variants (checkpoint.py reads them from each layout's config)
    aux_layers: Optional[Tuple[int, ...]] = None  # target layers whose inputs fc reads
    norm_before_residual: bool = False  # the first layer's residual is the normed hidden
    norm_before_fc: bool = False        # one RMSNorm over the concatenated taps
    fc_norm: bool = False               # one RMSNorm per tap
    norm_output: bool = False           # deeper levels read the normed output
    final_norm: bool = True             # lm_head reads norm(out) (else out)
    num_layers: int = 1                 # decoder layers (the first reads 2H)
    qk_norm: bool = False               # Qwen3 layers: RMSNorm of each query/key head
    sliding_window: Optional[int] = None
    layer_types: Optional[Tuple[str, ...]] = None  # "sliding_attention" per layer
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
            o_bias=bool(config.get("o_bias", False)),
            target_hidden_size=config.get("target_hidden_size") if kind == "eagle3" else None,
            explicit_head_dim=config.get("head_dim"),
            **({k: (tuple(v) if isinstance(v, list) else v) for k, v in
                (config.get("eagle3_options") or {}).items()} if kind == "eagle3" else {}),
        )

    @property
    def num_aux(self) -> int:
        return len(self.aux_layers) if self.aux_layers else 3

    def window(self, layer: int) -> Optional[int]:
        """The sliding window of decoder layer `layer` (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def target_width(self) -> int:
        """The hidden size of the target this head drafts for."""
        return self.target_hidden_size or self.hidden_size


ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")  # the scalings a head computes


def window_mask(mask, cache, positions, T: int, window: int) -> mx.array:
    """`mask` (None/"causal" or boolean [T, cached + T]) narrowed to each query's window:
    key position > query position - window, the key positions being those the cache
    recorded (a tree level's nodes share a position)."""
    offset = cache.offset if cache is not None else 0
    q = positions if positions is not None else mx.arange(offset, offset + T)
    if cache is not None:
        cache.record_positions(q)
        k = cache.positions[: offset + T]
    else:
        k = q
    band = (q[:, None] - k[None, :]) < window
    if mask is None or isinstance(mask, str):
        mask = k[None, :] <= q[:, None]
    return mask & band


class HeadAttention(nn.Module):
    def __init__(self, args: HeadArgs, in_dims: int, window: Optional[int] = None):
        super().__init__()
        H, D = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.q_proj = nn.Linear(in_dims, self.n_heads * D, bias=args.qkv_bias)
        self.k_proj = nn.Linear(in_dims, self.n_kv_heads * D, bias=args.qkv_bias)
        self.v_proj = nn.Linear(in_dims, self.n_kv_heads * D, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.scale = D**-0.5
        self.window = window
        scaling = args.rope_scaling  # (another type is refused when the config is read)
        if scaling and (scaling.get("type") or scaling.get("rope_type")) not in ROPE_TYPES:
            scaling = None  # "default": plain RoPE
        self.rope = mlxlm.initialize_rope(D, args.rope_theta, False, scaling,
                                          args.max_position_embeddings)

    def __call__(self, x, cache, positions, mask):
        if self.window is not None:
            mask = window_mask(mask, cache, positions, x.shape[1], self.window)
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


class Eagle1Head(DraftHead):
    kind = "eagle1"

    def __init__(self, args: HeadArgs, source: Optional[HeadSource] = None):
        super().__init__(source)
        self.args = args
        H = args.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=args.bias)
        self.layers = [Eagle1Layer(args)]

    feature_size = property(lambda self: self.args.hidden_size)
    vocab_size = property(lambda self: self.args.vocab_size)
    drafts_batched = property(lambda self: not self.args.window(0))

    @property
    def draft_vocab_size(self) -> int:
        return self.draft.size if self.draft is not None else self.args.vocab_size

    def use_draft_vocab(self, vocab) -> None:
        """Draft over the N frequent tokens of `vocab` (a DraftVocab) instead of the whole
        vocabulary (None)."""
        self.draft = vocab

    def __call__(self, features, tokens, embed, cache=None, positions=None, mask=None,
                 fed_back=None):
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
        return TreeKVCache() if self.draft_window is None else \
            DraftWindowKVCache(self.draft_window)

    # (its one layer's cache is its whole cache)
    def cache_layers(self, cache) -> list:
        return [cache]

    def batch_cache(self, cache):
        return cache.layers[0]


class Eagle3MidLayer(nn.Module):
    def __init__(self, args: HeadArgs):
        super().__init__()
        H = args.hidden_size
        self.self_attn = HeadAttention(args, 2 * H, args.window(0))
        self.mlp = MLP(H, args.intermediate_size)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.input_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.norm_before_residual = args.norm_before_residual

    def __call__(self, emb, h, cache, positions, mask):
        normed = self.hidden_norm(h)
        a = mx.concatenate([self.input_layernorm(emb), normed], axis=-1)
        h = (normed if self.norm_before_residual else h) + self.self_attn(a, cache, positions,
                                                                           mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderLayer(nn.Module):
    """A Llama (or, with query/key norms, Qwen3) decoder layer: the further layers of an
    EAGLE-3 head."""

    def __init__(self, args: HeadArgs, index: int):
        super().__init__()
        H = args.hidden_size
        self.self_attn = HeadAttention(args, H, args.window(index))
        self.mlp = MLP(H, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    def __call__(self, h, cache, positions, mask):
        h = h + self.self_attn(self.input_layernorm(h), cache, positions, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(DraftHead):
    kind = "eagle3"

    def __init__(self, args: HeadArgs, source: Optional[HeadSource] = None):
        super().__init__(source)
        self.args = args
        H = args.hidden_size
        W, n = args.target_width, args.num_aux
        if args.norm_before_fc:
            self.input_norm = nn.RMSNorm(n * W, eps=args.rms_norm_eps)
        if args.fc_norm:
            self.fc_norm = [nn.RMSNorm(W, eps=args.rms_norm_eps) for _ in range(n)]
        self.fc = nn.Linear(n * W, H, bias=False)
        if args.target_hidden_size is not None:
            # its own embedding (the target's is of another width), as the official head has
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
        self.midlayer = Eagle3MidLayer(args)
        if args.num_layers > 1:
            self.extra_layers = [DecoderLayer(args, i) for i in range(1, args.num_layers)]
        if args.final_norm:
            self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(H, args.draft_vocab_size, bias=False)
        if args.has_d2t:
            self.d2t = mx.zeros((args.draft_vocab_size,), dtype=mx.int64)

    feature_size = property(lambda self: self.args.num_aux * self.args.target_width)
    target_width = property(lambda self: self.args.target_width)
    declares_target_width = property(lambda self: self.args.target_hidden_size is not None)
    vocab_size = property(lambda self: self.args.vocab_size)
    draft_vocab_size = property(lambda self: self.args.draft_vocab_size)
    num_layers = property(lambda self: self.args.num_layers)
    drafts_batched = property(lambda self: not any(self.args.window(i)
                                                   for i in range(self.args.num_layers)))
    aux_layers = property(lambda self: tuple(self.args.aux_layers or ()) or None)

    def feature_taps(self, target) -> tuple:
        """The target layers whose inputs the head reads (layer L: the last layer's output)."""
        return tuple(self.args.aux_layers) if self.args.aux_layers else target.eagle3_taps

    def _norm(self, h):
        return self.norm(h) if "norm" in self else h

    def __call__(self, features, tokens, embed, cache=None, positions=None, mask=None,
                 fed_back=None):
        """features: the target's taps [B, T, taps x target width] (through fc) or the
        head's own output [B, T, H] (deeper draft steps, `fed_back`, no fc) -> out_hidden
        [B, T, H] (normed where the head feeds its normed output back)."""
        a = self.args
        if fed_back is None:
            fed_back = features.shape[-1] != self.feature_size
        if fed_back:
            h = features
        else:
            if "input_norm" in self:
                features = self.input_norm(features)
            if "fc_norm" in self:
                parts = mx.split(features, a.num_aux, axis=-1)
                features = mx.concatenate([n(x) for n, x in zip(self.fc_norm, parts)], axis=-1)
            h = self.fc(features)
        if "embed_tokens" in self:
            embed = self.embed_tokens
        e = embed(tokens).astype(h.dtype)
        caches = cache.layers if cache is not None else [None] * a.num_layers
        h = self.midlayer(e, h, caches[0], positions, mask)
        for layer, c in zip(self.extra_layers if a.num_layers > 1 else [], caches[1:]):
            h = layer(h, c, positions, mask)
        return self._norm(h) if a.norm_output else h

    def logits(self, out_hidden, target) -> mx.array:
        return as_rows(lambda h: self.lm_head(h if self.args.norm_output else self._norm(h)),
                       out_hidden)

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        if "d2t" in self:
            return draft_ids + self.d2t[draft_ids].astype(draft_ids.dtype)
        return draft_ids

    def make_cache(self):
        return HeadCache(self.args.num_layers,
                         any(self.args.window(i) for i in range(self.args.num_layers)),
                         self.draft_window)


HEAD_CLASSES = {"eagle1": Eagle1Head, "eagle3": Eagle3Head}
