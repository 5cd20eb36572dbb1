"""The shape every draft head has, and the record of where a head came from.

A head turns (feature, token) pairs into an output hidden state, scores it over its draft
vocabulary and maps draft ids to target ids; it keeps a cache of its own per sequence. The
drafters (`decoding.drafters`, `decoding.tree`) and the checks and writers here use heads
only through this class: EAGLE-1 and EAGLE-3 heads (`eagle.py`) and the models' MTP
modules (`mtp.py`) are its subclasses, each built whole by its loader (`read.py`).
"""

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import EagleError


@dataclass(frozen=True)
class HeadSource:
    """Where a head came from, as its loader read it."""
    path: Optional[Path] = None        # the folder (or the checkpoint of an MTP module)
    layout: Optional[str] = None       # the published layout its checkpoint was in
    made_for: Optional[str] = None     # the target family the checkpoint names, if it does
    model_type: Optional[str] = None   # its config's model_type (an EAGLE-1 head: its target's)
    config: dict = field(default_factory=dict)  # in the official key names, whatever the layout
    held_out_top1: Optional[float] = None  # its trainer's held-out top-1 accuracy

    def replace(self, **changes) -> "HeadSource":
        return replace(self, **changes)


def check_weights(module: nn.Module, weights: dict, what: str) -> None:
    """Every tensor a head's config implies, and no other, each of the shape it implies
    (`what`: the head and its file, as the sentence names them)."""
    expected = dict(tree_flatten(module.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = ([f"missing keys {', '.join(missing[:8])}"] if missing else []) + \
            ([f"unexpected keys {', '.join(unexpected[:8])}"] if unexpected else [])
        raise EagleError(f"{what} does not match its config: {'; '.join(parts)}.")
    for k, v in weights.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise EagleError(f"tensor {k} of {what} has shape {tuple(v.shape)}, but its config "
                             f"implies {tuple(expected[k].shape)}.")


class DraftHead(nn.Module):
    """A draft head (the module docstring). Subclasses set `kind` and implement the
    methods that raise here."""
    kind: str = ""
    draft = None  # a DraftVocab where the head drafts over a reduced vocabulary (EAGLE-1)
    # draft window: each drafting pass attends to the last N positions its cache holds
    # (`load(..., draft_window=N)`; None: all of them)
    draft_window: Optional[int] = None

    def __init__(self, source: Optional[HeadSource] = None):
        super().__init__()
        self.source = source or HeadSource()  # (a plain attribute: not a parameter)

    # ------------------------------------------------------------- what it is
    @property
    def layout(self) -> str:
        return self.source.layout or self.kind

    @property
    def held_out_top1(self) -> Optional[float]:
        return self.source.held_out_top1

    @property
    def feature_size(self) -> int:
        """The width of the features it reads (all taps together)."""
        raise NotImplementedError

    @property
    def target_width(self) -> int:
        """The hidden size of the target it drafts for."""
        return self.feature_size

    declares_target_width = False  # its config names its target's width apart from its own

    @property
    def vocab_size(self) -> int:
        """The target vocabulary it drafts for."""
        raise NotImplementedError

    @property
    def draft_vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def drafts_batched(self) -> bool:
        """A batch's rows can draft in one pass per level over one ragged cache per layer
        (`decoding.tree.draft_dynamic_batch`): EAGLE heads whose layers are all full
        attention."""
        return False

    @property
    def aux_layers(self) -> Optional[tuple]:
        """The target layers its checkpoint names as its taps, if it names them."""
        return None

    # ------------------------------------------------------------- what it does
    def feature_taps(self, target) -> tuple:
        """() for the target's post-norm last hidden state, else the decoder layers whose
        inputs it reads (layer L: the last layer's output)."""
        return ()

    def __call__(self, features, tokens, embed, cache=None, positions=None, mask=None,
                 fed_back=None) -> mx.array:
        """features [B, T, F] paired with tokens [B, T] -> out_hidden [B, T, H]
        (`fed_back`: the features are its own outputs, at deeper draft levels)."""
        raise NotImplementedError

    def logits(self, out_hidden: mx.array, target) -> mx.array:
        raise NotImplementedError

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        return draft_ids

    def make_cache(self):
        raise NotImplementedError

    def cache_layers(self, cache) -> list:
        """Its own cache (`make_cache`) as one KV cache per layer."""
        return cache.layers

    def batch_cache(self, cache):
        """What `__call__` takes as its cache from a batch's (`BatchHeadCache`)."""
        return cache

    def use_draft_vocab(self, vocab) -> None:
        """Draft over a reduced vocabulary (a `DraftVocab`; None: the whole one)."""
        if vocab is not None:
            raise EagleError(f"draft_vocab applies to EAGLE-1 heads; a {self.kind} head drafts "
                             "over the vocabulary it was trained with.")
