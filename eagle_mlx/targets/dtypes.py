"""The dtypes a target's weights are loaded in (a module of its own: the command-line tools
read the choices before anything imports mlx-lm)."""

import mlx.core as mx

DTYPE_CHOICES = ("auto", "stored", "float32", "float16", "bfloat16")  # weights at load time
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}  # casts
