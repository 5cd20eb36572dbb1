"""Block drafters: DFlash checkpoints (z-lab, `architectures: ["DFlashDraftModel"]`).

A block drafter reads the outputs of several target layers (its taps) at every committed
position and predicts a whole block of tokens in one forward pass: the block
`[root, mask, ..., mask]` (B tokens, embedded with the target's embedding table times
`input_embedding_scale`) runs through a few Qwen3 decoder layers whose attention also sees
keys and values of the context, `hidden_norm(fc(concat(taps)))` projected by each layer's
own k/v projections; slot i of the output, through the target's output projection (times
`output_multiplier`, soft-capped by the drafter's own `final_logit_softcapping`), is the
drafter's distribution of the token i positions after the root.

Full-attention layers see the whole context and the whole block (bidirectional); sliding
ones are causal within the block and see the context within their window. The context's
keys and values are kept per layer (`BlockState`) for committed positions only: a block's
rows are never kept. `draft_window` bounds what is kept to the last N positions (long
contexts), as the checkpoint's sliding layers bound what they attend to.

The drafter (`decoding.block.BlockDrafter`) turns a block's per-slot distributions into a
chain or a DDTree.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .. import mlxlm
from ..errors import EagleError
from ..targets.layers import as_rows
from .base import DraftHead, HeadSource
from .eagle import MLP, ROPE_TYPES

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel")
KV_STEP = 256  # context rows a layer's buffer grows by


def is_block_config(config: dict) -> bool:
    """Whether a config.json is a block drafter's (DFlash, DFlash 2, DSpark)."""
    return any(a in ARCHITECTURES or "DSpark" in str(a)
               for a in config.get("architectures") or ()) or _is_speculators_dspark(config)


def _is_speculators_dspark(config: dict) -> bool:
    spec = config.get("speculators_config") or {}
    return (config.get("speculators_model_type") or spec.get("algorithm")) == "dspark"


# DSpark variants another packaging or fork adds, refused in one sentence each: (what the
# config says, what it means)
_DSPARK_UNSUPPORTED = (
    (lambda c: "gemma4" in str(c.get("model_type", "")), "a Gemma-4-flavoured backbone"),
    (lambda c: c.get("model_type") == "qwen3_5" or c.get("enable_qwen35_gated_q_proj"),
     "a Qwen3.5-flavoured backbone (gated queries, offset norms)"),
    (lambda c: (c.get("dflash_config") or {}).get("projector_type") == "dspark",
     "SpecForge's packaging"),
    (lambda c: c.get("log_snr_conditioning"), "log-SNR conditioning"),
    (lambda c: c.get("attention_sink_bias"), "attention sinks"),
    (lambda c: c.get("dflash_query_causal"), "a causal block"),
    (lambda c: c.get("has_lm_head") is False, "the target's lm_head in place of its own"),
    (lambda c: c.get("markov_head_type", "vanilla") != "vanilla", "a non-vanilla Markov head"),
)


def _from_speculators(c: dict, where) -> dict:
    """A vLLM speculators DSpark config in DeepSpec's key names: the backbone from
    `transformer_layer_config`, the taps from `aux_hidden_state_layer_ids`, the first
    predicting slot from the proposal's width (`block_size - speculative_tokens`), else
    `sample_from_anchor`, else 1 (the DFlash lineage)."""
    layer = c.get("transformer_layer_config")
    taps = c.get("aux_hidden_state_layer_ids")
    if not isinstance(layer, dict) or not taps:
        raise EagleError(f"{where} is a speculators DSpark config without "
                         f"{'transformer_layer_config' if not isinstance(layer, dict) else 'aux_hidden_state_layer_ids'}.")
    out = dict(layer)
    out.update({k: c[k] for k in ("block_size", "mask_token_id", "markov_rank",
                                  "markov_head_type", "enable_confidence_head",
                                  "confidence_head_with_markov", "final_logit_softcapping",
                                  "draft_vocab_size") if k in c})
    out["target_layer_ids"] = list(taps)
    out["architectures"] = ["Qwen3DSparkModel"]
    props = (c.get("speculators_config") or {}).get("proposal_methods") or []
    width = props[0].get("speculative_tokens") if props and isinstance(props[0], dict) else None
    block = out.get("block_size")
    if isinstance(width, int) and isinstance(block, int) and 0 <= block - width < block:
        out["logits_start"] = block - width
    elif isinstance(c.get("sample_from_anchor"), bool):
        out["logits_start"] = 0 if c["sample_from_anchor"] else 1
    else:
        out["logits_start"] = 1
    return out


class _Fields:
    """A block drafter's config.json read field by field: a field from its "dflash_config"
    or the top level, and each value checked with one sentence naming the file."""

    def __init__(self, config: dict, where: Path):
        draft = config.get("dflash_config") or {}
        if not isinstance(draft, dict):
            raise EagleError(f"{where}: \"dflash_config\" must be an object.")
        self.config, self.draft, self.where = config, draft, where

    def get(self, key, default=None):
        return self.draft.get(key, self.config.get(key, default))

    def whole(self, key, value, low=1):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise EagleError(f"{self.where}: \"{key}\" must be a whole number of at least {low} "
                             f"(got {value!r}).")
        return value

    def number(self, key, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise EagleError(f"{self.where}: \"{key}\" must be a number (got {value!r}).")
        return float(value)


def _layer_ids(f: _Fields, n_target, layers: int) -> tuple:
    """The target layers the drafter reads (the reference's default spread where the
    config names only how many target layers there are)."""
    ids = f.get("target_layer_ids")
    if ids is None:
        if n_target is None:
            raise EagleError(f"{f.where} has neither \"target_layer_ids\" nor "
                             "\"num_target_layers\": which target layers it reads is unknown.")
        ids = default_layer_ids(n_target, layers)
    if not isinstance(ids, list) or not ids or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise EagleError(f"{f.where}: \"target_layer_ids\" must be a non-empty list of "
                         f"layer numbers (got {ids!r}).")
    return tuple(ids)


def _layer_types(f: _Fields, layers: int):
    """(each layer's attention kind, the sliding window where some layer slides)."""
    types = f.config.get("layer_types") or ["full_attention"] * layers
    if not isinstance(types, list) or len(types) != layers or \
            any(t not in ("full_attention", "sliding_attention") for t in types):
        raise EagleError(f"{f.where}: \"layer_types\" must list \"full_attention\" or "
                         f"\"sliding_attention\" for each of its {layers} layers.")
    window = f.config.get("sliding_window")
    if "sliding_attention" in types:
        if window is None:
            raise EagleError(f"{f.where} has sliding_attention layers but no "
                             "\"sliding_window\".")
        f.whole("sliding_window", window, 2)
    return tuple(types), window


def _rope(f: _Fields):
    """(RoPE's base, its scaling or None)."""
    params = f.config.get("rope_parameters") or {}
    theta = f.config.get("rope_theta") or params.get("rope_theta") or 1000000.0
    scaling = f.config.get("rope_scaling") or (params if params.get("rope_type", "default")
                                               != "default" else None)
    kind = scaling and (scaling.get("type") or scaling.get("rope_type"))
    if kind and kind != "default" and kind not in ROPE_TYPES:
        raise EagleError(f"{f.where}: RoPE scaling \"{kind}\" is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)}).")
    return theta, scaling if kind and kind != "default" else None


def _dspark_fields(f: _Fields) -> dict:
    """A DSpark drafter's own fields: where its logits start, its draft vocabulary, its
    Markov head's rank and its confidence head."""
    config = f.config
    start = config.get("logits_start")
    if start is None and isinstance(config.get("sample_from_anchor"), bool):
        start = 0 if config["sample_from_anchor"] else 1
    start = 0 if start is None else start
    if start not in (0, 1):
        raise EagleError(f"{f.where}: \"logits_start\" must be 0 or 1 (got {start!r}).")
    dv = config.get("draft_vocab_size")
    if dv is not None:
        f.whole("draft_vocab_size", dv)
    rank = config.get("markov_rank", 256)
    f.whole("markov_rank", rank, 0)
    return dict(dspark=True, logits_start=start,
                draft_vocab_size=None if dv in (None, config["vocab_size"]) else dv,
                markov_rank=rank, confidence=bool(config.get("enable_confidence_head", True)),
                confidence_with_markov=bool(config.get("confidence_head_with_markov", True)))


def _dflash2_fields(f: _Fields, H: int) -> dict:
    """A DFlash 2 drafter's convolution and selector sizes."""
    two = {}
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if f.get(key) is None:
            raise EagleError(f"{f.where} is a DFlash 2 drafter without \"{key}\" (in "
                             "\"dflash_config\").")
        two[key] = f.whole(key, f.get(key))
    if H % two["conv_group_size"]:
        raise EagleError(f"{f.where}: conv_group_size {two['conv_group_size']} does not "
                         f"divide hidden_size {H}.")
    return two


@dataclass
class BlockArgs:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    target_layer_ids: Tuple[int, ...]
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    layer_types: Tuple[str, ...] = ()
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    num_target_layers: Optional[int] = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    draft_window: Optional[int] = None  # context positions kept (None: all)
    # DSpark: a chain ends where its confidence head's survival falls below this (None: never)
    confidence_threshold: Optional[float] = None
    version: int = 1                     # 2: DFlash 2 (dynamic convolutions, a selector)
    dspark: bool = False                 # DSpark: own embedding and head, a Markov head
    logits_start: int = 1                # the block slot of the first prediction
    draft_vocab_size: Optional[int] = None
    markov_rank: int = 0
    confidence: bool = False
    confidence_with_markov: bool = True
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @classmethod
    def from_config(cls, config: dict, path: Path) -> "BlockArgs":
        """The drafter's settings from its config.json, each checked (one sentence)."""
        where = path / "config.json"
        if _is_speculators_dspark(config):
            config = _from_speculators(config, where)
        dspark = any("DSpark" in str(a) for a in config.get("architectures") or ())
        if dspark:
            for test, what in _DSPARK_UNSUPPORTED:
                if test(config):
                    raise EagleError(f"{where} is a DSpark drafter with {what}, which eagle_mlx "
                                     "does not read yet.")
        f = _Fields(config, where)
        for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                    "num_hidden_layers", "vocab_size"):
            if key not in config:
                raise EagleError(f"{where} has no \"{key}\": not a DFlash drafter's config.")
            f.whole(key, config[key])
        H, heads = config["hidden_size"], config["num_attention_heads"]
        layers = config["num_hidden_layers"]
        mask = f.get("mask_token_id")
        if mask is None:
            raise EagleError(f"{where} has no \"mask_token_id\" (in \"dflash_config\"): a "
                             "DFlash drafter needs the token its blocks are filled with.")
        f.whole("mask_token_id", mask, 0)
        n_target = config.get("num_target_layers")
        if n_target is not None:
            f.whole("num_target_layers", n_target)
        types, window = _layer_types(f, layers)
        theta, scaling = _rope(f)
        cap = f.get("final_logit_softcapping")
        causal = f.get("causal", f.get("is_causal"))
        version = 2 if "DFlash2DraftModel" in (config.get("architectures") or ()) else 1
        two = _dspark_fields(f) if dspark else {}
        if version == 2:
            two.update(_dflash2_fields(f, H))
        return cls(
            hidden_size=H, intermediate_size=config["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=f.whole("num_key_value_heads",
                                        config.get("num_key_value_heads") or heads),
            head_dim=f.whole("head_dim", config.get("head_dim") or H // heads),
            num_hidden_layers=layers, vocab_size=config["vocab_size"],
            target_layer_ids=_layer_ids(f, n_target, layers),
            block_size=f.whole("block_size", f.get("block_size", 16), 2),
            mask_token_id=mask,
            rms_norm_eps=f.number("rms_norm_eps", config.get("rms_norm_eps", 1e-6)),
            rope_theta=f.number("rope_theta", theta), rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings") or 40960,
            attention_bias=bool(config.get("attention_bias", False)),
            layer_types=types, sliding_window=window,
            is_causal=None if causal is None else bool(causal),
            num_target_layers=n_target,
            input_embedding_scale=f.number("input_embedding_scale",
                                           f.get("input_embedding_scale", 1.0)),
            output_multiplier=f.number("output_multiplier", f.get("output_multiplier", 1.0)),
            final_logit_softcapping=None if cap is None else f.number(
                "final_logit_softcapping", cap),
            draft_window=f.get("draft_window_size"),
            version=version, **two,
        )

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def causal(self, layer: int) -> bool:
        return self.window(layer) is not None if self.is_causal is None else self.is_causal


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """The tap layers the reference picks where a config names none: one in the middle for
    a single draft layer, else spread evenly over layers 1 .. L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class ContextKV:
    """One layer's keys and values of committed context positions, in a buffer that grows
    in steps; `base` is the position of its first row (a window keeps the last `keep`
    positions: the buffer is compacted once it holds a step more than that)."""

    def __init__(self, keep: Optional[int] = None):
        self.keys = self.values = None
        self.base, self.length, self.keep = 0, 0, keep

    @property
    def end(self) -> int:
        return self.base + self.length

    def append(self, k: mx.array, v: mx.array) -> None:
        """k, v [1, kv heads, n, D] of the positions `end` .. `end + n - 1`."""
        n = k.shape[2]
        if self.keep is not None and self.length + n > self.keep + KV_STEP:
            drop = self.length + n - self.keep
            if drop >= self.length:  # everything held falls out of the window
                k, v = k[..., n - self.keep:, :], v[..., n - self.keep:, :]
                self.base += self.length + n - self.keep
                self.keys = self.values = None
                self.length, n = 0, self.keep
            else:
                self.keys = self.keys[..., drop: self.length, :]
                self.values = self.values[..., drop: self.length, :]
                self.base += drop
                self.length -= drop
        if self.keys is None or self.length + n > self.keys.shape[2]:
            grow = ((self.length + n) // KV_STEP + 1) * KV_STEP
            shape = (1, k.shape[1], grow, k.shape[3])
            keys, values = mx.zeros(shape, k.dtype), mx.zeros(shape, v.dtype)
            if self.length:
                keys[..., : self.length, :] = self.keys[..., : self.length, :]
                values[..., : self.length, :] = self.values[..., : self.length, :]
            self.keys, self.values = keys, values
        self.keys[..., self.length: self.length + n, :] = k
        self.values[..., self.length: self.length + n, :] = v
        self.length += n

    def fetch(self):
        """The rows in view (a window: the last `keep`), with the position of the first."""
        a = 0 if self.keep is None else max(self.length - self.keep, 0)
        return (self.keys[..., a: self.length, :], self.values[..., a: self.length, :],
                self.base + a)

    def truncate(self, position: int) -> None:
        """Forget the positions from `position` on (before `base`: all it holds, and it
        continues from there with less context)."""
        if position < self.base:
            self.base, self.length = position, 0
        else:
            self.length = min(self.length, position - self.base)

    def arrays(self) -> list:
        return [] if self.keys is None else [self.keys, self.values]


def head_name(head) -> str:
    """How sentences name a block drafter: DFlash, DFlash 2 or DSpark."""
    return {"dflash": "DFlash", "dflash2": "DFlash 2", "dspark": "DSpark"}[head.kind]


class BlockState:
    """A sequence's block-drafter state: every layer's context keys and values."""

    def __init__(self, keep: List[Optional[int]]):
        self.layers = [ContextKV(k) for k in keep]

    @property
    def offset(self) -> int:
        return self.layers[0].end

    def truncate(self, length: int) -> None:
        for c in self.layers:
            c.truncate(length)


class BlockAttention(nn.Module):
    def __init__(self, args: BlockArgs, layer: int):
        super().__init__()
        H, D = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        bias = args.attention_bias
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=bias)
        self.q_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.scale = D ** -0.5
        self.window, self.causal = args.window(layer), args.causal(layer)
        self.rope = mlxlm.initialize_rope(D, args.rope_theta, False, args.rope_scaling,
                                          args.max_position_embeddings)

    def _kv(self, x: mx.array, offset: int):
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, T, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def context(self, ctx: mx.array, cache: ContextKV) -> None:
        """Keep the keys and values of new context rows ctx [1, n, H] (from `cache.end`)."""
        k, v = self._kv(ctx, cache.end)
        cache.append(k, v)

    def __call__(self, x: mx.array, cache: ContextKV, start: int) -> mx.array:
        """The block x [1, L, H] at positions start .. start + L - 1, after the context."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start)
        k, v = self._kv(x, start)
        S = 0
        if cache.length:
            ck, cv, first = cache.fetch()
            S = ck.shape[2]
            k, v = mx.concatenate([ck, k], axis=2), mx.concatenate([cv, v], axis=2)
        mask = None
        if self.window is not None or self.causal:
            qpos = start + mx.arange(L)[:, None]
            kpos = mx.concatenate([first + mx.arange(S), start + mx.arange(L)]) if S \
                else start + mx.arange(L)
            mask = mx.ones((L, S + L), dtype=mx.bool_)
            if self.causal:
                mask = mask & (kpos[None, :] <= qpos)
            if self.window is not None:
                mask = mask & (qpos - kpos[None, :] < self.window)
                if not self.causal:
                    mask = mask & (kpos[None, :] - qpos < self.window)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DynamicConv(nn.Module):
    """DFlash 2's grouped dynamic causal convolution along the block (position 0: the root):
    out[t] = sum over offsets o of (base[o] + dynamic[t, o, group]) * x[t - o], the dynamic
    kernels projected from the input, one set before a sublayer and one after it."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = mx.zeros((2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def _convolve(self, x, dynamic, base):
        B, L, H = x.shape
        G = H // self.group
        blocks = x.reshape(B, L, G, self.group)
        out = mx.zeros_like(blocks)
        for o in range(self.kernel):
            shifted = blocks if o == 0 else mx.pad(blocks[:, : L - o], [(0, 0), (o, 0), (0, 0),
                                                                         (0, 0)])
            out = out + (base[o].reshape(1, 1, G, self.group) + dynamic[:, :, o, :, None]) \
                * shifted
        return out.reshape(B, L, H)

    def prepare(self, x):
        B, L, H = x.shape
        dynamic = self.kernel_projection(x).reshape(B, L, 2, self.kernel, H // self.group)
        return self._convolve(x, dynamic[:, :, 0], self.base_kernel[0]), dynamic[:, :, 1]

    def finish(self, x, dynamic):
        return self._convolve(x, dynamic, self.base_kernel[1])


class BlockLayer(nn.Module):
    def __init__(self, args: BlockArgs, layer: int):
        super().__init__()
        self.self_attn = BlockAttention(args, layer)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.version == 2:
            H, K, G = args.hidden_size, args.conv_kernel_size, args.conv_group_size
            self.attention_conv = DynamicConv(H, K, G)
            self.mlp_conv = DynamicConv(H, K, G)

    def _sublayer(self, conv, fn, x):
        if conv is None:
            return fn(x)
        x, dynamic = conv.prepare(x)
        return conv.finish(fn(x), dynamic)

    def __call__(self, h, cache: ContextKV, start: int):
        h = h + self._sublayer(getattr(self, "attention_conv", None),
                               lambda x: self.self_attn(x, cache, start),
                               self.input_layernorm(h))
        return h + self._sublayer(getattr(self, "mlp_conv", None), self.mlp,
                                  self.post_attention_layernorm(h))


class CandidateSelector(nn.Module):
    """DFlash 2's walk over each slot's top-k candidates: a candidate scores its logit plus
    a low-rank affinity with the token chosen before it (predecessor and successor
    codebooks, weighted by the slot's projected hidden state)."""

    def __init__(self, args: BlockArgs):
        super().__init__()
        self.top_k = args.selector_top_k
        self.predecessor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.successor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.hidden_projection = nn.Linear(args.hidden_size, args.selector_rank, bias=False)

    def walk(self, hidden, logits, anchor, temp: float = 0.0, key=None):
        """hidden [L, H] and logits [L, V] of slots 1..L after the root `anchor`: the chain
        (tokens [L]) and, when sampling (temp > 0, with `key`), the distribution each token
        was drawn from as log-probabilities over the vocabulary [L, V] (-inf outside the
        slot's candidates)."""
        L, V = logits.shape
        k = min(self.top_k, V)
        cand = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
        unary = mx.take_along_axis(logits, cand, axis=-1)
        h = self.hidden_projection(hidden)
        succ = self.successor_codebook(cand)                              # [L, k, r]
        keys = [None] * L if key is None else list(mx.random.split(key, L))
        prev, tokens, qs = anchor.reshape(()), [], []
        for i in range(L):
            scores = unary[i] + succ[i] @ (self.predecessor_codebook(prev) * h[i])
            if temp > 0:
                lq = scores / temp
                lq = lq - mx.logsumexp(lq)
                j = mx.random.categorical(lq, key=keys[i])
                qs.append(mx.put_along_axis(mx.full((V,), -mx.inf, dtype=lq.dtype),
                                            cand[i], lq, axis=0))
            else:
                j = mx.argmax(scores)
            prev = cand[i][j]
            tokens.append(prev)
        return mx.stack(tokens), (mx.stack(qs) if qs else None)


class MarkovHead(nn.Module):
    """DSpark's sequential bias: logits of slot i += w2(w1[token before it])."""

    def __init__(self, vocab: int, rank: int, out: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, out, bias=False)

    def __call__(self, prev: mx.array) -> mx.array:
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """DSpark's estimate that a slot's token survives verification given the ones before."""

    def __init__(self, dims: int):
        super().__init__()
        self.proj = nn.Linear(dims, 1)

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)[..., 0]


class DFlashHead(DraftHead):
    """A DFlash or DFlash 2 drafter (the module's docstring). Parameter names are the
    checkpoint's."""

    block = True  # drafts a whole block per forward (`decoding.block.BlockDrafter`)

    @property
    def draft_window(self) -> Optional[int]:
        """The context positions kept (its args', which `load(..., draft_window=N)` sets)."""
        return self.args.draft_window

    def __init__(self, args: BlockArgs, source: Optional[HeadSource] = None):
        super().__init__(source)
        self.args = args
        H = args.hidden_size
        self.layers = [BlockLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.fc = nn.Linear(len(args.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if args.version == 2:
            self.candidate_selector = CandidateSelector(args)
        if args.dspark:
            V = args.vocab_size
            out = args.draft_vocab_size or V
            self.embed_tokens = nn.Embedding(V, H)
            self.lm_head = nn.Linear(H, out, bias=False)
            if args.draft_vocab_size:
                self.d2t = mx.zeros((out,), dtype=mx.int64)
            if args.markov_rank:
                self.markov_head = MarkovHead(V, args.markov_rank, out)
            if args.confidence:
                extra = args.markov_rank if args.confidence_with_markov else 0
                self.confidence_head = ConfidenceHead(H + extra)

    kind = property(lambda self: "dspark" if self.args.dspark else
                    "dflash2" if self.args.version == 2 else "dflash")
    # drafts a chain walked position by position (DFlash 2's selector, DSpark's Markov head)
    # (and a DSpark drafter over a reduced vocabulary: its draft ids are mapped as it walks)
    selects = property(lambda self: self.args.version == 2 or bool(self.args.markov_rank)
                       or bool(self.args.draft_vocab_size))
    # the most tokens one block predicts
    predicts = property(lambda self: self.args.block_size - self.args.logits_start)

    feature_size = property(lambda self: len(self.args.target_layer_ids) * self.args.hidden_size)
    target_width = property(lambda self: self.args.hidden_size)
    vocab_size = property(lambda self: self.args.vocab_size)
    draft_vocab_size = property(lambda self: self.args.vocab_size)
    num_layers = property(lambda self: self.args.num_hidden_layers)
    block_size = property(lambda self: self.args.block_size)
    aux_layers = property(lambda self: self.args.target_layer_ids)

    def feature_taps(self, target) -> tuple:
        """Layer id's output is hidden_states[id + 1] in transformers (what the checkpoints
        were trained on): the input of layer id + 1, and for the last layer the output after
        the final norm."""
        from ..targets.target import POST_NORM

        L = target.num_layers
        return tuple(POST_NORM if i + 1 == L else i + 1 for i in self.args.target_layer_ids)

    def make_cache(self, window: Optional[int] = None) -> BlockState:
        """A sequence's state; window: keep the last N context positions (None: the
        checkpoint's `draft_window_size`, else all; a sliding layer keeps its window)."""
        window = window or self.args.draft_window
        keep = []
        for i in range(self.args.num_hidden_layers):
            w = self.args.window(i)
            keep.append(w - 1 if w is not None and (window is None or w - 1 < window)
                        else window)
        return BlockState(keep)

    def cache_layers(self, cache) -> list:
        return cache.layers

    def add_context(self, state: BlockState, features: mx.array) -> None:
        """The committed positions' features [m, F] (from `state.offset`) into every layer's
        context keys and values."""
        ctx = self.hidden_norm(self.fc(features[None]))
        for layer, c in zip(self.layers, state.layers):
            layer.self_attn.context(ctx, c)

    def block_hidden(self, state: BlockState, root: mx.array, target, size: int,
                     first: int = 1) -> mx.array:
        """The block `[root, mask x (size - 1)]` at the position after the context: the
        output hidden states of slots `first` .. size - 1."""
        a = self.args
        ids = mx.concatenate([root.reshape(1).astype(mx.int32),
                              mx.full((size - 1,), a.mask_token_id, dtype=mx.int32)])
        h = (self.embed_tokens if a.dspark else target.embed_tokens)(ids[None])
        if a.input_embedding_scale != 1.0:
            h = h * mx.array(a.input_embedding_scale, h.dtype)
        start = state.offset
        for layer, c in zip(self.layers, state.layers):
            h = layer(h, c, start)
        return self.norm(h[:, first:])[0]

    def predict_hidden(self, state: BlockState, root: mx.array, target, n: int) -> mx.array:
        """The hidden states [n, H] that predict the n tokens after the root: DFlash runs a
        block of n + 1 slots (its first n of n + 1 predictions); DSpark its whole trained block
        (bidirectional: a shorter one is another distribution), read from `logits_start`."""
        if not self.args.dspark:
            return self.block_hidden(state, root, target, n + 1)
        s = self.args.logits_start
        return self.block_hidden(state, root, target, self.args.block_size, first=s)[: n]

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        if "d2t" not in self:
            return draft_ids
        return draft_ids + self.d2t[draft_ids].astype(draft_ids.dtype)

    def chain(self, hidden, logits, root, sampling=None, key=None):
        """The chain walked slot by slot (`selects`): DFlash 2's selector, or DSpark's
        Markov bias on the token chosen before. Greedy: (tokens [n], None); sampling (with the
        generation's `SamplingParams` and a key): (tokens, the target-vocabulary
        log-probabilities each was drawn from [n, V])."""
        if self.args.version == 2:
            return self.candidate_selector.walk(hidden, logits, root,
                                                0.0 if sampling is None else sampling.temp, key)
        n = logits.shape[0]
        keys = [None] * n if key is None else list(mx.random.split(key, n))
        prev, tokens, qs = root.reshape(1), [], []
        for i in range(n):
            step = logits[i] + self.markov_head(prev)[0] if "markov_head" in self else logits[i]
            if sampling is None:
                nxt = mx.argmax(step, keepdims=True)
            else:
                q = sampling.logprobs(step)
                nxt = mx.random.categorical(q, key=keys[i]).reshape(1)
                qs.append(self._widen(q))
            prev = self.to_target_ids(nxt)
            tokens.append(prev)
        return mx.concatenate(tokens), (mx.stack(qs) if qs else None)

    def survival(self, hidden: mx.array, tokens: mx.array, root: mx.array) -> mx.array:
        """DSpark's confidence that a chain's tokens [n] survive verification, each given the
        ones before (its confidence head on each slot's hidden state and the previous token),
        as the running product: the chance the chain is still accepted at each depth."""
        prev = mx.concatenate([root.reshape(1).astype(tokens.dtype), tokens[:-1]])
        x = hidden
        if self.args.confidence_with_markov:
            x = mx.concatenate([hidden, self.markov_head.markov_w1(prev).astype(hidden.dtype)],
                               axis=-1)
        return mx.cumprod(mx.sigmoid(self.confidence_head(x)))

    def _widen(self, q: mx.array) -> mx.array:
        """Draft-vocabulary log-probabilities over the target's vocabulary (-inf elsewhere)."""
        if "d2t" not in self:
            return q
        ids = mx.arange(q.shape[-1]) + self.d2t.astype(mx.int32)
        return mx.put_along_axis(mx.full((self.args.vocab_size,), -mx.inf, dtype=q.dtype),
                                 ids, q, axis=0)

    def logits(self, out_hidden: mx.array, target) -> mx.array:
        a = self.args
        if a.dspark:
            out = as_rows(self.lm_head, out_hidden)
            cap = a.final_logit_softcapping
            return out if not cap else mx.tanh(out / cap) * cap
        out = target.output_projection(out_hidden)
        if a.output_multiplier != 1.0:
            out = out * a.output_multiplier
        cap = a.final_logit_softcapping
        return out if not cap else mx.tanh(out / cap) * cap

    def check_target(self, target, where: str) -> None:
        """The drafter against the target it is loaded with: one sentence each."""
        a, L = self.args, target.num_layers
        bad = [i for i in a.target_layer_ids if not 0 <= i < L]
        if bad:
            raise EagleError(f"{where} reads target layers {bad}, beyond the target's {L} "
                             f"layers (0 .. {L - 1}).")
        if a.num_target_layers is not None and a.num_target_layers != L:
            raise EagleError(f"{where} was made for a target of {a.num_target_layers} layers; "
                             f"this target has {L}.")
        if a.hidden_size != target.hidden_size:
            raise EagleError(f"{where} has hidden size {a.hidden_size}, but the target's is "
                             f"{target.hidden_size}: it reads the target's layers at its own "
                             "width, so they must be equal.")
        if a.dspark and a.vocab_size != target.vocab_size:
            raise EagleError(f"{where} has a vocabulary of {a.vocab_size} tokens; the target's "
                             f"has {target.vocab_size}.")
        if not 0 <= a.mask_token_id < target.vocab_size:
            raise EagleError(f"{where}: mask_token_id {a.mask_token_id} is outside the "
                             f"target's vocabulary of {target.vocab_size} tokens.")
