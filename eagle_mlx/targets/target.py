"""Tree-capable targets: mlx-lm's models of the families in SUPPORTED_MODEL_TYPES, verified
a whole tree at a time.

mlx-lm builds and loads the model (HF folders, sharded and mlx-community checkpoints,
quantized weights, the tokenizer with its chat template). `Target` runs the same
modules with what verification needs and mlx-lm's forward lacks: per-token position
ids, an explicit mask over cache + new tokens (each sliding-window layer: within its
window), the post-norm hidden state (EAGLE-1/2 features) and the inputs of chosen decoder
layers (EAGLE-3 features). How each family runs its layers: `families.py`; loading a
checkpoint into a Target: `load.py`.
"""

import os
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .. import mlxlm
from .cache import QuantizedTreeKVCache, RaggedKVCache, TreeKVCache
from .families import FAMILIES, AttentionMechanism, Forward, LinearAttentionMechanism, \
    RopeContext, family_of, install_positions, untruncated_yarn
from .layers import as_rows

# mlx-lm decoders whose tree forward is tested against transformers: the standard shape
# (norm -> attention with q/k/v/o and RoPE, optional q/k norms -> norm -> MLP or sparse
# MoE) and the sliding-window / attention-sink families
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

ATTENTION = AttentionMechanism()


# the tap of the final output after the model's last norm (transformers' last hidden state)
POST_NORM = -1

TREE_STATE_FRACTION = 8  # a tree's recurrent states may take 1/8 of the machine's memory


def machine_memory() -> int:
    """Bytes of memory the device has (a GPU's working set where MLX reports one)."""
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


class TargetCaches:
    """A target's caches, one per layer that keeps one (`mechanisms`: each layer's mechanism,
    set by `Target`): made, accepted into, snapshotted, quantized, cut back, joined into a
    batch and read back."""

    mechanisms: list

    def make_cache(self, max_kv_size: Optional[int] = None) -> list:
        """One cache per layer that keeps one (KV-shared layers read another's); max_kv_size:
        full-attention layers keep mlx-lm's bounded cache of that many positions."""
        return [m.make_cache(max_kv_size) if isinstance(m, AttentionMechanism) else
                m.make_cache() for m in self.mechanisms if m.source is None]

    @property
    def bounds_kv(self) -> bool:
        """Whether max_kv_size can bound this model's caches: every layer attends to every
        position (mlx-lm's bounded cache replaces each layer's; a model with sliding windows,
        KV sharing or recurrent layers keeps its own)."""
        return all(isinstance(m, AttentionMechanism) and m.window is None and m.source is None
                   for m in self.mechanisms)

    def accept(self, caches, start: int, rows) -> None:
        """After a verify pass: every layer keeps the accepted tree rows `rows` (absolute
        positions, root first; a list, or an array) at start.."""
        for m, c in zip(self.mechanisms, caches):
            m.accept(c, start, rows)

    @staticmethod
    def snapshots(caches) -> bool:
        """Whether every cache can `snapshot` (not a recurrent state, not a bounded one)."""
        return all(isinstance(c, (TreeKVCache, QuantizedTreeKVCache)) for c in caches)

    @classmethod
    def snapshot(cls, caches) -> Optional[list]:
        """What `restore` needs to forget the updates made to `caches` after this call (a
        forward built but not evaluated; it copies every buffer); None where a cache cannot
        (`snapshots`)."""
        return [c.snapshot() for c in caches] if cls.snapshots(caches) else None

    @staticmethod
    def quantize(caches, kv) -> bool:
        """mlx-lm's switch to quantized caches (`maybe_quantize_kv_cache`) for `kv` (a
        `KVQuantization`; None: none): every full-attention cache, once it holds
        `kv.start` positions, packed in place in the list (sliding windows and recurrent
        states stay as they are, as in mlx-lm). Whether every cache that can be is now."""
        if kv is None:
            return True
        mlxlm.maybe_quantize_kv_cache(caches, kv.start, kv.group_size, kv.bits)
        return not any(hasattr(c, "to_quantized") for c in caches)

    @staticmethod
    def restore(caches, saved: list) -> None:
        for c, s in zip(caches, saved):
            c.restore(s)

    def reusable(self, caches, length: int) -> bool:
        """Whether every layer can be cut back to its first `length` positions exactly (a
        sliding-window layer has dropped what its window no longer sees)."""
        return all(m.reusable(c, length) for m, c in zip(self.mechanisms, caches))

    def truncate(self, caches, length: int) -> None:
        """Every layer forgets what follows the first `length` positions."""
        for m, c in zip(self.mechanisms, caches):
            m.truncate(c, length)

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
            bc.keep(kept)

    @staticmethod
    def cache_arrays(caches) -> list:
        return [a for c in caches for a in c.arrays()]

    def _cache_of(self, caches, layer: int):
        """Layer `layer`'s own cache in `caches` (one per layer that keeps one)."""
        kept = [i for i, m in enumerate(self.mechanisms) if m.source is None]
        return caches[kept.index(layer)]

    def committed_kv(self, caches, layer: int, n: int, row: Optional[int] = None):
        """The keys and values layer `layer` keeps for positions before `n`, in position
        order ([1, kv heads, rows, D], as its attention reads them: roped, normed), and the
        position of the first row (a window keeps only its last ones). Views of the cache's
        buffer, no copy. row: the sequence's row where `caches` are a batch's."""
        cache = self._cache_of(caches, layer)
        if row is not None:
            k, v = cache.row(row)
            base = cache.bases[row]
        else:
            k, v, base = cache.keys, cache.values, getattr(cache, "base", 0)
        return k[..., : n - base, :], v[..., : n - base, :], base

    def batch_committed_kv(self, caches, layer: int, rows: Sequence[int]):
        """`committed_kv` for several rows of a batch at once: keys and values
        [len(rows), kv heads, slots, D] (views where `rows` are the whole batch in order)
        and how many slots each row holds (its committed positions, first ones first)."""
        cache = self._cache_of(caches, layer)
        rows = list(rows)
        k, v = cache.keys, cache.values
        if rows != list(range(len(cache.lengths))):
            idx = mx.array(rows, dtype=mx.int32)
            k, v = k[idx], v[idx]
        held = [cache.held[r] for r in rows]
        return k[..., : max(held), :], v[..., : max(held), :], held


class Target(TargetCaches):
    """A loaded mlx-lm model plus the tree forward pass (its caches: `TargetCaches`)."""

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

    @property
    def kv_shared(self) -> bool:
        """Whether some layers read another layer's keys and values (Gemma 4)."""
        return any(getattr(m, "source", None) is not None for m in self.mechanisms)

    @property
    def attention_sinks(self) -> bool:
        """Whether attention layers add learned sinks (gpt-oss)."""
        return any("sinks" in getattr(layer, "self_attn", {}) for layer in self.layers)

    def kv_head_dims(self) -> set:
        """The key/value head sizes of the full-attention layers that keep a cache (what
        `kv_group_size` must divide), where the layers say (projection rows / kv heads)."""
        dims = set()
        for m, layer in zip(self.mechanisms, self.layers):
            attn = getattr(layer, "self_attn", None)
            if not isinstance(m, AttentionMechanism) or m.window is not None or attn is None:
                continue
            heads = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads",
                                                                 None)
            proj = getattr(attn, "k_proj", None)
            if heads and proj is not None and "weight" in proj:
                dims.add(int(proj.weight.shape[0]) // int(heads))
        return dims

    def tree_node_limit(self) -> Optional[int]:
        """The most tree nodes whose recurrent states fit in TREE_STATE_FRACTION of this
        machine's memory (None: no bound, attention-only)."""
        per_node = self.node_state_bytes
        return None if not per_node else max(2, tree_state_budget() // per_node)

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

    def lm_head(self, hidden: mx.array) -> mx.array:
        """Logits of hidden states [..., H] (any leading shape), computed as mlx-lm's own
        forward computes them: on [B, T, H] rows (`as_rows`)."""
        return as_rows(self.family.logits, hidden)

    def output_projection(self, hidden: mx.array) -> mx.array:
        """The output projection without the model's final soft-cap (what a block drafter
        scores its slots with)."""
        return as_rows(self.family.projection, hidden)

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
              number of layers) is the last layer's output, before the final norm;
              `POST_NORM` the output after it (transformers' last hidden state).
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
        tapped[POST_NORM] = out = family.inner.norm(h)
        return out, [tapped[i] for i in taps]
