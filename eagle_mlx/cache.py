"""KV cache for tree verification: append a whole tree, then keep only the accepted rows."""

import mlx.core as mx

from .mlxlm import KVCache


class TreeKVCache(KVCache):
    """mlx-lm's pre-allocated KV cache (grown in steps of 256 slots) plus `keep`, the one
    thing a tree needs that mlx-lm lacks (its `trim` drops a tail; a tree keeps a path).

    A verify pass appends T tree rows after `offset`; `keep` then gathers the
    accepted ones into contiguous slots and sets the length, without re-running
    the model. Nothing is reallocated: the gather writes into the same buffer.
    """

    def keep(self, start: int, rows: mx.array) -> None:
        """Move slots `rows` (absolute, each >= start) to start.. and drop the rest."""
        n = rows.shape[0]
        self.keys[..., start : start + n, :] = mx.take(self.keys, rows, axis=2)
        self.values[..., start : start + n, :] = mx.take(self.values, rows, axis=2)
        self.offset = start + n

    def truncate(self, length: int) -> None:
        """Forget everything after the first `length` slots (mlx-lm's `trim`)."""
        if length < self.offset:
            self.trim(self.offset - length)

    def arrays(self):
        """The buffers to evaluate once a cycle has updated them."""
        return () if self.keys is None else (self.keys, self.values)
