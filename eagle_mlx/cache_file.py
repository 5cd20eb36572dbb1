"""Prompt caches saved to a file and read back, in mlx-lm's format: `save_prompt_cache` /
`load_prompt_cache`, the target's per-layer caches as mlx-lm's own cache classes (a full
layer's `KVCache` or `QuantizedKVCache`, a sliding window's `RotatingKVCache`, a recurrent
layer's `ArraysCache`) and string metadata (`model`, `tokenizer_config`, as mlx-lm's
`cache_prompt` writes them).

What eagle_mlx adds: under the metadata key "eagle_mlx", the tokens the caches hold and what
the target is; after the target's layers, one more entry (an `ArraysCache`, which mlx-lm's
models never read: they read their own layers' entries) holding the target's features of
every position (the post-norm hidden states, or the tapped layers' inputs), from which any
drafter reading those features catches up on its first proposal. A file mlx-lm wrote holds
neither: its tokens are unknown, and it continues with plain decoding.
"""

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx

from . import mlxlm
from .decoding.steps import PromptCache
from .errors import EagleError
from .targets.cache import BoundedKVCache, QuantizedTreeKVCache, RecurrentCache, TreeKVCache, \
    WindowKVCache

FORMAT = 1


def _identity(target) -> dict:
    """What a cache file's target must match."""
    return {"model_type": str(target.model_type), "layers": target.num_layers,
            "hidden_size": target.hidden_size, "vocab_size": target.vocab_size}


def _to_mlx_lm(cache, window: Optional[int]):
    """One of our layer caches as mlx-lm's class of it, holding the same positions."""
    if isinstance(cache, BoundedKVCache):
        out = mlxlm.RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
        out.state = cache.state
        return out
    if isinstance(cache, QuantizedTreeKVCache):
        out = mlxlm.QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
        n = cache.offset
        out.keys = tuple(x[..., :n, :] for x in cache.keys)
        out.values = tuple(x[..., :n, :] for x in cache.values)
        out.offset = n
        return out
    if isinstance(cache, WindowKVCache):
        out = mlxlm.RotatingKVCache(max_size=window, keep=0)
        held = cache.offset - cache.base
        out.state = (cache.keys[..., :held, :], cache.values[..., :held, :], cache.offset, 0,
                     window, held)
        return out
    if isinstance(cache, TreeKVCache):
        out = mlxlm.KVCache()
        n = cache.offset
        out.keys, out.values, out.offset = cache.keys[..., :n, :], cache.values[..., :n, :], n
        return out
    if isinstance(cache, RecurrentCache):
        out = mlxlm.ArraysCache(size=2)
        out.state = list(cache.state)
        return out
    raise EagleError(f"a {type(cache).__name__} cannot be written to a prompt cache file.")


def save(path, prompt_cache: PromptCache, model, model_id: str = "",
         features: Optional[mx.array] = None, taps=None) -> None:
    """Write `prompt_cache` (the target's caches holding its `tokens`) to `path`, with the
    target's `features` of every position it holds (read with `taps`: None for the post-norm
    hidden states) where given. The file is written whole or not at all."""
    target = model.target
    windows = [m.window for m in target.mechanisms if getattr(m, "source", None) is None]
    entries = [_to_mlx_lm(c, w) for c, w in zip(prompt_cache.target, windows)]
    info = {"format": FORMAT, "tokens": list(prompt_cache.tokens[: prompt_cache.length]),
            "target": _identity(target), "taps": None if taps is None else list(taps)}
    if features is not None:
        extra = mlxlm.ArraysCache(size=1)
        extra[0] = features
        entries.append(extra)
        info["features"] = int(features.shape[-1])
    metadata = {"model": model_id, "tokenizer_config": "{}", "eagle_mlx": json.dumps(info)}
    path = Path(path)
    tmp = path.with_name(path.name + ".partial.safetensors")
    if not path.parent.is_dir():
        raise EagleError(f"cannot write the prompt cache file {path}: its folder "
                         f"{path.parent} does not exist.")
    try:
        mlxlm.save_prompt_cache(str(tmp), entries, metadata)
        tmp.replace(path)
    except (OSError, RuntimeError) as e:  # (MLX says RuntimeError where it cannot open it)
        tmp.unlink(missing_ok=True)
        why = e.strerror if isinstance(e, OSError) else "it cannot be opened for writing"
        raise EagleError(f"cannot write the prompt cache file {path} ({why}).") from None


def load(path, model, kv=None, max_kv_size: Optional[int] = None) -> PromptCache:
    """The PromptCache a file holds, for `model`'s target (kv, max_kv_size: the KV
    quantization and bound the generation asks for, which a quantized or bounded file must
    match). One sentence for a file that is missing, damaged, or made for another model or
    settings."""
    path = Path(path)
    if not path.is_file():
        raise EagleError(f"prompt cache file {path} does not exist.")
    try:
        entries, metadata = mlxlm.load_prompt_cache(str(path), return_metadata=True)
    except Exception as e:  # (safetensors and mlx-lm raise several kinds)
        raise EagleError(f"{path} is not a prompt cache file mlx-lm or eagle_mlx wrote "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})."
                         ) from None
    target = model.target
    info = None
    if "eagle_mlx" in metadata:
        try:
            info = json.loads(metadata["eagle_mlx"])
            assert info["format"] == FORMAT and isinstance(info["tokens"], list)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise EagleError(f"{path}: its eagle_mlx metadata is damaged.") from None
        if info["target"] != _identity(target):
            raise EagleError(f"{path} was made for another model ({info['target']}); this "
                             f"target is {_identity(target)}.")
    mechanisms = [m for m in target.mechanisms if getattr(m, "source", None) is None]
    features = None
    if info is not None and info.get("features"):
        if len(entries) != len(mechanisms) + 1:
            raise EagleError(f"{path} holds {len(entries) - 1} layer caches; this target keeps "
                             f"{len(mechanisms)}.")
        features = entries.pop()[0]
    if len(entries) != len(mechanisms):
        raise EagleError(f"{path} holds {len(entries)} layer caches; this target keeps "
                         f"{len(mechanisms)} (a file for another model).")
    fresh = target.make_cache()
    caches = [_from_mlx_lm(e, f, path, i) for i, (e, f) in enumerate(zip(entries, fresh))]
    lengths = {c.offset for c in caches if not isinstance(c, RecurrentCache)}
    if len(lengths) != 1:
        raise EagleError(f"{path}: its layer caches hold different numbers of positions "
                         f"({sorted(lengths)}).")
    length = lengths.pop()
    for c in caches:
        if isinstance(c, RecurrentCache):
            c.offset = length
    quantized = [c for c in caches if isinstance(c, QuantizedTreeKVCache)]
    if quantized and kv is not None and (quantized[0].bits, quantized[0].group_size) != \
            (kv.bits, kv.group_size):
        raise EagleError(f"{path} holds a KV cache quantized to {quantized[0].bits} bits in "
                         f"groups of {quantized[0].group_size}; the generation asks for "
                         f"{kv.bits} bits in groups of {kv.group_size}.")
    bounds = {c.max_size for c in caches if isinstance(c, BoundedKVCache)}
    bound = bounds.pop() if bounds else None
    if bound != max_kv_size:
        raise EagleError(f"{path} holds caches bounded to {bound} positions; the generation "
                         f"asks for {max_kv_size} (max_kv_size)." if bound is not None else
                         f"{path} holds unbounded caches; the generation asks for "
                         f"max_kv_size {max_kv_size}.")
    _check_shapes(target, caches, path)
    pc = PromptCache()
    pc.owner, pc.target, pc.length, pc.valid = (target, None), caches, length, True
    pc.max_kv_size = bound
    if info is not None:
        tokens = [int(t) for t in info["tokens"]]
        if len(tokens) != length:
            raise EagleError(f"{path}: its caches hold {length} positions but its tokens are "
                             f"{len(tokens)}.")
        pc.tokens = tokens
        if features is not None:
            if features.shape[0] != length:
                raise EagleError(f"{path}: its features cover {features.shape[0]} positions, "
                                 f"its caches {length}.")
            pc.saved = (features, None if info.get("taps") is None else tuple(info["taps"]))
    else:  # mlx-lm's own file: what the positions were is not recorded
        pc.tokens, pc.opaque = [0] * length, length
    return pc


def _from_mlx_lm(entry, fresh, path, layer: int):
    """An mlx-lm cache entry as our cache of the same layer (`fresh`: what this target's
    layer keeps)."""
    name = type(entry).__name__
    where = f"{path}: layer {layer}'s cache"
    if isinstance(fresh, WindowKVCache):
        if name != "RotatingKVCache":
            raise EagleError(f"{where} is a {name}; this target's layer {layer} has a sliding "
                             "window (a file for another model).")
        keys, values, offset, keep, _, idx = entry.state
        if keys is not None and idx < offset and idx < keys.shape[2]:  # rotated: in order
            keys, values = (mx.concatenate([x[..., :keep, :], x[..., idx:, :],
                                            x[..., keep:idx, :]], axis=2)
                            for x in (keys, values))
        elif keys is not None:
            keys, values = keys[..., :idx, :], values[..., :idx, :]
        c = WindowKVCache(fresh.window)
        if keys is not None:
            held = keys.shape[2]
            c.keys, c.values, c.offset, c.base = keys, values, entry.offset, entry.offset - held
        return c
    if isinstance(fresh, RecurrentCache):
        if name != "ArraysCache":
            raise EagleError(f"{where} is a {name}; this target's layer {layer} is recurrent "
                             "(a file for another model).")
        c = RecurrentCache(fresh.conv_rows)
        c.state = list(entry.state)
        return c
    if name == "RotatingKVCache":  # (a full layer's bounded cache: max_kv_size)
        keys, values, offset, keep, max_size, idx = entry.state
        c = BoundedKVCache(max_size, keep)
        c.state = (keys, values, offset, keep, max_size, idx)
        return c
    if name == "QuantizedKVCache":
        c = QuantizedTreeKVCache(group_size=entry.group_size, bits=entry.bits)
        c.keys, c.values = tuple(entry.keys), tuple(entry.values)  # (read back as lists)
        c.offset = entry.offset
        return c
    if name == "KVCache":
        c = TreeKVCache()
        c.keys, c.values, c.offset = entry.keys, entry.values, entry.offset
        return c
    raise EagleError(f"{where} is a {name}, which this target's layer {layer} does not keep "
                     "(a file for another model).")


def _check_shapes(target, caches, path) -> None:
    """The keys a fresh cache of this target gets for one token have the file's shapes."""
    probe = target.make_cache()
    target(mx.array([[0]]), probe)
    for i, (c, p) in enumerate(zip(caches, probe)):
        if getattr(c, "keys", None) is None or getattr(p, "keys", None) is None:
            continue
        ours = c.keys[0] if isinstance(c.keys, tuple) else c.keys
        if isinstance(c, QuantizedTreeKVCache):
            heads = ours.shape[1]
            width = ours.shape[-1] * 32 // c.bits
        else:
            heads, width = ours.shape[1], ours.shape[-1]
        if (heads, width) != (p.keys.shape[1], p.keys.shape[-1]):
            raise EagleError(f"{path}: layer {i} keeps {heads} key heads of {width}; this "
                             f"target keeps {p.keys.shape[1]} of {p.keys.shape[-1]} (a file "
                             "for another model).")


def prefill_and_save(path, model, ids, kv=None, model_id: str = "",
                     max_kv_size: Optional[int] = None) -> None:
    """Prefill `ids` (as a generation's prefill runs, KV quantization or a bound included)
    and write the caches to `path` with the target's features of every position: those the
    model's head reads (its taps, or the post-norm hidden states); none without a head."""
    from .decoding.drafters import Drafter
    from .decoding.engine import Engine, SamplingParams

    head = model.head
    taps = None if head is None else tuple(head.feature_taps(model.target) or ())

    class Reader(Drafter):  # (reads the features; drafts nothing)
        features = taps
        max_depth = 0

        def new_state(self):
            return None

        def offset(self, state) -> int:
            return 0

    engine = Engine(model.target, Reader(), SamplingParams(), model.target.max_context, kv=kv,
                    split_prompt=max_kv_size is not None)
    state = engine.new_state()
    state.caches = model.target.make_cache(max_kv_size)
    engine.prefill(state, ids)
    pc = PromptCache()
    pc.target, pc.tokens, pc.length = state.caches, list(ids), len(ids)
    save(path, pc, model, model_id, features=state.feats, taps=taps or None)
