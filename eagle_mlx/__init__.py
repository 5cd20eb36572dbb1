"""EAGLE speculative decoding for large language models, in MLX.

    import eagle_mlx
    model, tokenizer = eagle_mlx.load(target, eagle=head)
    text = eagle_mlx.generate(model, tokenizer, prompt, max_tokens=256)
"""

import sys as _sys

if _sys.argv and _sys.argv[0] == "-m":  # `python -m eagle_mlx.TOOL`, before TOOL is found
    from .interrupts import install as _install

    _install()

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
