"""EAGLE head checkpoints: read the published ones and check them.

Reads `pytorch_model.bin` (safely, without torch) or `model.safetensors`, detects
EAGLE-1 vs EAGLE-3 from the keys, checks every key and shape (and the target, when
given). `load_head` accepts an MLX folder (`write.save_head`: config.json with an "eagle"
block saying the head kind and what it needs from its target, and model.safetensors) or an
unconverted PyTorch one.
"""

import dataclasses
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import EagleError, is_int
from ..hub import resolve
from ..targets.load import read_config
from .base import HeadSource, check_weights
from .dflash import BlockArgs, DFlashHead, head_name, is_block_config
from .gemma4_assistant import AssistantArgs, Gemma4Assistant, is_assistant_config
from .eagle import HEAD_CLASSES, ROPE_TYPES, HeadArgs
from .layouts import family_name, translate
from .mtp import INDEX, build_mtp, is_mtp_config, mtp_shards, read_mtp_weights
from .torch_pickle import load_torch_checkpoint

FORMAT_VERSION = 1
HEAD_FILES = ["config.json", "model.safetensors", "pytorch_model.bin"]
# EAGLE-3 taps layers {2, L//2, L-3}: they are distinct only from 7 layers on
EAGLE3_MIN_TARGET_LAYERS = 7


def read_head_weights(path: Path) -> Dict[str, mx.array]:
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    if st.is_file():
        try:
            return mx.load(str(st))
        except Exception as e:
            raise EagleError(f"{st} is not a readable safetensors file ({e}).") from None
    if pt.is_file():
        return load_torch_checkpoint(pt)
    raise EagleError(f"head folder {path} has neither model.safetensors nor pytorch_model.bin.")


def detect_kind(weights: Dict[str, mx.array], path: Path) -> str:
    if "midlayer.self_attn.q_proj.weight" in weights:
        return "eagle3"
    if "layers.0.self_attn.q_proj.weight" in weights:
        return "eagle1"
    raise EagleError(
        f"{path} is not an EAGLE head: it has neither layers.0.* (EAGLE-1) nor "
        "midlayer.* (EAGLE-3) attention weights."
    )


def quantize_predicate(group_size: int, weights: Optional[dict] = None):
    def predicate(path, module):
        if not isinstance(module, nn.Linear):
            return False
        if weights is not None:
            return f"{path}.scales" in weights
        return module.weight.shape[-1] % group_size == 0

    return predicate


# head config keys and what their values must be
_POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
_OPTIONAL_POSITIVE_INTS = ("num_key_value_heads", "max_position_embeddings", "draft_vocab_size",
                           "target_hidden_size", "head_dim")
_OPTIONAL_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")


def check_head_config(config: dict, path: Path) -> None:
    """Every value a head config holds has the type it needs: one sentence otherwise."""
    where = path / "config.json"

    def bad(key, what):
        raise EagleError(f"{where}: \"{key}\" must be {what} (got {config[key]!r}).")

    for key in _POSITIVE_INTS:
        if key in config and not (is_int(config[key]) and config[key] > 0):
            bad(key, "a positive whole number")
    for key in _OPTIONAL_POSITIVE_INTS:
        if config.get(key) is not None and not (is_int(config[key]) and config[key] > 0):
            bad(key, "a positive whole number")
    for key in _OPTIONAL_POSITIVE_NUMBERS:
        v = config.get(key)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            bad(key, "a positive number")
    for key in ("bias", "qkv_bias"):
        if key in config and not isinstance(config[key], bool):
            bad(key, "true or false")
    scaling = config.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        bad("rope_scaling", "an object or null")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind not in (None, "default", *ROPE_TYPES):
        raise EagleError(f"{where}: \"rope_scaling\" is of type {kind!r}, which eagle_mlx's heads "
                         f"do not compute (they compute {', '.join(ROPE_TYPES)} or none).")
    if config.get("eagle") is not None:
        eagle = config["eagle"]
        if not isinstance(eagle, dict):
            bad("eagle", "an object written by eagle_mlx.convert")
        if eagle.get("kind") not in (None, *HEAD_CLASSES):
            raise EagleError(f"{where}: \"eagle.kind\" must be one of {', '.join(HEAD_CLASSES)} "
                             f"(got {eagle.get('kind')!r}).")
    if all(k in config for k in ("hidden_size", "num_attention_heads")) \
            and config.get("head_dim") is None and config["hidden_size"] % config["num_attention_heads"]:
        raise EagleError(f"{where}: hidden_size {config['hidden_size']} is not a multiple of "
                         f"num_attention_heads {config['num_attention_heads']}.")


def _draft_mapping(weights: Dict[str, mx.array], path: Path) -> None:
    """`d2t` (draft id -> target id offsets) from `t2d` (the draft tokens' mask over the
    target's vocabulary) where a layout ships only the mask, and the two checked against
    each other where it ships both; `t2d` itself is not kept (`export_head` derives it)."""
    t2d = weights.pop("t2d", None)
    if t2d is None:
        return
    ids = np.flatnonzero(np.array(t2d.astype(mx.bool_)))
    derived = ids - np.arange(len(ids))
    if "d2t" not in weights:
        if "lm_head.weight" in weights and len(ids) != weights["lm_head.weight"].shape[0]:
            raise EagleError(f"t2d in {path} marks {len(ids)} draft tokens, but its lm_head "
                             f"drafts {weights['lm_head.weight'].shape[0]}.")
        weights["d2t"] = mx.array(derived.astype(np.int64))
    elif not np.array_equal(np.array(weights["d2t"]).astype(np.int64), derived):
        raise EagleError(f"d2t and t2d in {path} disagree on which target tokens the draft "
                         "vocabulary holds.")


def build_head(config: dict, weights: Dict[str, mx.array], path: Path, target=None):
    """Make a head module from a config and checkpoint tensors, checking every key: any
    published layout (`layouts.translate`), or a model checkpoint's MTP module."""
    eagle = config.get("eagle")
    if is_mtp_config(config) or (isinstance(eagle, dict) and eagle.get("kind") == "mtp"):
        head = build_mtp(config, weights, path, converted="eagle" in config,
                         layout=(config.get("eagle") or {}).get("layout"))
        if target is not None:
            check_pair(head, target, path)
        return head
    if is_block_config(config):
        return build_block(config, weights, path, target)
    if is_assistant_config(config):
        return build_assistant(config, weights, path, target)
    config, weights, layout, made_for = translate(config, dict(weights), path)
    check_head_config(config, path)
    eagle = config.get("eagle") or {}
    kind = eagle.get("kind") or detect_kind(weights, path)
    if kind == "eagle3":
        _draft_mapping(weights, path)
    else:
        weights.pop("t2d", None)
    if kind == "eagle1" and "bias" not in config:
        config = dict(config, bias="fc.bias" in weights)
    try:
        args = HeadArgs.from_config(config, kind, has_d2t="d2t" in weights)
    except KeyError as e:
        raise EagleError(f"{path / 'config.json'} lacks the key {e} that a head config needs.") from None
    # the head drafts with the target's embedding, unless it is narrower than its target; a
    # head that names a target width equal to its own and ships no embedding borrows it too
    if kind == "eagle3" and args.target_hidden_size == args.hidden_size and \
            "embed_tokens.weight" not in weights:
        args = dataclasses.replace(args, target_hidden_size=None)
    own_embedding = kind == "eagle3" and args.target_hidden_size is not None
    embed = None if own_embedding else weights.pop("embed_tokens.weight", None)
    if own_embedding and "embed_tokens.weight" not in weights:
        raise EagleError(f"EAGLE-3 head {path} is narrower than its target (target_hidden_size "
                         f"{args.target_hidden_size}, hidden_size {args.hidden_size}), so it needs "
                         "its own embed_tokens.weight, which its checkpoint lacks.")
    top1 = eagle.get("held_out_top1")
    source = HeadSource(path=path, layout=layout, made_for=made_for,
                        model_type=config.get("model_type"), config=config,
                        held_out_top1=float(top1) if isinstance(top1, (int, float)) and
                        0 < top1 <= 1 else None)
    head = HEAD_CLASSES[kind](args, source)
    quantize_as_saved(head, config, weights)
    check_weights(head, weights, f"{kind} head in {path}")
    if "d2t" in weights:
        weights["d2t"] = weights["d2t"].astype(mx.int64)
    if kind == "eagle3" and args.draft_vocab_size != args.vocab_size and "d2t" not in weights:
        raise EagleError(f"EAGLE-3 head {path} drafts over {args.draft_vocab_size} of "
                         f"{args.vocab_size} tokens but has neither d2t nor t2d to map them.")
    head.load_weights(list(weights.items()))
    head.eval()
    if embed is not None and tuple(embed.shape) != (args.vocab_size, args.hidden_size):
        raise EagleError(
            f"embed_tokens.weight in {path} has shape {tuple(embed.shape)}, but the head "
            f"config says vocab {args.vocab_size} x hidden {args.hidden_size}."
        )
    if target is not None:
        check_pair(head, target, path, embed_shape=None if embed is None else tuple(embed.shape))
    return head


def quantize_as_saved(head, config: dict, weights: Dict[str, mx.array]) -> None:
    """Quantize the linear layers a converted folder saved quantized (its config's
    "quantization"; the layers whose scales it holds)."""
    quant = config.get("quantization")
    if quant:
        nn.quantize(head, group_size=quant["group_size"], bits=quant["bits"],
                    class_predicate=quantize_predicate(quant["group_size"], weights))


def fill(head, config: dict, weights: Dict[str, mx.array], what: str):
    """The head with `weights` loaded: quantized as they were saved, every key checked
    against its config (`what`: the head and its folder, as the sentence names them)."""
    quantize_as_saved(head, config, weights)
    check_weights(head, weights, what)
    head.load_weights(list(weights.items()))
    head.eval()
    return head


def build_block(config: dict, weights: Dict[str, mx.array], path: Path, target=None):
    """A block drafter (DFlash) from its config and tensors (with or without a `model.`
    prefix), every key checked, and checked against the target where given."""
    args = BlockArgs.from_config(config, path)
    weights = {k[len("model."):] if k.startswith("model.") else k: v
               for k, v in weights.items()}
    weights.pop("t2d", None)  # (DSpark over a reduced vocabulary: d2t says it all)
    if "d2t" in weights:
        weights["d2t"] = weights["d2t"].astype(mx.int64)
    for name in ("predecessor_codebook", "successor_codebook"):  # (DFlash 2: raw tensors)
        raw = f"candidate_selector.{name}"
        if raw in weights:
            weights[raw + ".weight"] = weights.pop(raw)
    source = HeadSource(path=path, layout="dflash", model_type=config.get("model_type"),
                        config=config)
    head = DFlashHead(args, source)
    if target is not None:  # (a drafter for another target: say so before its tensors)
        head.check_target(target, f"{head_name(head)} drafter {path}")
    return fill(head, config, weights, f"{head_name(head)} drafter in {path}")


def build_assistant(config: dict, weights: Dict[str, mx.array], path: Path, target=None):
    """A Gemma 4 assistant from its config and tensors (transformers' names; its lm_head is
    its tied embedding), checked against the target where given."""
    head = Gemma4Assistant(AssistantArgs.from_config(config, path),
                           HeadSource(path=path, layout=config["model_type"],
                                      model_type=config["model_type"], config=config))
    if target is not None:
        head.check_target(target, f"Gemma 4 assistant {path}")
    weights = dict(weights)
    weights.pop("lm_head.weight", None)  # (tied to model.embed_tokens)
    if "masked_embedding.token_ordering" in weights:
        weights["masked_embedding.token_ordering"] = \
            weights["masked_embedding.token_ordering"].astype(mx.int32)
    return fill(head, config, weights, f"Gemma 4 assistant in {path}")


def check_pair(head, target, head_path, embed_shape=None) -> None:
    """Fail loudly, naming both sides, where a head does not fit a target."""
    kind = head.kind
    tname = target.path or "the target"
    width, vocab = head.target_width, head.vocab_size
    if width != target.hidden_size:
        which = "drafts for a target of hidden size" if head.declares_target_width \
            else "has hidden size"
        raise EagleError(
            f"head {head_path} ({kind}) {which} {width}, but target {tname} "
            f"({target.model_type}) has hidden size {target.hidden_size}."
        )
    if vocab != target.vocab_size:
        raise EagleError(
            f"head {head_path} ({kind}) has vocab size {vocab}, but target {tname} "
            f"({target.model_type}) has vocab size {target.vocab_size}."
        )
    made_for = head.source.made_for
    if family_name(made_for) and family_name(made_for) != family_name(target.model_type):
        raise EagleError(
            f"head {head_path} ({head.layout}) was made for a {made_for} "
            f"target, but target {tname} is {target.model_type}.")
    config_type = head.source.model_type
    if kind == "mtp" and family_name(config_type) != family_name(target.model_type):
        raise EagleError(
            f"MTP module {head_path} belongs to a {config_type} model, but target {tname} is "
            f"{target.model_type}.")
    if kind != "mtp" and isinstance(config_type, str) and config_type.startswith("qwen") \
            and not str(target.model_type).startswith("qwen"):
        # a head whose config is a Qwen config was made for a Qwen target (EAGLE-1 heads
        # carry their target's config; Llama-family heads say "llama" whatever the target)
        raise EagleError(
            f"head {head_path} ({kind}) was made for a {config_type} target (its config's "
            f"model_type), but target {tname} is {target.model_type}."
        )
    if embed_shape is not None and embed_shape != (target.vocab_size, target.hidden_size):
        raise EagleError(
            f"embedding in head {head_path} has shape {embed_shape}, but target {tname} "
            f"embeds {target.vocab_size} x {target.hidden_size}."
        )
    if kind == "eagle3":
        if head.aux_layers:
            bad = [i for i in head.aux_layers if i > target.num_layers]
            if bad:
                raise EagleError(
                    f"EAGLE-3 head {head_path} reads target layer {bad[0]} (the hidden state "
                    f"entering it), but target {tname} has {target.num_layers} layers "
                    f"(0..{target.num_layers}).")
        else:
            check_eagle3_target(target, f"EAGLE-3 head {head_path}", f"target {tname}")


def check_eagle3_target(target, head: str, name: str) -> None:
    """An EAGLE-3 head (`head`, as the sentence names it) reads three of the target's layers."""
    if target.num_layers < EAGLE3_MIN_TARGET_LAYERS:
        raise EagleError(
            f"{head} taps target layers {{2, L//2, L-3}}, which needs at least "
            f"{EAGLE3_MIN_TARGET_LAYERS} layers, but {name} has {target.num_layers}.")


def read_head(path_or_repo: str) -> Tuple[dict, Dict[str, mx.array], Path]:
    if not isinstance(path_or_repo, (str, Path)):
        raise EagleError(f"the EAGLE head must be a folder or a Hugging Face repo id, given as a "
                         f"string (got {type(path_or_repo).__name__}).")

    # the config first: a model checkpoint's MTP module is read from the shards holding it
    path = resolve(path_or_repo, "EAGLE head", allow_patterns=["config.json", INDEX])
    config = read_config(path, "EAGLE head")
    if is_mtp_config(config):
        shards = mtp_shards(path)
        needed = shards if shards is not None else ["model.safetensors"]
        path = resolve(path_or_repo, "MTP checkpoint", allow_patterns=["config.json", INDEX,
                                                                       *needed])
        return config, read_mtp_weights(path, shards), path
    path = resolve(path_or_repo, "EAGLE head", allow_patterns=HEAD_FILES)
    return config, read_head_weights(path), path


def load_head(path_or_repo: str, target=None):
    """An EAGLE head from a converted MLX folder, a published one in any layout (converted
    in memory), or the MTP module of a model checkpoint (folder or repo)."""
    config, weights, path = read_head(path_or_repo)
    return build_head(config, weights, path, target)
