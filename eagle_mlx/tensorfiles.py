"""Safetensors files read without loading them: the header (names, dtypes, shapes, byte
ranges), from which the MTP reader takes only its tensors and the feature shards map their
rows (no MLX, no mlx-lm: cheap to import)."""

import json
import struct
from pathlib import Path

import numpy as np

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
                      "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                      "BOOL": np.bool_}


def safetensors_header(path: Path):
    """(header, offset of the first tensor byte) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n
