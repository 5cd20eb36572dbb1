"""EAGLE speculative decoding for large language models, in MLX."""

from .errors import EagleError
from .target import Target, load_target

__version__ = "0.1.0"
from .generate import GenerationResponse, generate, stream_generate
from .model import EagleModel, load
