"""EAGLE speculative decoding for large language models, in MLX.

    import eagle_mlx
    model, tokenizer = eagle_mlx.load(target, eagle=head)
    text = eagle_mlx.generate(model, tokenizer, prompt, max_tokens=256)
"""

from .checkpoint import load_head
from .errors import EagleError
from .generation import GenerationResponse, generate, stream_generate
from .speculative import PromptCache
from .model import EagleModel, load
from .target import Target, load_target

__version__ = "0.1.0"
__all__ = ["EagleError", "EagleModel", "GenerationResponse", "Target", "generate", "load",
           "load_head", "load_target", "PromptCache", "stream_generate"]
