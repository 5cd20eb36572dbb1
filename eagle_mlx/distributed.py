"""The target sharded across machines (tensor parallel), with `mx.distributed`.

Launched with MLX's own launcher, every rank runs the same tool:

    mlx.launch --hosts mac1,mac2 --backend ring -- \\
        python -m eagle_mlx.generate --model ... --eagle ... --prompt "..."

Each rank loads only its shard of the target through mlx-lm's `shard()` (attention heads
and MLP columns split, "all-to-sharded" in and "sharded-to-all" out: two all-reduces per
decoder layer per forward), so the tree forward's hidden states, logits and features are
the same on every rank. The small head runs whole on every rank from those identical
inputs and drafts the same tree without communicating; sampling draws the same random
numbers everywhere (one shared seed). Only rank 0 writes output.
"""

import os
import signal
import sys
import threading
from typing import Optional

import mlx.core as mx
import numpy as np

from .errors import EagleError

# environment variables that mean "started by a distributed launcher"
LAUNCH_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MLX_JACCL_COORDINATOR")


_group = []


def group() -> Optional[mx.distributed.Group]:
    """The group of this run when a launcher started it with more than one rank, else None."""
    if _group:
        return _group[0]
    if not any(v in os.environ for v in LAUNCH_VARS):
        return None
    try:
        g = mx.distributed.init()
    except Exception as e:  # a hostfile that does not work, a port in use
        raise EagleError(f"the distributed run could not start: {e}") from None
    _group.append(g if g.size() > 1 else None)
    return _group[0]


def rank(g: Optional[mx.distributed.Group]) -> int:
    return g.rank() if g is not None else 0


def shared_seed(g: mx.distributed.Group) -> int:
    """A fresh random seed, the same on every rank (rank 0 draws it)."""
    mine = int.from_bytes(os.urandom(4), "little") >> 1 if g.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array([mine], dtype=mx.int32), group=g).item())


_errors = None  # where the other ranks still write their errors


def errors():
    """The stream for error sentences (on ranks other than 0 the rest of stderr is muted)."""
    return _errors or sys.stderr


def silence_other_ranks(g: Optional[mx.distributed.Group]) -> None:
    """Only rank 0 writes output (other ranks: only their errors); every rank ends with
    one sentence when the launcher stops it (it does when another rank ends)."""
    global _errors
    if g is None:
        return
    if g.rank() != 0:  # the descriptors themselves: whatever holds a reference to them
        sys.stdout.flush()
        sys.stderr.flush()
        _errors = os.fdopen(os.dup(2), "w", buffering=1)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)

    _end_on_sigterm(f"error: rank {g.rank()} stopped: another rank of the distributed run "
                    "ended, or the run was interrupted.\n")


def _end_on_sigterm(sentence: str) -> None:
    """Exit with `sentence` at SIGTERM, within moments, wherever the main thread is. A
    Python signal handler runs only when the main thread returns to the interpreter, and a
    rank whose peer died can sit in MLX's ring send, retrying, for half a minute; so the
    signal also wakes a thread of its own (the interpreter's wakeup descriptor, written by
    its C-level handler), which can run while MLX holds no lock (it releases the GIL while
    it evaluates)."""
    def end(*_):
        os.write(errors().fileno(), sentence.encode())
        os._exit(1)

    signal.signal(signal.SIGTERM, end)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch():
        while True:
            if signal.SIGTERM in os.read(read, 64):
                end()

    threading.Thread(target=watch, name="sigterm-watch", daemon=True).start()


def peer_lost(e: BaseException) -> Optional[str]:
    """The sentence for a communication failure (a rank that died or disappeared; of two
    ranks, the other one is named)."""
    text, g = str(e), (_group[0] if _group else None)
    if isinstance(e, RuntimeError) and text.startswith(("[ring]", "[mpi]", "[jaccl]",
                                                         "[collective]")):
        which = f"rank {1 - g.rank()}: " if g is not None and g.size() == 2 else ""
        return ("another rank of the distributed run stopped or became unreachable "
                f"({which}{text.split('] ', 1)[-1]}).")
    return None


def share_text(g, text: Optional[str]) -> Optional[str]:
    """Rank 0's text (None: the end of input) on every rank."""
    if g is None:
        return text
    data = (text or "").encode("utf-8") if g.rank() == 0 else b""
    head = [len(data), int(text is None)] if g.rank() == 0 else [0, 0]
    n, end = mx.distributed.all_sum(mx.array(head, dtype=mx.int32), group=g).tolist()
    if end:
        return None
    if n == 0:
        return ""
    buf = np.frombuffer(data, dtype=np.uint8).astype(np.int32) if g.rank() == 0 \
        else np.zeros(n, dtype=np.int32)
    out = mx.distributed.all_sum(mx.array(buf), group=g)
    return bytes(np.array(out).astype(np.uint8)).decode("utf-8")


# The message rank 0 of a distributed server sends after every response of a generation,
# and the other ranks receive in the same place: go on, or stop (finished, or cancelled).
CONTINUE, FINISHED, CANCELLED = 0, 1, 2


def share_response_signal(g, signal: int) -> int:
    """Rank 0's CONTINUE, FINISHED or CANCELLED for this response, on every rank (the other
    ranks pass CONTINUE)."""
    if g is None:
        return signal
    mine = signal if g.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array([mine], dtype=mx.int32), group=g).item())
