"""EAGLE speculative decoding for large language models, in MLX.

    import eagle_mlx
    model, tokenizer = eagle_mlx.load(target, eagle=head)
    text = eagle_mlx.generate(model, tokenizer, prompt, max_tokens=256)
"""

import sys as _sys


def _quiet_interrupt(kind, value, tb):
    """Ctrl-C while a command-line tool is still importing ends as it does later: one word
    and exit code 130, no traceback."""
    if issubclass(kind, KeyboardInterrupt):
        import os

        print("interrupted", file=_sys.stderr, flush=True)
        os._exit(130)
    _sys.__excepthook__(kind, value, tb)


if _sys.argv and _sys.argv[0] == "-m":  # `python -m eagle_mlx.TOOL`, before TOOL is found
    _sys.excepthook = _quiet_interrupt

from .checkpoint import load_head  # noqa: E402
from .errors import EagleError  # noqa: E402
from .generation import GenerationResponse, generate, stream_generate  # noqa: E402
from .speculative import PromptCache  # noqa: E402
from .model import EagleModel, load  # noqa: E402
from .target import Target, load_target  # noqa: E402

__version__ = "0.1.0"
__all__ = ["EagleError", "EagleModel", "GenerationResponse", "Target", "generate", "load",
           "load_head", "load_target", "PromptCache", "stream_generate"]
