"""The one place the package imports mlx-lm: every name it uses, public ones only.

mlx-lm builds, loads and runs the models (`load_model`, `load_tokenizer`, the cache classes,
`generate_step`, `make_sampler`, ...). Importing them here, once, keeps the version contract
in one file: pyproject's lower bound is the oldest mlx-lm the suite passes with.
"""

from mlx_lm.models.cache import BatchKVCache, KVCache  # noqa: F401
from mlx_lm.generate import generate_step  # noqa: F401
