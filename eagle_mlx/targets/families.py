"""The target families: how each runs its decoder layers in a tree verify, on mlx-lm's own
modules.

A target forward (`target.Target.__call__`) embeds the tokens, then runs every decoder layer
through its mechanism (`AttentionMechanism`: full attention, or a sliding window of the
latest positions) and the family's layer call. Two kinds of family:

* the standard decoders (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE): norm ->
  attention -> norm -> MLP/MoE, their attention run here (`layers.attention`) with
  per-token positions and the tree mask;
* the others (Gemma 3, Gemma 4, gpt-oss, Ministral 3): mlx-lm's own decoder layer is
  called as it is, with the layer's mask and cache; the one thing a tree changes inside
  it, the rotary positions, comes through `PositionedRoPE`, which turns the positions of
  the tree's nodes into the rotation mlx-lm's code asks for with an offset. So the scaled
  embeddings, extra norms, query scaling, soft-capping and attention sinks are exactly
  mlx-lm's.

Windows follow the Hugging Face config of each family (what transformers computes); where
mlx-lm's own forward does not implement them (Qwen2/Qwen3 `use_sliding_window`, Mistral's
and Mixtral's `sliding_window`), plain decoding runs this forward too (`Target.plain_model`).
"""

import math
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn

from .cache import BatchRecurrentCache, BoundedKVCache, RaggedKVCache, RecurrentCache, \
    TreeKVCache, WindowKVCache
from .. import mlxlm
from ..errors import EagleError
from .layers import apply_rope, attention, padded_mask


def text_config(config: dict) -> dict:
    """The language model's config: a multimodal checkpoint's `text_config`, else the whole."""
    return config.get("text_config") or config

class Forward:
    """What one target forward shares across its layers: the tokens' positions, the mask
    it was given, each kind of layer's mask (made once, by the first layer of that kind,
    before its cache grows) and what KV-shared layers read."""

    def __init__(self, T: int, n: int, positions: Optional[mx.array], mask, tree=None):
        self.T, self.n = T, n
        self.positions = positions           # None: n .. n+T-1
        self.mask = mask                     # None/"causal" or bool [T, n + T]
        self.tree = tree                     # a batch's trees [B, T, T] (then n: [B] lengths)
        self.masks = {}                      # window (None: full) -> this forward's mask
        self.kv = {}                         # layer -> ((keys, values), offset) it computed
        self.extra = None                    # the family's per-forward inputs
        self.max_depth = T - 1               # levels below the root a tree may have

    @property
    def rounds(self) -> int:
        """Rounds of a recurrent layer's scan: one a level, the root's included."""
        return self.max_depth + 1

    @property
    def queries(self) -> mx.array:
        if self.positions is not None:
            return self.positions
        return mx.arange(self.n, self.n + self.T)


class Mechanism:
    """What a layer's cache does after a verify and when a prompt cache is cut back (each
    cache class knows how: `keep`, `reusable`, `truncate`)."""

    def accept(self, cache, start: int, rows) -> None:
        cache.keep(start, rows)

    def reusable(self, cache, length: int) -> bool:
        return cache.reusable(length)

    def truncate(self, cache, length: int) -> None:
        cache.truncate(length)


class AttentionMechanism(Mechanism):
    """The layer mechanism of an attention layer: its cache, its mask in a forward, and
    what its cache does after acceptance (keep the accepted rows) or when cut back.

    window: None (full attention) or the sliding window W: a token at position p sees the
    positions p-W+1..p. A tree node sees the cached positions within its own window and
    those of its ancestors that are (`WindowKVCache.band` and the tree mask). source: for a
    KV-shared layer, the layer whose keys and values it reads (it has no cache)."""

    def __init__(self, window: Optional[int] = None, source: Optional[int] = None):
        self.window, self.source = window, source

    def make_cache(self, max_kv_size: Optional[int] = None):
        """The layer's cache; max_kv_size: a full layer's is mlx-lm's bounded one."""
        if self.source is not None:
            return None
        if self.window is None and max_kv_size is not None:
            return BoundedKVCache(max_kv_size)
        return TreeKVCache() if self.window is None else WindowKVCache(self.window)

    def accept(self, cache, start: int, rows) -> None:
        if isinstance(cache, BoundedKVCache):
            cache.keep_rows(start, rows)
        else:
            cache.keep(start, rows)

    def make_batch_cache(self):
        return None if self.source is not None else RaggedKVCache()

    def mask(self, fwd: Forward, cache):
        """This layer's mask in `fwd` (made once per kind of layer): None, "causal", or a
        boolean array of mlx-lm's own rank, [B or 1, heads or 1, T, keys]."""
        if self.window not in fwd.masks:
            mask = self._mask(fwd, cache)
            fwd.masks[self.window] = mask if not isinstance(mask, mx.array) or mask.ndim == 4 \
                else mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        return fwd.masks[self.window]

    def _mask(self, fwd: Forward, cache):
        if isinstance(cache, BoundedKVCache):  # (mlx-lm's bounded cache: its own layout)
            if fwd.T == 1:
                mask = None
            elif isinstance(fwd.mask, mx.array):
                mask = cache.tree_mask(fwd.mask[:, -fwd.T:], fwd.queries)
            else:
                mask = cache.make_mask(fwd.T, return_array=True)
            return mask
        if fwd.tree is not None:  # a batch: each row's prefix (within the window), its tree
            return cache.mask(fwd.tree, fwd.T, self.window, fwd.positions)
        mask = fwd.mask
        if mask is None and fwd.T > 1:
            mask = "causal"
        if self.window is not None:
            if cache is None:  # no cache: the tokens alone, causal within the window
                q = fwd.queries
                band = (q[:, None] - q[None, :]) < self.window
                mask = band if not isinstance(mask, mx.array) else mask & band
                mask = mask & (q[None, :] <= q[:, None])
            else:
                base = cache.base_after(fwd.T)
                band = cache.band(fwd.queries, fwd.T)
                if isinstance(mask, mx.array):
                    mask = mask[:, base:] & band
                else:  # causal over the held positions and the new ones
                    k = band.shape[1]
                    mask = band & (mx.arange(k)[None, :] <= mx.arange(k - fwd.T, k)[:, None])
        return mask


class LinearAttentionMechanism(Mechanism):
    """The layer mechanism of a Gated DeltaNet (linear-attention) layer: its cache is a
    recurrent state and a convolution window (`RecurrentCache`), it needs no mask, and
    after a tree verify it keeps the accepted node's state and window."""

    window, source = None, None

    def __init__(self, kernel: int):
        self.kernel = kernel

    def make_cache(self):
        return RecurrentCache(self.kernel - 1)

    def make_batch_cache(self):
        return BatchRecurrentCache(self.kernel - 1)

    def mask(self, fwd: Forward, cache):
        return None


def tree_ancestors(fwd: Forward):
    """The tree of a verify forward, from its mask and positions: each node's depth [T] and
    its ancestor-or-self mask [T, T] (the tree's own columns of the mask)."""
    depth = fwd.positions - fwd.n
    return depth, fwd.mask[:, fwd.n:]


def ancestor_at(depth: mx.array, anc: mx.array, up: int) -> mx.array:
    """For each node, the index of its ancestor `up` levels above it (itself for up = 0;
    meaningless where the node is less deep than that). depth [..., T], anc [..., T, T]
    (a batch of trees: one per row)."""
    match = anc & (depth[..., None, :] == (depth[..., :, None] - up))
    return mx.argmax(match.astype(mx.int32), axis=-1)


def _delta_rounds(attn, windows, z, b, a, start, parent, rounds):
    """The Gated DeltaNet recurrence over N tree nodes at once (batch N, one step), each
    node's convolution window given [N, K, conv_dim] and its parent's state read from
    concat(start, states)[parent] (start: the cached states the roots follow). Returns
    (normed output [N, 1, Hv*Dv], every node's state)."""
    N = windows.shape[0]
    conv = nn.silu(attn.conv1d(windows))                                 # [N, 1, conv_dim]
    q, k, v = [t.reshape(N, 1, h, d) for t, h, d in zip(
        mx.split(conv, [attn.key_dim, 2 * attn.key_dim], -1),
        [attn.num_k_heads, attn.num_k_heads, attn.num_v_heads],
        [attn.head_k_dim, attn.head_k_dim, attn.head_v_dim])]
    q, k = mlxlm.normalize_qk(q, k, inv_scale=attn.head_k_dim ** -0.5, eps=1e-6)
    states = mx.broadcast_to(start[:1], (N, *start.shape[1:]))
    for _ in range(rounds):
        incoming = mx.concatenate([start, states])[parent]
        out, states = mlxlm.gated_delta_update(q, k, v, a[:, None], b[:, None], attn.A_log,
                                         attn.dt_bias, incoming)
    return attn.norm(out, z[:, None]), states


def _windows(held, rows, depth, anc, K):
    """Each node's convolution window, oldest first: its ancestors K-1 .. 1 levels up (or
    the held rows before the root), itself. held [K-1, C], rows [T, C] -> [T, K, C]."""
    T = rows.shape[0]
    picks = []
    for up in range(K - 1, 0, -1):
        in_tree = (K - 1) + ancestor_at(depth, anc, up)
        picks.append(mx.where(depth >= up, in_tree, (K - 1) - (up - depth)))
    picks.append((K - 1) + mx.arange(T))
    return mx.concatenate([held, rows])[mx.stack(picks, axis=1)]


def batch_tree_gated_delta(attn, rows, z, b, a, cache, fwd: Forward) -> mx.array:
    """`tree_gated_delta` for a batch of trees: rows [B, T, conv_dim], z [B, T, Hv, Dv],
    b, a [B, T, Hv]; every row's nodes start from its own cached window and state
    (`BatchRecurrentCache`), all B x T nodes in one recurrence. Leaves every node's state
    and row in `cache.pending`. Returns [B, T, H]."""
    B, T, K = rows.shape[0], rows.shape[1], attn.conv_kernel_size
    depth = fwd.positions - mx.array(fwd.n)[:, None]
    anc = fwd.tree
    windows = mx.concatenate([_windows(cache.windows[i], rows[i], depth[i], anc[i], K)[None]
                              for i in range(B)]).reshape(B * T, K, -1)
    # parents: the row's cached state (index b) or the node's parent (B + b*T + index)
    up = ancestor_at(depth, anc, 1)
    own = mx.arange(B)[:, None]
    parent = mx.where(depth > 0, B + own * T + up, own).reshape(-1)
    out, states = _delta_rounds(attn, windows, z.reshape(B * T, *z.shape[2:]),
                                b.reshape(B * T, -1), a.reshape(B * T, -1), cache.states,
                                parent, fwd.rounds)
    cache.pending = (states.reshape(B, T, *states.shape[1:]), rows)
    return attn.out_proj(out.reshape(B, T, -1))


def tree_gated_delta(attn, rows: mx.array, z, b, a, cache, fwd: Forward) -> mx.array:
    """A Gated DeltaNet layer over the T nodes of a tree, with mlx-lm's own convolution,
    q/k normalisation, gated delta rule and gated norm: every node's convolution window is
    its own ancestors' projected rows (then the cached window's), its recurrent state its
    parent's (the cached state for the root). The recurrence runs in rounds over all nodes
    at once (batch T, one step): after round r every node less than r+1 deep has its
    state, so `fwd.rounds` rounds finish the deepest. No Python loop over nodes.

    rows: [T, conv_dim] projected rows; z [T, Hv, Dv]; b, a [T, Hv]. Leaves every node's
    state and row in `cache.pending` for the acceptance. Returns the layer output [1, T, H]."""
    T, K = rows.shape[0], attn.conv_kernel_size
    depth, anc = tree_ancestors(fwd)
    windows = _windows(cache.window(rows.shape[-1], rows.dtype), rows, depth, anc, K)
    start = cache[1] if cache[1] is not None else \
        mx.zeros((1, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim), mx.float32)
    parent = mx.where(depth > 0, 1 + ancestor_at(depth, anc, 1), 0)   # 0: the cached state
    out, states = _delta_rounds(attn, windows, z, b, a, start, parent, fwd.rounds)
    cache.pending = (states, rows)
    return attn.out_proj(out.reshape(1, T, -1))


class PositionedRoPE(nn.Module):
    """mlx-lm's rotary embedding of one attention module, at the positions of a tree's
    nodes while a tree forward runs (`context.positions`), otherwise exactly the module it
    wraps (mlx-lm's offset)."""

    def __init__(self, rope: nn.Module, context):
        super().__init__()
        self.rope = rope
        self._context = context

    def __call__(self, x, offset=0):
        positions = self._context.positions
        if positions is None:
            return self.rope(x, offset=offset)
        return apply_rope(self.rope, x, 0, positions)


class RopeContext:
    positions: Optional[mx.array] = None


class Family:
    """The standard decoders (see the module's docstring)."""

    layer_calls = False  # True: mlx-lm's own layer is called (positions via PositionedRoPE)

    def __init__(self, model: nn.Module, config: dict):
        self.lm = getattr(model, "language_model", model)  # multimodal: its language model
        self.config = config

    @property
    def inner(self) -> nn.Module:
        return self.lm.model

    def text_config(self) -> dict:
        return text_config(self.config)

    @property
    def softcap(self) -> Optional[float]:
        """The final logit soft-cap (tanh(logits / cap) * cap), where the model has one."""
        return None

    def windows(self) -> List[Optional[int]]:
        """Each layer's window (None: full attention), as transformers computes it (for a
        mistral3 checkpoint: its Llama-shaped language model's)."""
        c, L = self.text_config(), len(self.inner.layers)
        kind = c.get("model_type")
        if kind in ("mistral", "mixtral"):
            return [c.get("sliding_window")] * L
        if kind in ("qwen2", "qwen3", "qwen3_moe"):
            if not c.get("use_sliding_window"):
                return [None] * L
            types = c.get("layer_types")
            if kind == "qwen3_moe" or not types:  # transformers: every layer (MoE), or from
                first = 0 if kind == "qwen3_moe" else c.get("max_window_layers", L)  # the
                types = ["sliding_attention" if i >= first else "full_attention"  # first
                         for i in range(L)]                                       # window layer
            return [c.get("sliding_window") if t == "sliding_attention" else None for t in types]
        if c.get("use_sliding_window") or "sliding_attention" in (c.get("layer_types") or ()):
            raise EagleError(f"{kind} models have no sliding-window attention, but the config "
                             "asks for it (use_sliding_window / layer_types).")
        return [None] * L

    def mlx_lm_exact(self, windows) -> bool:
        """Whether mlx-lm's own forward computes what the config says (plain decoding
        runs it then)."""
        return all(w is None for w in windows)

    def mechanisms(self, shared_full) -> list:
        """One mechanism per decoder layer (`shared_full`: the one of unwindowed,
        unshared attention layers)."""
        return [shared_full if w is None and s is None else AttentionMechanism(w, s)
                for w, s in zip(self.windows(), self.sources())]

    def sources(self) -> List[Optional[int]]:
        return [None] * len(self.inner.layers)

    def embed(self, target, tokens: mx.array, fwd: Forward) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def layer(self, target, i, layer, h, cache, mask, fwd: Forward) -> mx.array:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        r = attention(
            attn, attn.q_proj(x), attn.k_proj(x), attn.v_proj(x),
            target.n_heads, target.n_kv_heads, cache, fwd.positions, mask,
        )
        h = h + attn.o_proj(r)
        ffn = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
        return h + ffn(layer.post_attention_layernorm(h))

    def projection(self, hidden: mx.array) -> mx.array:
        """The output projection alone (lm_head, or the tied embedding): no soft-cap."""
        return self.lm.lm_head(hidden) if hasattr(self.lm, "lm_head") else \
            self.inner.embed_tokens.as_linear(hidden)

    def logits(self, hidden: mx.array) -> mx.array:
        out = self.projection(hidden)
        return out if self.softcap is None else mx.tanh(out / self.softcap) * self.softcap


def _layer_type_windows(types, window) -> List[Optional[int]]:
    return [window if t == "sliding_attention" else None for t in types]


class LayerCallFamily(Family):
    """mlx-lm's own decoder layer, called with its mask and cache (gpt-oss; the base of
    the others)."""

    layer_calls = True

    def windows(self):
        types = getattr(self.inner, "layer_types", None) or self.text_config().get("layer_types")
        return _layer_type_windows(types, self.text_config().get("sliding_window"))

    def mlx_lm_exact(self, windows) -> bool:
        return True

    def layer(self, target, i, layer, h, cache, mask, fwd):
        return layer(h, padded_mask(cache, mask, fwd.T), cache)


class Gemma3Family(LayerCallFamily):
    def windows(self):
        # mlx-lm's rule: every `sliding_window_pattern`-th layer is global
        p = self.inner.sliding_window_pattern
        return [None if (i + 1) % p == 0 else self.inner.window_size
                for i in range(len(self.inner.layers))]

    def mlx_lm_exact(self, windows) -> bool:
        # the embedding scale (below) differs from mlx-lm's unless sqrt(hidden) is a
        # bfloat16 number, and mlx-lm ignores a final soft-cap; plain decoding then runs
        # this forward
        scale = self.inner.args.hidden_size ** 0.5
        return float(mx.array(scale, mx.bfloat16)) == scale and self.softcap is None

    @property
    def softcap(self):
        return self.text_config().get("final_logit_softcapping")  # (as transformers)

    def embed(self, target, tokens, fwd):
        h = self.inner.embed_tokens(tokens)
        # as transformers (and Google's reference): sqrt(hidden) in the embedding's dtype;
        # mlx-lm rounds it to bfloat16 whatever the dtype (25.25 for 25.298 at 640)
        return h * mx.array(self.inner.args.hidden_size ** 0.5, h.dtype)


class Ministral3Family(LayerCallFamily):
    def windows(self):
        # transformers applies `sliding_window` to every layer, mlx-lm to the sliding
        # `layer_types`: the two agree only where the config says the same in both ways
        c = self.text_config()
        return [c.get("sliding_window")] * len(self.inner.layers)

    def mlx_lm_exact(self, windows) -> bool:
        return windows == _layer_type_windows(self.inner.layer_types, self.inner.sliding_window)

    def embed(self, target, tokens, fwd):
        args = self.inner.args.rope_parameters
        scale = mlxlm.llama4_attn_scale()
        beta, length = args["llama_4_scaling_beta"], args["original_max_position_embeddings"]
        if fwd.positions is None:
            fwd.extra = scale(fwd.T, fwd.n, beta, length)
        elif fwd.positions.ndim == 2:  # a batch: [B, 1, T, 1], each row's own positions
            B = fwd.positions.shape[0]
            fwd.extra = scale(1, fwd.positions.reshape(-1), beta, length).reshape(B, 1, fwd.T, 1)
        else:  # one scale per node: as for T batch rows at their own positions
            fwd.extra = scale(1, fwd.positions, beta, length).reshape(fwd.T, 1)
        h = self.inner.embed_tokens(tokens)
        fwd.extra = fwd.extra.astype(h.dtype)
        return h

    def layer(self, target, i, layer, h, cache, mask, fwd):
        return layer(h, fwd.extra, padded_mask(cache, mask, fwd.T), cache=cache)


class Gemma4Family(LayerCallFamily):
    def sources(self):
        prev = self.inner.previous_kvs
        return [None if j == i else j for i, j in enumerate(prev)]

    def embed(self, target, tokens, fwd):
        inner = self.inner
        h = inner.embed_tokens(tokens) * inner.embed_scale
        if inner.hidden_size_per_layer_input:
            per_layer = mlxlm.gemma4_per_layer_inputs(inner, tokens, h)
            fwd.extra = [per_layer[:, :, i, :] for i in range(len(inner.layers))]
        return h

    def layer(self, target, i, layer, h, cache, mask, fwd):
        src = self.inner.previous_kvs[i]
        kvs, offset = fwd.kv.get(src, (None, None))
        h, kvs, offset = layer(h, mask, cache, per_layer_input=fwd.extra[i] if fwd.extra else None,
                               shared_kv=kvs, offset=offset)
        fwd.kv[i] = (kvs, offset)
        return h

    @property
    def softcap(self):
        return self.lm.final_logit_softcapping


class HybridFamily(LayerCallFamily):
    """Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next: Gated DeltaNet layers with one
    full-attention layer every `full_attention_interval`. The attention layers are mlx-lm's
    own; a linear layer runs mlx-lm's module as it is outside a tree (prefill, plain
    decoding), and `tree_gated_delta` over the projections of its module in a tree."""

    def windows(self):
        return [None] * len(self.inner.layers)

    def mechanisms(self, shared_full):
        return [LinearAttentionMechanism(layer.linear_attn.conv_kernel_size) if layer.is_linear
                else shared_full for layer in self.inner.layers]

    @staticmethod
    def projections(attn, x):
        """A linear layer's (conv rows [B, T, C], z [B, T, Hv, Dv], b, a [B, T, Hv]) for x
        [B, T, H], as its mlx-lm module computes them (Qwen3.5: four projections;
        Qwen3-Next: two fused ones, reordered)."""
        B, T = x.shape[:2]
        if hasattr(attn, "in_proj_qkvz"):
            q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x),
                                                                 attn.in_proj_ba(x))
            rows = mx.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1),
                                   v.reshape(B, T, -1)], axis=-1)
        else:
            rows, z = attn.in_proj_qkv(x), attn.in_proj_z(x)
            b, a = attn.in_proj_b(x), attn.in_proj_a(x)
        return rows, z.reshape(B, T, attn.num_v_heads, attn.head_v_dim), b.reshape(B, T, -1), \
            a.reshape(B, T, -1)

    def layer(self, target, i, layer, h, cache, mask, fwd):
        if not layer.is_linear or fwd.positions is None or cache is None:
            return layer(h, padded_mask(cache, mask, fwd.T), cache)
        attn = layer.linear_attn
        rows, z, b, a = self.projections(attn, layer.input_layernorm(h))
        if fwd.tree is not None:
            h = h + batch_tree_gated_delta(attn, rows, z, b, a, cache, fwd)
        else:
            h = h + tree_gated_delta(attn, rows[0], z[0], b[0], a[0], cache, fwd)
        return h + layer.mlp(layer.post_attention_layernorm(h))


# the Gated DeltaNet hybrids (transformers' text-only names too); their checkpoints carry
# MTP modules
HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")

FAMILIES = {
    "llama": Family, "mistral": Family, "mixtral": Family, "qwen2": Family, "qwen3": Family,
    "qwen3_moe": Family, "gpt_oss": LayerCallFamily, "gemma3_text": Gemma3Family,
    "gemma3": Gemma3Family, "gemma4_text": Gemma4Family, "gemma4": Gemma4Family,
    "gemma4_unified": Gemma4Family,
    "ministral3": Ministral3Family, "mistral3": Ministral3Family,
    **{t: HybridFamily for t in HYBRID_TYPES},
}


def family_of(model: nn.Module, config: dict) -> Family:
    kind = config["model_type"]
    if kind == "mistral3":  # its language model: Ministral 3, or a Llama-shaped Mistral
        kind = (config.get("text_config") or {}).get("model_type", "llama")
        return (Ministral3Family if kind == "ministral3" else Family)(model, config)
    return FAMILIES[kind](model, config)


def attention_modules(family: Family):
    """The self-attention module of every layer that has one (not the linear-attention
    layers of a hybrid)."""
    return [layer.self_attn for layer in family.inner.layers if "self_attn" in layer]


def untruncated_yarn(family: Family) -> None:
    """YaRN as transformers computes it when the config says `truncate: false` (gpt-oss):
    the correction range between the two rotation counts is not rounded to whole
    dimensions. mlx-lm's YarnRoPE always rounds it (its frequencies then differ from the
    model's); the frequencies of each YarnRoPE are recomputed here, before anything runs,
    so that mlx-lm's own forward and the tree forward both use the model's."""
    text = family.text_config()
    params = text.get("rope_scaling") or text.get("rope_parameters") or {}
    if params.get("rope_type", params.get("type")) != "yarn" or params.get("truncate", True):
        return

    base = params.get("rope_theta", text.get("rope_theta", 10000.0))
    factor, length = params["factor"], params.get("original_max_position_embeddings", 4096)
    for attn in attention_modules(family):
        rope = getattr(attn.rope, "rope", attn.rope)
        if not isinstance(rope, mlxlm.YarnRoPE):
            continue
        dims = rope.dims

        def dim_of(rotations):
            return dims * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(dim_of(params.get("beta_fast", 32)), 0)
        high = min(dim_of(params.get("beta_slow", 1)), dims - 1)
        high = high + 0.001 if low == high else high
        ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
        extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        inter = factor * extra
        keep = 1.0 - ramp
        mlxlm.set_rope_freqs(rope, (inter * extra) / (inter * keep + extra * (1 - keep)))


def install_positions(family: Family, context: RopeContext) -> None:
    """Route the rotary embedding of every attention module of a layer-call family
    through `PositionedRoPE` (mlx-lm's module stays inside it, unchanged)."""
    if not family.layer_calls:
        return
    for attn in attention_modules(family):
        if not isinstance(attn.rope, PositionedRoPE):
            attn.rope = PositionedRoPE(attn.rope, context)
