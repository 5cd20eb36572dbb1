"""Request planning: a generation's settings checked against the model, its tree chosen
(explicit settings over the benchmark's tuning over the defaults, bounded by a hybrid
target's memory) and its drafter built."""

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from ..errors import EagleError, check, is_int
from ..targets.target import TREE_STATE_FRACTION, machine_memory
from .accept import KeyChain
from .registry import head_drafter
from .engine import SamplingParams
from .lookup import LookupDrafter, MergedDrafter
from .settings import GenerationSettings, KVQuantization, static_top_k
from .steps import PromptCache
from .tree import TreeSpec


def check_tree(model, total_tokens, depth, draft_top_k, tree_choices) -> None:
    """The tree against the head (after loading)."""
    vocab = model.head.draft_vocab_size
    if getattr(model.head, "block", False):  # a DDTree: any size, as deep as the block
        check(not tree_choices, "tree_choices spells a static EAGLE-1 tree; a block drafter "
              "drafts a DDTree (total_tokens, depth and draft_top_k set its size).")
        levels = model.head.predicts
        check(depth + 1 <= levels, f"depth {depth} asks for {depth + 1} levels, but the block "
              f"drafter predicts {levels} tokens a block (depth at most {levels - 1}).")
        check(draft_top_k <= vocab,
              f"draft_top_k {draft_top_k} exceeds the vocabulary of {vocab}.")
        return
    check(draft_top_k <= vocab,
           f"draft_top_k {draft_top_k} exceeds the head's draft vocabulary of {vocab}.")
    if not tree_choices:  # (a tree deeper than the context left ends in plain steps)
        pool = draft_top_k + depth * draft_top_k ** 2
        check(total_tokens <= pool + 1,
               f"total_tokens must be at most {pool + 1} for depth {depth} and draft_top_k "
               f"{draft_top_k}, the nodes such a tree can draft (got {total_tokens}).")


def tree_plan(model, total_tokens=None, depth=None, draft_top_k=None, tree_choices=None,
              speculate=None, batch: Optional[int] = None) -> Optional[TreeSpec]:
    """The tree a generation will use (None: plain decoding): explicit settings over the
    benchmark's tuning (for a batch of `batch` sequences, where it measured batches) over
    the defaults. speculate as in `stream_generate`."""
    if speculate is None:
        explicit = any(x is not None for x in (total_tokens, depth, draft_top_k, tree_choices))
        speculate = model.head is not None and (explicit or model.speculates_at(batch))
    check(not speculate or model.head is not None, "speculative decoding needs an EAGLE head.")
    if not speculate:
        return None
    tree = model.tree_settings(batch)
    if draft_top_k is None and tree_choices:  # a static tree's ranks set its top-k
        draft_top_k = max(tree.draft_top_k, static_top_k(tree_choices))
    tree = tree.replace(**{k: v for k, v in (("total_tokens", total_tokens), ("depth", depth),
                                             ("draft_top_k", draft_top_k)) if v is not None})
    if tree_choices:
        tree = TreeSpec.from_choices(tree_choices, tree.draft_top_k)
    return bound_tree(model.target, tree, explicit=total_tokens is not None or bool(tree_choices))


def bound_tree(target, tree: TreeSpec, explicit: bool) -> TreeSpec:
    """A hybrid target's tree within the memory its nodes' recurrent states may take: a
    tree asked for explicitly is refused beyond it, a default or tuned one is cut to it."""
    limit = target.tree_node_limit()
    if limit is None or tree.total_tokens <= limit:
        return tree
    per_node = target.node_state_bytes
    check(not explicit,
          f"a tree of {tree.total_tokens} nodes needs "
          f"{tree.total_tokens * per_node / 2**30:.1f} GB of recurrent states on this "
          f"{target.model_type} target ({per_node / 2**20:.1f} MB a node), over the bound of "
          f"{machine_memory() / TREE_STATE_FRACTION / 2**30:.1f} GB (1/{TREE_STATE_FRACTION} of "
          f"this machine's memory); use at most {limit} nodes (total_tokens).")
    return tree.replace(total_tokens=limit)


def encode_prompt(tokenizer, prompt: Union[str, Sequence[int]]) -> List[int]:
    """Token ids of a prompt given as text (tokenized as is) or as token ids."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise EagleError("the prompt is not valid UTF-8 text.") from None
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    if isinstance(prompt, mx.array):
        prompt = prompt.tolist()
    ok = isinstance(prompt, (list, tuple, np.ndarray)) and all(is_int(t) for t in prompt)
    check(ok, "the prompt must be a string or a list of token ids (whole numbers), "
               f"not {type(prompt).__name__}" + (" holding other values." if isinstance(
                   prompt, (list, tuple, np.ndarray)) else "."))
    return [int(t) for t in prompt]


@dataclass
class Prepared:
    """What one generation runs, checked: the prompt's ids, the drafter (None: plain
    decoding), the sampling settings, the context, the random keys of its draws and the
    alternatives to report with each token's log-probability (None: none reported)."""

    ids: List[int]
    drafter: object
    sampling: SamplingParams
    max_context: int
    keys: KeyChain
    logprobs: Optional[int] = None
    kv: Optional[KVQuantization] = None  # quantized KV caches (None: float)
    max_kv_size: Optional[int] = None       # bounded caches (None: every position kept)


def prepare(model, tokenizer, prompt, settings: GenerationSettings,
            prompt_cache: Optional[PromptCache] = None, batch: Optional[int] = None) -> Prepared:
    """Check a request against the model (one sentence for what is wrong) and choose its
    drafter: the head's tree, prompt lookup alone or merged into it, or none (batch: the
    size of the batch it decodes in, whose tuning chooses)."""
    check(isinstance(settings, GenerationSettings),
           "settings must be an eagle_mlx.GenerationSettings.")
    settings.check()
    s = settings
    temp, seed, max_context = s.temp, s.seed, s.max_context
    total_tokens, depth, draft_top_k, tree_choices = (s.total_tokens, s.depth, s.draft_top_k,
                                                      s.tree_choices)
    check(prompt_cache is None or isinstance(prompt_cache, PromptCache),
           "prompt_cache must be an eagle_mlx.PromptCache.")
    check(hasattr(model, "target") and hasattr(model, "head"),
           "model must be the EagleModel that eagle_mlx.load returns.")
    if s.kv is not None:  # (before anything is measured)
        check_kv(model, s.kv)
    if s.max_kv_size is not None:
        target = model.target
        check(target.bounds_kv,
              f"max_kv_size bounds the caches of models whose layers all attend to every "
              f"position (Llama, Mistral, Qwen); {target.model_type} here has sliding windows, "
              "shared or recurrent layers, which keep caches of their own.", "max_kv_size")
    lookup = getattr(model, "lookup", None)  # prompt lookup: alone, or merged with the head
    if lookup is not None and s.max_kv_size is not None:  # (its chains within the window)
        lookup = replace(lookup, max_draft=min(lookup.max_draft, s.max_kv_size - 5))
    alone = lookup is not None and model.head is None
    explicit = any(x is not None for x in (total_tokens, depth, draft_top_k, tree_choices))
    # adaptive (where there is something to draft with): plain, lookup or the head, chosen
    # every cycle (under mx.distributed from rank 0's costs and timings, on every rank)
    auto = s.speculate == "auto" and not explicit and \
        (model.head is not None or getattr(model, "auto_lookup", None) is not None)
    tree = None if alone or auto else tree_plan(
        model, total_tokens, depth, draft_top_k, tree_choices,
        None if s.speculate == "auto" else s.speculate, batch)
    speculate = tree is not None
    # where the benchmark found that the head's trees do not pay, lookup drafts alone
    alone = alone or (lookup is not None and not speculate)
    if speculate:
        total_tokens, depth, draft_top_k = tree.total_tokens, tree.depth, tree.draft_top_k
    target = model.target
    check(max_context is None or max_context <= target.max_context,
           f"max_context {max_context} exceeds the model's context of {target.max_context} tokens.")
    max_context = max_context or target.max_context
    if speculate:
        check_tree(model, total_tokens, depth, draft_top_k, tree_choices)
    ids = encode_prompt(tokenizer, prompt)
    check(len(ids) > 0, "the prompt is empty.")
    check(len(ids) <= max_context,
           f"the prompt has {len(ids)} tokens but the model's context is {max_context} tokens.")
    check(max(ids) < target.vocab_size and min(ids) >= 0,
           f"the prompt holds token ids outside the model's vocabulary of {target.vocab_size}.")
    if auto:  # (within a bounded cache's window)
        drafter = model.adaptive_drafter(s.max_kv_size, s.kv, timed=s.temp == 0)
    elif alone and s.speculate is not False:
        drafter = LookupDrafter(lookup, target.tree_node_limit())
    elif not speculate:
        drafter = None
    else:
        drafter = head_drafter(model.head, target, total_tokens, depth, draft_top_k,
                               tree_choices)
        if lookup is not None:
            drafter = MergedDrafter(drafter, LookupDrafter(lookup), total_tokens)
    if s.max_kv_size is not None and drafter is not None:
        window = s.max_kv_size - 4  # (mlx-lm's bounded cache keeps the 4 first positions)
        check(drafter.max_depth + 1 <= window,
              f"max_kv_size {s.max_kv_size} leaves each position a window of {window} (after "
              f"the 4 first ones), less than the draft tree's {drafter.max_depth + 1} levels; "
              f"give at least {drafter.max_depth + 5}.", "max_kv_size")
    return Prepared(ids, drafter, SamplingParams(temp, s.top_p, s.top_k, s.min_p), max_context,
                    KeyChain.start(seed), s.logprobs, s.kv, s.max_kv_size)


def check_kv(model, kv: KVQuantization) -> None:
    """One sentence where the target's caches cannot be quantized as asked."""
    target = model.target
    check(not target.kv_shared,
          f"{target.path or 'the target'} has KV-shared layers (Gemma 4), which read another "
          "layer's keys and values in float; kv_bits does not apply to it.", "kv_bits")
    check(not target.attention_sinks,
          f"{target.path or 'the target'} has attention sinks (gpt-oss), which mlx-lm's "
          "quantized attention does not take; kv_bits does not apply to it.", "kv_bits")
    for d in sorted(target.kv_head_dims()):
        check(d % kv.group_size == 0,
              f"a KV cache group size of {kv.group_size} (kv_group_size, --kv-group-size) "
              f"does not divide the target's key/value head size {d}; give one that does "
              "(32, 64 or 128).", "kv_group_size")
