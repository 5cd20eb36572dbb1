"""The benchmark's tree choice, kept in the user's cache per head, target and machine.

A choice measured on one machine (its verify cost curve, its head, its target in the dtype
it ran) means nothing for another, and the head folder may be read-only or inside the
installed package, so choices live in `$EAGLE_MLX_CACHE` (default
`~/.cache/eagle_mlx`)/tuning, one file per (head, target, dtype, machine), found again by
a hash of those.
"""

import hashlib
import json
import platform
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .errors import EagleError
from .outputs import CACHE_ENV, atomic_file, user_cache

WEIGHT_SUFFIXES = (".json", ".safetensors", ".bin", ".gguf")


def cache_dir() -> Path:
    return user_cache("tuning")


def _files(path: Path) -> list:
    """What identifies a model on disk: its resolved path and the sizes and modification
    times of its weight and config files."""
    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(
        f for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.name != "eagle_tuning.json")
    return [str(path)] + [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files]


def machine() -> dict:
    return {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor(), "device": str(mx.default_device()),
            "mlx": mx.__version__}


def tuning_key(head_path, target_path, dtype) -> dict:
    """What a tuning or cost entry belongs to: the head's and the target's files, the dtype and
    this machine."""
    return {"head": _files(head_path) if head_path else None,  # None: prompt lookup alone
            "target": _files(target_path), "dtype": str(dtype),
            "machine": machine()}


def entry_path(folder: Path, key: dict) -> Path:
    """The cache file of `key` in `folder`: found again by a hash of the key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return folder / f"{digest}.json"


def write_entry(f: Path, entry: dict) -> Path:
    """Write a cache entry as JSON (atomically; one sentence where the cache is not
    writable)."""
    text = json.dumps(entry, indent=2) + "\n"
    try:
        atomic_file(f, lambda tmp: tmp.write_text(text))
    except EagleError as e:
        raise EagleError(f"{str(e).rstrip('.')}; set {CACHE_ENV} to a writable folder.") from None
    return f


def tuning_path(head_path, target_path, dtype) -> Path:
    return entry_path(cache_dir(), tuning_key(head_path, target_path, dtype))


def read_tuning(head_path, target_path, dtype) -> Optional[dict]:
    f = tuning_path(head_path, target_path, dtype)
    if not f.is_file():
        return None
    try:
        tuning = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return None  # a damaged cache entry is ignored; the benchmark writes a new one
    return tuning.get("choice") if isinstance(tuning, dict) and isinstance(tuning.get("choice"), dict) else None


def write_tuning(head_path, target_path, dtype, choice: dict) -> Path:
    return write_entry(tuning_path(head_path, target_path, dtype),
                       {"key": tuning_key(head_path, target_path, dtype), "choice": choice})
