"""mx.compile for the parts of a cycle whose shapes a tree fixes (the draft's per-level
ranking, the tree's rerank and masks, acceptance): each is traced once per shape and then
runs as fused kernels, instead of dozens of small ones rebuilt in Python every cycle.

EAGLE_MLX_COMPILE=0 runs them uncompiled (the same operations, one kernel each).
"""

import os
from functools import partial

import mlx.core as mx

ENABLED = os.environ.get("EAGLE_MLX_COMPILE", "1") != "0"
_cache = {}


def compiled(fn, *static, random: bool = False):
    """`fn` with its leading `static` arguments bound (Python values: one compiled
    function per distinct value), compiled unless switched off. `random`: fn draws from
    MLX's global random state, which the compiled function carries in and out."""
    key = (fn, static, random, ENABLED)
    if key not in _cache:
        bound = partial(fn, *static) if static else fn
        if ENABLED:
            bound = (mx.compile(bound, inputs=mx.random.state, outputs=mx.random.state)
                     if random else mx.compile(bound))
        _cache[key] = bound
    return _cache[key]
