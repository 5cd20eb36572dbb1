"""What mlx-lm's attention lacks for trees: RoPE at per-token positions and an explicit mask.

Both the targets (mlx-lm modules, reused as they are) and the draft heads run their
attention through `attention()`, so a tree of T tokens is one call whatever the model.
"""

import os
from typing import Optional

import mlx.core as mx

from .. import mlxlm


def _dynamic_ntk_freqs(rope, seq_len: mx.array) -> mx.array:
    # The same rule as mlx-lm and transformers: grow the base once the sequence
    # (here: the largest position + 1) passes max_position_embeddings.
    d = rope.dims
    grown = rope.base * (
        (rope.factor * seq_len / rope.max_position_embeddings) - (rope.factor - 1)
    ) ** (d / (d - 2))
    base = mx.where(seq_len > rope.max_position_embeddings, grown, rope.base)
    return base ** (mx.arange(0, d, 2, dtype=mx.float32) / d)


_PAD_KEYS = []


def pads_keys() -> bool:
    """Whether a masked pass of several queries (a tree's verify, a head's draft level)
    attends over its cache's whole buffer, the slots not yet held masked (`TreeKVCache.
    padded_mask`): where MLX runs on a CUDA GPU, whose attention builds a cuDNN graph for every
    new key length — a tree's grows every cycle, and a graph costs tens of milliseconds.
    Metal's and the CPU's attention kernels plan nothing per shape, so there the padding
    would only add masked work. EAGLE_MLX_PAD_KEYS=1 or 0 sets it on any device."""
    if not _PAD_KEYS:
        env = os.environ.get("EAGLE_MLX_PAD_KEYS", "")
        _PAD_KEYS.append(env == "1" if env in ("0", "1") else
                         mx.default_device().type == mx.DeviceType.gpu and
                         hasattr(mx, "cuda") and mx.cuda.is_available())
    return _PAD_KEYS[0]


def set_pads_keys(on) -> None:
    """Set `pads_keys` for this process (True or False), or back to the device's default
    (None: EAGLE_MLX_PAD_KEYS, else whether MLX runs on a CUDA GPU)."""
    _PAD_KEYS.clear()
    if on is not None:
        _PAD_KEYS.append(bool(on))


def padded_mask(cache, mask, T: int):
    """A masked pass of T > 1 queries over `cache`: its mask widened to the cache's whole
    buffer, which the cache's update then returns (`TreeKVCache.padded_mask`), where
    `pads_keys`; anything else as it is."""
    if T > 1 and isinstance(mask, mx.array) and hasattr(cache, "padded_mask") and pads_keys():
        return cache.padded_mask(mask, T)
    return mask


def apply_rope(rope, x: mx.array, offset: int, positions: Optional[mx.array]) -> mx.array:
    """Rotate `x` [B, heads, T, D] at positions offset..offset+T-1, or at `positions` [T]
    (batch size 1) or [B, T] (each row its own).

    Per-token positions use the fast kernel's per-batch offsets: the B x T tokens become
    B x T batch rows of length 1.
    """
    if positions is None:
        return rope(x, offset=offset)
    if positions.ndim == 2 and isinstance(rope, mlxlm.DynamicNTKScalingRoPE):
        # the grown base depends on each sequence's own length: one row at a time
        return mx.concatenate([apply_rope(rope, x[b: b + 1], 0, positions[b])
                               for b in range(x.shape[0])])
    if positions.ndim == 2:
        B, H, T, D = x.shape
        flat = apply_rope(rope, x.transpose(0, 2, 1, 3).reshape(1, B * T, H, D)
                          .transpose(0, 2, 1, 3), 0, positions.reshape(-1))
        return flat.transpose(0, 2, 1, 3).reshape(B, T, H, D).transpose(0, 2, 1, 3)
    if x.shape[0] != 1:
        raise ValueError("per-token positions [T] need batch size 1 (give [B, T])")
    xt = x.transpose(2, 1, 0, 3)  # [T, heads, 1, D]
    if isinstance(rope, mlxlm.DynamicNTKScalingRoPE):
        freqs = _dynamic_ntk_freqs(rope, positions.max() + 1)
        out = mx.fast.rope(
            xt, rope.dims, traditional=rope.traditional, base=None, scale=1.0,
            offset=positions, freqs=freqs,
        )
    else:
        out = rope(xt, offset=positions)
    return out.transpose(2, 1, 0, 3)


def attention(
    attn,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    n_heads: int,
    n_kv_heads: int,
    cache=None,
    positions: Optional[mx.array] = None,
    mask=None,
) -> mx.array:
    """Rotary attention for already projected q/k/v [B, T, heads*D] -> [B, T, heads*D].

    `attn` provides `rope` and `scale` (and `q_norm`/`k_norm` where the model has them). `mask` is None/"causal" or a boolean array
    [T, cache length + T] (True = may attend) broadcast over batch and heads.
    """
    B, T, _ = queries.shape
    q = queries.reshape(B, T, n_heads, -1)
    k = keys.reshape(B, T, n_kv_heads, -1)
    if "q_norm" in attn:  # Qwen3: per-head RMSNorm of queries and keys before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    v = values.reshape(B, T, n_kv_heads, -1).transpose(0, 2, 1, 3)
    offset = cache.offset if cache is not None else 0
    q = apply_rope(attn.rope, q, offset, positions)
    k = apply_rope(attn.rope, k, offset, positions)
    if isinstance(mask, mx.array) and mask.ndim == 2:
        mask = mask[None, None]  # ([B, heads, T, keys]: what mlx-lm's own masks are)
    if cache is not None:
        mask = padded_mask(cache, mask, T)
        k, v = cache.update_and_fetch(k, v)
        lo = getattr(cache, "visible_from", 0)  # (a draft window: the slots from lo on)
        if lo and isinstance(mask, mx.array):
            mask = mask[..., lo:]
    if mask is None and T > 1:
        mask = "causal"
    if hasattr(cache, "bits"):  # a quantized cache (`kv_bits`): mlx-lm's quantized attention
        out = mlxlm.quantized_scaled_dot_product_attention(
            q, k, v, scale=attn.scale, mask=mask, group_size=cache.group_size, bits=cache.bits)
    else:
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(B, T, -1)


def as_rows(fn, x: mx.array) -> mx.array:
    """fn (a projection over the last axis) of x [..., H] computed on [1, rows, H] unless x
    is [B, T, H]: the rank mlx-lm's own model call gives every projection, and the only one
    every backend's quantized matmul is written for (MLX's CUDA backend failed on the
    engine's 1-D and 2-D inputs)."""
    if x.ndim == 3:
        return fn(x)
    out = fn(x.reshape(1, -1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def log_softmax(x: mx.array) -> mx.array:
    """Log-probabilities over the last axis: x - logsumexp(x) (what every draft score,
    acceptance and loss in the package uses; mlx.nn.log_softmax shifts by the max first, which
    rounds differently)."""
    return x - mx.logsumexp(x, axis=-1, keepdims=True)
