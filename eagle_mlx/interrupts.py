"""Ctrl-C in a command-line tool, from `python -m eagle_mlx.TOOL`'s first import on.

Until a tool has loaded what it works on there is nothing to save, and a KeyboardInterrupt
raised inside an import's or a finaliser's callback would be swallowed ("Exception ignored
in ...") and the tool would go on: Ctrl-C then ends the process at once. `work_started()`
(`cli.started()`) turns this off where a tool's own work begins, from which on Ctrl-C raises
KeyboardInterrupt for the tool to answer.
"""

import os
import signal
import sys

_state = {"interrupted": False, "exit_at_once": True}


def _on_sigint(signum, frame):
    _state["interrupted"] = True
    if _state["exit_at_once"]:
        os.write(2, b"interrupted\n")
        os._exit(130)
    raise KeyboardInterrupt


def _quiet_interrupt(kind, value, tb):
    """Ctrl-C while a command-line tool is still importing ends as it does later: one word
    and exit code 130, no traceback (an extension module that is interrupted while it
    initialises reports an ImportError instead of the KeyboardInterrupt)."""
    if issubclass(kind, KeyboardInterrupt) or _state["interrupted"]:
        print("interrupted", file=sys.stderr, flush=True)
        os._exit(130)
    sys.__excepthook__(kind, value, tb)


def install() -> None:
    """The handlers above, for this process."""
    signal.signal(signal.SIGINT, _on_sigint)
    sys.excepthook = _quiet_interrupt


def work_started() -> None:
    """From now on Ctrl-C raises KeyboardInterrupt (the tool's work has begun)."""
    _state["exit_at_once"] = False
