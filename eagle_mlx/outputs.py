"""Output paths: checked before any work starts, written atomically, nothing left on failure;
and the user's cache folder, where measurements and counts are kept between runs."""

import os
import shutil
from pathlib import Path
from typing import Optional

from .errors import EagleError, reason

CACHE_ENV = "EAGLE_MLX_CACHE"


def user_cache(kind: str) -> Path:
    """The user's cache folder for one kind of entry: `$EAGLE_MLX_CACHE` (default
    `$XDG_CACHE_HOME/eagle_mlx`, `~/.cache/eagle_mlx`)/kind."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "eagle_mlx")
    return Path(root).expanduser() / kind


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute().parent
    while not p.exists():
        p = p.parent
    return p


def check_writable_dir(folder: Path, flag: str, path: Optional[Path] = None) -> None:
    """Try it: create and remove a probe file in `folder`. Permission bits do not tell (root
    may "write" /proc, a read-only mount or a full disk says so only when written to), so a
    path that cannot be written fails here, in one sentence, before any work starts."""
    probe = folder / f".eagle_mlx-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"probe")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise EagleError(f"{flag} {path or folder} cannot be written: {folder} refused a "
                         f"file ({reason(e)}).") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def _check_parent(path: Path, flag: str) -> None:
    base = _existing_ancestor(path)
    if not base.is_dir():
        raise EagleError(f"{flag} {path}: {base} is a file, not a folder.")
    check_writable_dir(base, flag, path)


def check_new_dir(path, flag: str) -> Path:
    """A folder the tool will create: it must not exist, and its parent must be creatable."""
    path = Path(path).expanduser()
    if path.exists():
        raise EagleError(f"{flag} {path} already exists; choose a new folder.")
    _check_parent(path, flag)
    return path


def check_out_file(path, flag: str) -> Path:
    """A file the tool will write (replacing an older one): it must be creatable."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise EagleError(f"{flag} {path} is a folder, not a file.")
    _check_parent(path, flag)  # written as a new file beside it, then renamed
    return path


def _replace(out, tmp: Path, write, remove, rename=os.replace) -> None:
    """Run write(tmp) and rename tmp to `out`; `remove(tmp)` clears what a failure left."""
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        rename(tmp, out)
    except OSError as e:
        raise EagleError(f"could not write {out} ({reason(e)}).") from None
    finally:
        remove(tmp)


def _replace_dir(tmp: Path, out: Path) -> None:
    """tmp renamed to `out`; a folder already there (an older checkpoint) is set aside first
    and removed once the new one is in place."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def atomic_dir(out: Path, write) -> None:
    """Run write(tmp_dir) and rename tmp_dir to `out` (replacing a folder there); nothing is
    left on failure."""
    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _replace(out, tmp, write, lambda t: shutil.rmtree(t, ignore_errors=True), _replace_dir)


def atomic_file(out: Path, write) -> None:
    """Run write(tmp_path) and rename it to `out`; nothing is left on failure."""
    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}{out.suffix}"
    _replace(out, tmp, write, lambda t: t.unlink(missing_ok=True))
