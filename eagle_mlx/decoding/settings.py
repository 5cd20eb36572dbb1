"""Generation settings as one typed object, and the checks on every value a user gives
(sampling, tree, context, seed), with no heavy import: a tool refuses a bad flag before it
loads mlx-lm, let alone a model. The API, every command-line tool, the benchmark and the
server validate through here (each naming the parameter as its user knows it)."""

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence, Union

import numpy as np

from ..errors import check, is_int
from .tree import StaticTree


def _is_real(x) -> bool:
    return (is_int(x) or isinstance(x, (float, np.floating))) and math.isfinite(x)


# Upper bounds on the tree, each with its reason
MAX_DRAFT_TOP_K = 64    # each draft level ranks draft_top_k ** 2 candidates
MAX_DEPTH = 64          # each level is one head forward per cycle
MAX_TREE_NODES = 1024   # the verify pass attends between every pair of tree nodes
MAX_SEED = 2**64 - 1    # MLX's random seed is an unsigned 64-bit integer
MAX_TOP_LOGPROBS = 20   # alternatives per token a response may report (as OpenAI's API)

# KV cache quantization, as mlx-lm's generate_step takes it: the bits and group sizes MLX's
# affine quantization packs, and mlx-lm's default start
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_QUANTIZED_KV_START = 5000


@dataclass(frozen=True)
class KVQuantization:
    """Quantized KV caches (mlx-lm's `kv_bits`, `kv_group_size`, `quantized_kv_start`):
    every full-attention cache packed to `bits` in groups of `group_size` once it holds
    `start` positions."""

    bits: int
    group_size: int = 64
    start: int = DEFAULT_QUANTIZED_KV_START


def static_top_k(tree_choices) -> int:
    """The fewest children per node a static tree's paths need: its highest rank + 1."""
    return 1 + max(r for c in tree_choices for r in c)


def check_values(max_tokens=256, temp=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None,
                 total_tokens=None, depth=None, draft_top_k=None, tree_choices=None,
                 max_context=None, name=lambda n: n) -> None:
    """Check sampling and tree values before anything is loaded: EagleError naming the
    parameter (`name` turns a parameter into the flag a command-line tool calls it)."""
    def need(ok, param, what, value):
        check(ok, f"{name(param)} must be {what} (got {value!r}).", param)

    need(is_int(max_tokens) and max_tokens >= 1, "max_tokens", "a whole number of at least 1",
         max_tokens)
    need(_is_real(temp) and temp >= 0, "temp", "0 (greedy) or a positive finite number", temp)
    need(_is_real(top_p) and 0 < top_p <= 1, "top_p", "a number in (0, 1]", top_p)
    need(_is_real(min_p) and 0 <= min_p <= 1, "min_p", "a number in [0, 1] (0: off)", min_p)
    need(is_int(top_k) and top_k >= 0, "top_k", "0 (off) or a positive whole number", top_k)
    need(seed is None or (is_int(seed) and 0 <= seed <= MAX_SEED), "seed",
         "a whole number from 0 to 2**64 - 1", seed)
    need(max_context is None or (is_int(max_context) and max_context >= 2), "max_context",
         "a whole number of at least 2", max_context)
    need(draft_top_k is None or (is_int(draft_top_k) and 1 <= draft_top_k <= MAX_DRAFT_TOP_K),
         "draft_top_k", f"from 1 to {MAX_DRAFT_TOP_K} (each draft level ranks draft_top_k "
         "squared candidates)", draft_top_k)
    need(depth is None or (is_int(depth) and 1 <= depth <= MAX_DEPTH), "depth",
         f"from 1 to {MAX_DEPTH} (each level costs a head forward every cycle)", depth)
    need(total_tokens is None or (is_int(total_tokens) and 2 <= total_tokens <= MAX_TREE_NODES),
         "total_tokens", f"from 2 to {MAX_TREE_NODES} (the verify pass attends between every "
         "pair of tree nodes)", total_tokens)
    if tree_choices is not None:
        paths_ok = (isinstance(tree_choices, (list, tuple)) and len(tree_choices) > 0 and all(
            isinstance(c, (list, tuple)) and len(c) > 0 and all(is_int(r) and r >= 0 for r in c)
            for c in tree_choices))
        need(paths_ok, "tree_choices", "a non-empty list of paths of child ranks such as "
             "[[0], [1], [0, 0]]", tree_choices)
        need(len(tree_choices) + 1 <= MAX_TREE_NODES, "tree_choices",
             f"at most {MAX_TREE_NODES - 1} paths", f"{len(tree_choices)} paths")
        try:
            StaticTree(tree_choices, draft_top_k or static_top_k(tree_choices))
        except ValueError as e:
            check(False, f"{name('tree_choices')}: {e}.", "tree_choices")


@dataclass(frozen=True)
class GenerationSettings:
    """What one generation runs with: sampling (as mlx-lm's `make_sampler` means it), the
    tree (None: the model's tuned or default tree), the context, whether to speculate
    ("auto": every cycle decides; True, False; None: the benchmark's saved choice, its tree
    or plain decoding), and whether to report each token's log-probability with
    its `logprobs` top alternatives (None: not). `check()` validates every field, in this one place."""

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    total_tokens: Optional[int] = None
    depth: Optional[int] = None
    draft_top_k: Optional[int] = None
    tree_choices: Optional[Sequence[Sequence[int]]] = None
    max_context: Optional[int] = None
    speculate: Union[None, bool, str] = "auto"
    logprobs: Optional[int] = None
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    max_kv_size: Optional[int] = None

    @property
    def kv(self) -> Optional[KVQuantization]:
        """The KV quantization asked for (None: float caches)."""
        if self.kv_bits is None:
            return None
        return KVQuantization(self.kv_bits, self.kv_group_size, self.quantized_kv_start)

    def check(self, name=lambda n: n) -> "GenerationSettings":
        """EagleError naming the first bad field (`name` turns a field into what the caller
        calls it: a flag, an API field); returns the settings for chaining."""
        check_values(self.max_tokens, self.temp, self.top_p, self.top_k, self.min_p, self.seed,
                     self.total_tokens, self.depth, self.draft_top_k, self.tree_choices,
                     self.max_context, name=name)
        check(self.speculate is None or isinstance(self.speculate, bool) or
              self.speculate == "auto",
              f"{name('speculate')} must be \"auto\", True or False (got {self.speculate!r}).",
              "speculate")
        lp = self.logprobs
        check(lp is None or (is_int(lp) and 0 <= lp <= MAX_TOP_LOGPROBS),
              f"{name('logprobs')} must be None (off) or the number of top alternatives to "
              f"report with each token's log-probability, from 0 to {MAX_TOP_LOGPROBS} "
              f"(got {lp!r}).", "logprobs")
        check(self.kv_bits is None or (is_int(self.kv_bits) and self.kv_bits in KV_BITS),
              f"{name('kv_bits')} must be one of {', '.join(map(str, KV_BITS))} (bits per "
              f"cached key and value), or None for float caches (got {self.kv_bits!r}).",
              "kv_bits")
        check(is_int(self.kv_group_size) and self.kv_group_size in KV_GROUP_SIZES,
              f"{name('kv_group_size')} must be one of "
              f"{', '.join(map(str, KV_GROUP_SIZES))} (got {self.kv_group_size!r}).",
              "kv_group_size")
        check(is_int(self.quantized_kv_start) and self.quantized_kv_start >= 0,
              f"{name('quantized_kv_start')} must be a whole number of positions, 0 or more "
              f"(got {self.quantized_kv_start!r}).", "quantized_kv_start")
        check(self.max_kv_size is None or (is_int(self.max_kv_size) and self.max_kv_size >= 8),
              f"{name('max_kv_size')} must be a whole number of positions, at least 8 (the 4 "
              f"first ones are always kept), or None (got {self.max_kv_size!r}).",
              "max_kv_size")
        check(self.max_kv_size is None or self.kv_bits is None,
              f"{name('max_kv_size')} and {name('kv_bits')} do not go together: mlx-lm's "
              "bounded cache cannot be quantized.", "max_kv_size")
        return self

    def replace(self, **changes) -> "GenerationSettings":
        return replace(self, **changes)

    def asdict(self) -> dict:
        return asdict(self)
