"""Gemma 4's assistant drafters (`model_type: gemma4_assistant`, Google's
`gemma-4-*-it-assistant`; the 12B's `gemma4_unified_assistant`, the same module): a few Gemma 4 decoder layers with no keys or values of their own.
Each step reads the target's committed keys and values of its last sliding and last full
layer that keep them (one query per step, at a fixed position), takes
`pre_projection(cat(target_embedding(token) · √H, h_prev))` as input and feeds
`post_projection(out)` back as the next step's `h_prev`; the first `h_prev` is the target's
post-norm hidden state of the last committed position.

The layers are mlx-lm's own Gemma 4 decoder layers, every one KV-shared. A sliding layer
sees the last `sliding_window` + 1 committed positions (what transformers' bidirectional
window, flipped to the past, lets a query see), a full layer all of them.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .. import mlxlm
from ..errors import EagleError
from ..targets.load import gemma4_overrides
from .base import DraftHead, HeadSource


ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")


def is_assistant_config(config: dict) -> bool:
    return config.get("model_type") in ASSISTANT_TYPES


class AssistantState:
    """What an assistant keeps of a sequence: how many positions it has seen, the target's
    post-norm hidden state of the last of them, and where the target's committed keys and
    values are (its caches, the sequence's row where they are a batch's, and how many
    positions they hold), handed over before each proposal."""

    def __init__(self):
        self.offset = 0
        self.hidden: Optional[mx.array] = None   # [1, backbone]
        self.caches, self.row, self.n = None, None, 0

    def truncate(self, length: int) -> None:
        if length < self.offset:
            self.offset, self.hidden = length, None


@dataclass
class AssistantArgs:
    text: object              # mlx-lm's gemma4_text ModelArgs, every layer KV-shared
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32

    @classmethod
    def from_config(cls, config: dict, path: Path) -> "AssistantArgs":
        ModelArgs = mlxlm.model_module("gemma4_text").ModelArgs
        where = path / "config.json"
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise EagleError(f"{where} has no \"text_config\": not a Gemma 4 assistant's config.")
        for key, bad in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False)):
            if text.get(key, bad) not in (0, False, None):
                raise EagleError(f"{where}: a Gemma 4 assistant has no {key} (got "
                                 f"{text[key]!r}).")
        text = dict(text, **gemma4_overrides(text))
        text.update(num_kv_shared_layers=text.get("num_hidden_layers"),
                    use_double_wide_mlp=False, hidden_size_per_layer_input=0,
                    vocab_size_per_layer_input=0)
        try:
            args = ModelArgs.from_dict(text)
        except TypeError as e:
            raise EagleError(f"{where}: its text_config is not a Gemma 4 one ({e}).") from None
        if "full_attention" not in args.layer_types or \
                "sliding_attention" not in args.layer_types:
            raise EagleError(f"{where}: a Gemma 4 assistant has sliding and full layers "
                             f"(got {args.layer_types}).")
        return cls(args, int(config.get("backbone_hidden_size") or 0),
                   bool(config.get("use_ordered_embeddings", False)),
                   int(config.get("num_centroids", 2048)),
                   int(config.get("centroid_intermediate_top_k", 32)))


class _Inner(nn.Module):
    def __init__(self, text):
        super().__init__()
        DecoderLayer = mlxlm.model_module("gemma4_text").DecoderLayer
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = [DecoderLayer(text, i) for i in range(text.num_hidden_layers)]
        self.norm = nn.RMSNorm(text.hidden_size, eps=text.rms_norm_eps)


class MaskedEmbedding(nn.Module):
    """The E2B/E4B output head: the `top_k` best of `num_centroids` clusters, scored through
    the tied embedding at their tokens' canonical positions (`token_ordering`), every other
    token one below the query's lowest score."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        text = args.text
        self.top_k, self.clusters = args.centroid_intermediate_top_k, args.num_centroids
        self.centroids = nn.Linear(text.hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((text.vocab_size,), dtype=mx.int32)

    def __call__(self, h: mx.array, weight: mx.array) -> mx.array:
        V = self.token_ordering.shape[0]
        per = V // self.clusters
        top = mx.argpartition(-self.centroids(h), kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        canonical = self.token_ordering.astype(mx.int32).reshape(self.clusters, per)[top]
        canonical = canonical.reshape(*h.shape[:-1], -1)                     # [..., k*per]
        scores = (weight[canonical] @ h[..., None])[..., 0]
        # (transformers fills with the whole call's lowest score less one; here each query's
        # own, so that a tree node's distribution does not depend on the others drafted
        # with it — the same for one query)
        low = scores.min(axis=-1, keepdims=True) - 1.0
        out = mx.broadcast_to(low, (*h.shape[:-1], V)).astype(h.dtype)
        return mx.put_along_axis(out, canonical, scores, axis=-1)


class Gemma4Assistant(DraftHead):
    """The assistant's module (the module's docstring); parameter names are transformers'."""

    kind = "gemma4_assistant"

    def __init__(self, args: AssistantArgs, source: Optional[HeadSource] = None):
        super().__init__(source)
        self.args = args
        text = args.text
        self.model = _Inner(text)
        B = args.backbone_hidden_size
        self.pre_projection = nn.Linear(2 * B, text.hidden_size, bias=False)
        self.post_projection = nn.Linear(text.hidden_size, B, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedding(args)

    reads_kv = True  # drafts from the target's committed keys and values (`kv_layers`)
    feature_size = property(lambda self: self.args.backbone_hidden_size)
    vocab_size = property(lambda self: self.args.text.vocab_size)
    draft_vocab_size = property(lambda self: self.args.text.vocab_size)
    num_layers = property(lambda self: self.args.text.num_hidden_layers)

    def make_cache(self) -> AssistantState:
        return AssistantState()

    def cache_layers(self, cache) -> None:
        return None  # (no keys or values of its own)

    def step(self, x: mx.array, shared: Dict[str, tuple], position) -> Tuple[mx.array, mx.array]:
        """One drafting step for N sequences of L queries each (queries never see each
        other: a sequence's L are a tree level's nodes): x [N, L, 2·backbone] (the embedded
        token scaled by √backbone, then h_prev), `shared` the target's committed keys and
        values by layer type, roped and normed as the target keeps them: (keys, values)
        [1 or N, kv heads, n, D], every position committed, or (keys, values, held) with
        `held` [N] how many of the slots each sequence holds (the rest padding); `position`
        the queries' position (or [N], each sequence's). Returns (logits [N, L, V], the next
        h_prev [N, L, backbone])."""
        window = self.args.text.sliding_window + 1
        h = self.pre_projection(x)
        N = h.shape[0]
        masks = {}
        for kind, kv in shared.items():
            k, v = kv[:2]
            if len(kv) == 3:  # ragged: each sequence's own slots (within the window)
                held = mx.array(kv[2])[:, None]
                slot = mx.arange(k.shape[2])[None, :]
                seen = slot < held
                if kind == "sliding_attention":
                    seen = seen & (slot >= held - window)
                masks[kind] = (seen[:, None, None, :], k, v)
                continue
            if kind == "sliding_attention" and k.shape[2] > window:
                k, v = k[..., -window:, :], v[..., -window:, :]
            if k.shape[0] != N:
                k = mx.broadcast_to(k, (N, *k.shape[1:]))
                v = mx.broadcast_to(v, (N, *v.shape[1:]))
            masks[kind] = (None, k, v)
        if not isinstance(position, int):
            position = mx.array(position)
        for layer in self.model.layers:
            mask, k, v = masks[layer.layer_type]
            h, _, _ = layer(h, mask, None, shared_kv=(k, v), offset=position)
        h = self.model.norm(h)
        if "masked_embedding" in self:
            logits = self.masked_embedding(h, self.model.embed_tokens.weight)
        else:
            logits = self.model.embed_tokens.as_linear(h)
        return logits, self.post_projection(h)

    def feature_taps(self, target) -> tuple:
        return ()  # (the post-norm hidden state)

    def kv_layers(self, target) -> Dict[str, int]:
        """The target layers whose keys and values each of its layer types reads: the last
        sliding and the last full layer that keep their own (transformers' "store" layers)."""
        inner = target.family.inner
        types = [layer.layer_type for layer in inner.layers]
        prev = list(inner.previous_kvs)
        return {kind: max(j for j, t in enumerate(types) if t == kind and prev[j] == j)
                for kind in ("sliding_attention", "full_attention")}

    def embed_scale(self, target) -> float:
        return float(target.family.inner.embed_scale)

    def check_target(self, target, where: str) -> None:
        """One sentence where the assistant does not fit the target."""
        name = target.path or "the target"
        if not str(target.model_type).startswith("gemma4"):
            raise EagleError(f"{where} is a Gemma 4 assistant; target {name} is "
                             f"{target.model_type}, not Gemma 4.")
        if self.args.backbone_hidden_size != target.hidden_size:
            raise EagleError(f"{where} was made for a Gemma 4 of hidden size "
                             f"{self.args.backbone_hidden_size}; target {name} has "
                             f"{target.hidden_size} (another size of the family).")
        if self.vocab_size != target.vocab_size:
            raise EagleError(f"{where} has a vocabulary of {self.vocab_size} tokens; target "
                             f"{name} has {target.vocab_size}.")
        layers = self.kv_layers(target)
        inner = target.family.inner
        for layer in self.model.layers:
            attn = inner.layers[layers[layer.layer_type]].self_attn
            mine = layer.self_attn
            if (attn.head_dim, attn.n_kv_heads) != (mine.head_dim, mine.n_kv_heads):
                raise EagleError(
                    f"{where}: its {layer.layer_type.replace('_', ' ')} layers read "
                    f"{mine.n_kv_heads} key/value heads of {mine.head_dim}, but target {name} "
                    f"keeps {attn.n_kv_heads} of {attn.head_dim} (another size of the family).")
