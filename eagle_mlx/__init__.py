"""EAGLE speculative decoding for large language models, in MLX.

    import eagle_mlx
    model, tokenizer = eagle_mlx.load(target, eagle=head)
    text = eagle_mlx.generate(model, tokenizer, prompt, max_tokens=256)
"""

import sys as _sys

_interrupted = False
# Until a tool has loaded what it works on there is nothing to save, and a KeyboardInterrupt
# raised inside an import's or a finaliser's callback would be swallowed ("Exception
# ignored in ...") and the tool would go on: Ctrl-C then ends the process at once.
# `cli.started()` turns this off where a tool's own work begins.
_exit_at_once = True


def _on_sigint(signum, frame):
    global _interrupted
    _interrupted = True
    if _exit_at_once:
        import os

        os.write(2, b"interrupted\n")
        os._exit(130)
    raise KeyboardInterrupt


def _quiet_interrupt(kind, value, tb):
    """Ctrl-C while a command-line tool is still importing ends as it does later: one word
    and exit code 130, no traceback (an extension module that is interrupted while it
    initialises reports an ImportError instead of the KeyboardInterrupt)."""
    if issubclass(kind, KeyboardInterrupt) or _interrupted:
        import os

        print("interrupted", file=_sys.stderr, flush=True)
        os._exit(130)
    _sys.__excepthook__(kind, value, tb)


if _sys.argv and _sys.argv[0] == "-m":  # `python -m eagle_mlx.TOOL`, before TOOL is found
    import signal as _signal

    _signal.signal(_signal.SIGINT, _on_sigint)
    _sys.excepthook = _quiet_interrupt

from .errors import EagleError  # noqa: E402

# The rest is imported when first used: mlx-lm pulls in transformers (and torch, where it
# is installed), seconds that a tool refusing a bad flag, or printing --help, need not pay.
_LAZY = {"load_head": "heads.read", "GenerationResponse": "decoding.responses",
         "generate": "generation", "stream_generate": "generation",
         "PromptCache": "decoding.steps", "EagleModel": "model", "load": "model",
         "Target": "targets.target", "load_target": "targets.load",
         "GenerationSettings": "decoding.settings", "LookupSettings": "decoding.lookup",
         "batch_generate": "generation", "BatchGenerator": "decoding.batch"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"
__all__ = ["EagleError", "EagleModel", "GenerationResponse", "GenerationSettings", "Target",
           "generate", "load", "LookupSettings", "batch_generate", "BatchGenerator",
           "load_head", "load_target", "PromptCache", "stream_generate"]
