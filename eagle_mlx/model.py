"""`load`: a target, optionally paired with an EAGLE head, ready for `stream_generate`."""

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .decoding.lookup import LookupSettings
from .decoding.tree import TreeSpec
from .demo import RANKINGS
from .errors import EagleError, check, is_int
from .heads.draft_vocab import check_size, token_ranking
from .heads.draft_vocab import draft_vocab as reduced_vocab
from .heads.read import load_head
from .targets.load import convert_dtype, load_target, resolve_dtype
from .targets.target import Target
from .training.data import load_conversations
from .tuning import read_tuning

# Tree defaults for Apple Silicon: verifying costs more per extra token on a Mac than on a
# datacentre GPU, so the tree is small (the official 60 nodes / depth 7 / top-10 is tuned
# for A100s). 16 nodes, depth 4, top-4 is the official code's small setting; the benchmark
# measures this machine's verify cost curve and stores a better choice in the user's cache.
DEFAULT_TREE = TreeSpec(total_tokens=16, depth=4, draft_top_k=4)
# (a block drafter's DDTree has the same nodes and candidates, as deep as its block)


@dataclass
class EagleModel:
    target: Target
    head: Optional[object] = None
    head_path: Optional[str] = None
    tuning: Optional[dict] = None  # the benchmark's choice for this head, target and machine
    group: Optional[object] = None  # the mx.distributed group the target is sharded over
    lookup: Optional[object] = None  # LookupSettings: prompt lookup alone or with the head
    # LookupSettings: prompt lookup among adaptive speculation's options (None: not)
    auto_lookup: Optional[object] = None
    measured: Optional[object] = field(default=None, repr=False)  # the machine's costs
    # ... with quantized KV caches, by (bits, group size)
    measured_kv: dict = field(default_factory=dict, repr=False)
    # ... of a row of a batch, by the batch size measured (`costs.batch_size_measured`)
    measured_batch: dict = field(default_factory=dict, repr=False)

    def costs(self, kv=None, batch: Optional[int] = None):
        """This machine's costs for adaptive speculation (measured at first use, cached;
        kv: a KVQuantization, with the caches quantized so; batch: a row's, in a batch of
        that many sequences, from the batch's own verify costs at the largest power of two
        not above it)."""
        from .costs import batch_costs, model_costs
        from .decoding.adaptive import batch_size_measured

        if batch is not None and batch_size_measured(batch) > 1:
            b = batch_size_measured(batch)
            if b not in self.measured_batch:
                self.measured_batch[b] = batch_costs(self, b)
            return self.measured_batch[b]
        if kv is not None:
            key = (kv.bits, kv.group_size)
            if key not in self.measured_kv:
                self.measured_kv[key] = model_costs(self, kv=kv)
            return self.measured_kv[key]
        if self.measured is None:
            self.measured = model_costs(self)
        return self.measured

    def costs_in_use(self, kv=None):
        """The costs adaptive speculation took last (kv: with those quantized caches), as
        measured; None where none were."""
        if kv is not None and (kv.bits, kv.group_size) in self.measured_kv:
            return self.measured_kv[(kv.bits, kv.group_size)]
        return self.measured

    def adaptive_drafter(self, max_kv_size=None, kv=None, timed: bool = True):
        """The drafter of `speculate="auto"`: plain, lookup or the head, chosen every cycle
        (max_kv_size: the target's caches are bounded to that many positions, so no option
        is deeper than their window — the 4 first positions aside — and the costs stop
        growing there; kv: the caches are quantized from `kv.start` on, and the costs
        measured so are taken from there; timed: greedy, the cycles timed — sampling takes
        the costs as read, `Recheck.as_read`)."""
        from .costs import head_options
        from .decoding.adaptive import AdaptiveDrafter

        prior = None if self.head is None else self.head.held_out_top1
        drafter = AdaptiveDrafter(self.costs(), self.target, self.head, head_options(self),
                               self.auto_lookup, head_prior=prior,
                               node_limit=self.target.tree_node_limit(),
                               depth_limit=None if max_kv_size is None else max_kv_size - 4,
                               max_kv_size=max_kv_size,
                               kv_costs=None if kv is None else (self.costs(kv), kv.start),
                               group=self.group, timed=timed)
        if timed and max_kv_size is None and kv is None and self.group is None:
            # (greedy: in a batch its rows choose with the batch's costs; a sampled row
            # keeps a sequence's, so that a seeded row is its run alone)
            drafter.batch_costs = lambda batch: self.costs(batch=batch)
        return drafter

    @property
    def speculates(self) -> bool:
        """False where the benchmark found that speculation does not pay on this machine."""
        return self.speculates_at(None)

    def batch_tuning(self, batch: Optional[int]) -> Optional[dict]:
        """The benchmark's choice for a batch of `batch` sequences (that of the largest
        measured size not above it; None: single-stream decoding, or none measured)."""
        sizes = {int(k): v for k, v in ((self.tuning or {}).get("batch") or {}).items()}
        if batch is None or not sizes or batch < 2:
            return None
        below = [b for b in sizes if b <= batch]
        return sizes[max(below)] if below else None

    def speculates_at(self, batch: Optional[int]) -> bool:
        tuning = self.batch_tuning(batch) or self.tuning or {}
        return self.head is not None and bool(tuning.get("speculate", True))

    def tree_settings(self, batch: Optional[int] = None) -> TreeSpec:
        """The tree to draft: the benchmark's choice (for this batch size, where it measured
        batches) over the default."""
        tuning = self.batch_tuning(batch) or self.tuning or {}
        default = DEFAULT_TREE
        if getattr(self.head, "block", False):  # a DDTree as deep as the drafter's block
            default = default.replace(depth=self.head.predicts - 1)
        return default.replace(**{k: tuning[k] for k in default.asdict() if k in tuning})


def load(target: str, eagle: Optional[str] = None, lazy: bool = False,
         dtype: Optional[str] = None, draft_vocab: Optional[int] = None,
         draft_vocab_data: Optional[str] = None, group=None, lookup=None,
         draft_window: Optional[int] = None, draft_confidence: Optional[float] = None):
    """Load a target (folder, Hugging Face repo id or GGUF file) and, optionally, its EAGLE head.

    `eagle` may be a converted MLX head folder or a published PyTorch one (converted in
    memory). dtype: "auto" (default: float32 on the CPU, as stored on a GPU), "stored",
    "float32", "float16" or "bfloat16", for the target and the head alike.
    draft_vocab: draft an EAGLE-1 head over the N target tokens most frequent in answers
    (ShareGPT, or the ShareGPT-style file `draft_vocab_data`, counted with the target's
    tokenizer) instead of the whole vocabulary; 0: the whole vocabulary; None: the
    benchmark's choice for this head, target and machine if it made one, else the whole.
    group: an `mx.distributed` group (`mx.distributed.init()` under `mlx.launch`): the
    target is sharded over its ranks (tensor parallel), the head runs whole on each; every
    rank then runs the same `stream_generate` calls.
    lookup: None (default): prompt lookup (drafts copied from the context) is one of the
    options adaptive speculation (`speculate="auto"`) chooses from; True (or a
    `lookup.LookupSettings`): also whenever speculation is forced, alone (eagle=None) or as
    branches of the head's tree within its node budget; False: never.
    draft_window: a block drafter keeps the context of the last N positions only; an EAGLE
    head or MTP module attends, each drafting pass, to the last N positions its cache holds
    (long contexts: the draft cost stays bounded; None: the checkpoint's own window, else
    all).
    draft_confidence: a DSpark drafter's chain ends, each cycle, where its confidence head
    says it survives verification with less than this probability (None: never).
    Returns (EagleModel, tokenizer); with eagle=None and no lookup decoding is plain.
    """
    convert_to = resolve_dtype(dtype)
    group, auto, lookup = _checked(lazy, draft_vocab, draft_vocab_data, draft_window,
                                   draft_confidence, group, lookup)
    t, tokenizer = load_target(target, lazy=lazy, dtype=dtype, group=group)
    if eagle is None:
        tuning = read_tuning(None, t.path, t.dtype) if auto else None
        return EagleModel(t, group=group, lookup=_calibrated(lookup, tuning),
                          auto_lookup=_calibrated(lookup or LookupSettings(), tuning)
                          if auto else None), tokenizer
    head = load_head(eagle, t)
    _set_draft_limits(head, eagle, draft_window, draft_confidence)
    if convert_to is not None:
        convert_dtype(head, convert_to)
        if not lazy:
            mx.eval(head.parameters())
    path = head.source.path
    tuning = read_tuning(path, t.path, t.dtype)
    if draft_vocab is None and tuning and tuning.get("draft_vocab"):
        draft_vocab = tuning["draft_vocab"]  # the benchmark's choice on this machine
    if draft_vocab:
        attach_draft_vocab(head, t, tokenizer, draft_vocab, draft_vocab_data)
    return EagleModel(t, head, str(path), tuning, group, _calibrated(lookup, tuning),
                      _calibrated(lookup or LookupSettings(), tuning) if auto else None), tokenizer


def _checked(lazy, draft_vocab, draft_vocab_data, draft_window, draft_confidence, group,
             lookup):
    """`load`'s arguments checked: (the group, or None on one machine; whether auto may
    choose prompt lookup; the lookup settings forced, or None)."""
    check(isinstance(lazy, bool), f"lazy must be True or False (got {lazy!r}).", "lazy")
    check(draft_vocab is None or (is_int(draft_vocab) and draft_vocab >= 0),
          f"draft_vocab must be a whole number of tokens (0: the whole vocabulary) or None "
          f"(got {draft_vocab!r}).", "draft_vocab")
    check(draft_vocab_data is None or isinstance(draft_vocab_data, (str, Path)),
          "draft_vocab_data must be the path of a ShareGPT-style file, given as a string.",
          "draft_vocab_data")
    check(draft_window is None or (is_int(draft_window) and draft_window > 0),
          f"draft_window must be a positive whole number of positions or None (got "
          f"{draft_window!r}).", "draft_window")
    check(draft_confidence is None or (isinstance(draft_confidence, (int, float)) and
                                       not isinstance(draft_confidence, bool) and
                                       0 < draft_confidence < 1),
          f"draft_confidence must be a probability between 0 and 1 or None (got "
          f"{draft_confidence!r}).", "draft_confidence")
    if group is not None and group.size() < 2:
        group = None
    auto = lookup is not False
    if lookup is True:
        lookup = LookupSettings()
    elif lookup is False or lookup is None:
        lookup = None
    elif not isinstance(lookup, LookupSettings):
        raise EagleError(f"lookup must be True, False or an eagle_mlx.LookupSettings "
                         f"(got {type(lookup).__name__}).")
    else:
        lookup.check()
    return group, auto, lookup


def _set_draft_limits(head, eagle, draft_window, draft_confidence) -> None:
    """`load`'s draft_window and draft_confidence, set on the drafters they apply to."""
    if draft_window is not None:
        check(getattr(head, "block", False) or hasattr(head, "cache_layers") and
              not getattr(head, "reads_kv", False),
              "draft_window applies to block drafters, EAGLE heads and MTP modules; "
              f"{eagle} is a {head.kind} drafter.", "draft_window")
        if getattr(head, "block", False):
            head.args.draft_window = int(draft_window)
        else:
            head.draft_window = int(draft_window)
    if draft_confidence is not None:
        check(getattr(head, "block", False) and "confidence_head" in head,
              f"draft_confidence applies to DSpark drafters with a confidence head; {eagle} is "
              f"a {head.kind} {'drafter without one' if getattr(head, 'block', False) else 'head'}.",
              "draft_confidence")
        head.args.confidence_threshold = float(draft_confidence)


def _calibrated(lookup, tuning):
    """Lookup settings with the acceptance by match length the benchmark measured (stored
    with the head's tuning, or the target's alone without a head), where it measured one;
    the caller's settings object is left as it is."""
    if lookup is None or not (tuning and tuning.get("lookup_accept")):
        return lookup
    return replace(lookup, accept={int(k): float(v) for k, v in tuning["lookup_accept"].items()})


def attach_draft_vocab(head, target, tokenizer, n, data=None) -> None:
    """Make an EAGLE-1 head draft over the n most frequent target tokens."""
    if head.kind != "eagle1":
        raise EagleError("draft_vocab applies to EAGLE-1 heads; an EAGLE-3 head drafts over the "
                         "vocabulary it was trained with (its d2t).")
    check_size(target, n)  # before counting tokens for the ranking
    order = token_ranking(tokenizer, target.vocab_size, data, load_conversations,
                          shipped=(RANKINGS,))
    head.use_draft_vocab(reduced_vocab(target, order, n))
