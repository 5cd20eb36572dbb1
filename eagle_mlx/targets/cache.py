"""KV caches for tree verification: append a whole tree, then keep only the accepted rows.

Full-attention layers keep every position (`TreeKVCache`); sliding-window layers keep a
window of the latest positions plus room for what is appended next (`WindowKVCache`);
linear-attention layers keep a recurrent state (`RecurrentCache`); a batch keeps one
ragged cache per layer (`RaggedKVCache`, `BatchRecurrentCache`).

The words: mlx-lm's where the meaning is mlx-lm's (`update_and_fetch`, `offset`, `trim`,
`state`, `make_mask`); `keep` keeps a tree's accepted path (one sequence: the rows given;
a batch: each row's accepted nodes); `truncate(length)` cuts a sequence back to its first
`length` positions (mlx-lm's `trim` counts from the end) where `reusable(length)` says it
can; `arrays()` are the whole buffers a cycle evaluates (mlx-lm's `state` slices them).
"""

from typing import Optional

import mlx.core as mx

from ..mlxlm import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, create_causal_mask


class TreeKVCache(KVCache):
    """mlx-lm's pre-allocated KV cache (grown in steps of 256 slots) plus `keep`, the one
    thing a tree needs that mlx-lm lacks (its `trim` drops a tail; a tree keeps a path).

    A verify pass appends T tree rows after `offset`; `keep` then gathers the
    accepted ones into contiguous slots and sets the length, without re-running
    the model. Nothing is reallocated: the gather writes into the same buffer.
    """

    base = 0  # the position of slot 0 (a full cache holds every position)

    def keep(self, start: int, rows) -> None:
        """Move slots `rows` (absolute, each >= start; a list or an array) to start.. and
        drop the rest."""
        rows = self._moved(start, rows)
        if rows is None:
            return
        n = rows.shape[0]
        self.keys[..., start : start + n, :] = mx.take(self.keys, rows, axis=2)
        self.values[..., start : start + n, :] = mx.take(self.values, rows, axis=2)
        self.offset = start + n

    def _moved(self, start: int, rows) -> Optional[mx.array]:
        """`keep`'s rows as an array, or None where they are in place already (a plain
        pass, or a whole chain: then only the length changes)."""
        if isinstance(rows, list):
            if rows == list(range(start, start + len(rows))):
                self.offset = start + len(rows)
                return None
            rows = mx.array(rows)
        return rows

    def reusable(self, length: int) -> bool:
        """Whether the cache can be cut back to its first `length` positions."""
        return True

    def snapshot(self) -> dict:
        """What `restore` needs to undo the updates made after this call. The buffers are
        written in place (mlx-lm's `update_and_fetch`), so the cache goes on with copies of
        them: the writes change those, and a forgotten update is never computed (a copy of
        every buffer: for what may be forgotten only)."""
        saved = dict(vars(self))
        if self.keys is not None:
            self.keys, self.values = mx.array(self.keys), mx.array(self.values)
        return saved

    def restore(self, saved: dict) -> None:
        """Back to the `snapshot`: the updates since are forgotten, never evaluated."""
        self.__dict__.clear()
        self.__dict__.update(saved)

    def truncate(self, length: int) -> None:
        """Forget everything after the first `length` slots (mlx-lm's `trim`)."""
        if length < self.offset:
            self.trim(self.offset - length)

    def arrays(self):
        """The buffers to evaluate once a cycle has updated them."""
        return () if self.keys is None else (self.keys, self.values)

    pad_next = False  # the next `update_and_fetch` returns the whole buffer (`padded_mask`)

    def update_and_fetch(self, keys, values):
        return self._fetched(*super().update_and_fetch(keys, values))

    def _fetched(self, keys, values):
        if self.pad_next:
            self.pad_next = False
            return self.keys, self.values
        return keys, values

    def base_after(self, n: int) -> int:
        """The position of slot 0 once `n` new positions are appended."""
        return self.base

    def width_after(self, n: int) -> int:
        """The buffer's slots once `n` positions are appended (mlx-lm's growth rule: whole
        steps of 256 slots)."""
        width = 0 if self.keys is None else self.keys.shape[2]
        if self.keys is not None and self.offset + n <= width:
            return width
        grown = (self.step + n - 1) // self.step * self.step
        return grown + (self.offset if self.keys is not None and self.offset % self.step
                        else width)

    def padded_mask(self, mask: mx.array, n: int) -> mx.array:
        """The boolean mask [..., n, slots] of a pass of `n` positions over this cache,
        widened to the whole buffer the update leaves, the slots past those held masked off;
        the update then returns the whole buffer. The key length then changes only when the
        buffer grows (every `step` slots; a window's every ~window positions), not on every
        pass: a GPU attention that plans per key length (MLX's CUDA one builds a cuDNN graph
        per shape) plans once per buffer instead of once per tree. The masked slots (zeros or
        older rows, finite) weigh exactly 0. A mask of another width is left as it is."""
        held = self.offset + n - self.base_after(n)
        width = self.width_after(n)
        if width <= held or mask.shape[-1] != held or mask.dtype != mx.bool_:
            return mask
        self.pad_next = True
        return mx.concatenate([mask, mx.zeros((*mask.shape[:-1], width - held), mx.bool_)],
                              axis=-1)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedTreeKVCache":
        """This cache quantized (mlx-lm's switch at `quantized_kv_start`, which mlx-lm's
        `generate_step` makes through this method too): every position packed as mlx-lm
        packs it."""
        q = QuantizedTreeKVCache(group_size=group_size, bits=bits)
        q.offset = self.offset
        if self.keys is not None:
            q.keys = mx.quantize(self.keys, group_size=group_size, bits=bits)
            q.values = mx.quantize(self.values, group_size=group_size, bits=bits)
        return q


class DraftWindowKVCache(TreeKVCache):
    """A draft head's cache with a draft window: each pass attends to the last `window`
    positions it held before the pass, and to the pass's own (its attention reads the slots
    from `visible_from` on), so a head's cost stops growing with the context."""

    def __init__(self, window: int):
        super().__init__()
        self.window, self.visible_from = window, 0

    def update_and_fetch(self, keys, values):
        lo = max(0, self.offset - self.window)
        k, v = super().update_and_fetch(keys, values)
        self.visible_from = lo
        return k[..., lo:, :], v[..., lo:, :]


class QuantizedTreeKVCache(QuantizedKVCache):
    """mlx-lm's quantized KV cache (`kv_bits`: each position's keys and values packed in
    groups of `group_size`, with a scale and a bias per group) plus what a tree needs:
    `keep`, `truncate`, snapshots. mlx-lm's attention reads it as it reads its own (its
    `bits` and `group_size` select the quantized attention), and so does the tree forward's."""

    base = 0

    def keep(self, start: int, rows) -> None:
        """As `TreeKVCache.keep`: the accepted rows' packed values, scales and biases moved
        to start.."""
        rows = TreeKVCache._moved(self, start, rows)
        if rows is None:
            return
        n = rows.shape[0]
        for parts in (self.keys, self.values):
            for x in parts:
                x[..., start : start + n, :] = mx.take(x, rows, axis=2)
        self.offset = start + n

    reusable = TreeKVCache.reusable
    restore = TreeKVCache.restore
    truncate = TreeKVCache.truncate

    def snapshot(self) -> dict:
        saved = dict(vars(self))
        if self.keys is not None:
            self.keys = tuple(mx.array(x) for x in self.keys)
            self.values = tuple(mx.array(x) for x in self.values)
        return saved

    def arrays(self):
        return () if self.keys is None else (*self.keys, *self.values)


class BoundedKVCache(RotatingKVCache):
    """mlx-lm's bounded cache (`max_kv_size`: its `RotatingKVCache` with the first `keep`
    positions kept, then a rotating window), plus a tree's `keep`. Its own updates are
    mlx-lm's, so a prefill and plain decoding over it are mlx-lm's exactly: a one-token step
    at position P sees the kept positions and P - W + 1..P, W = max_size - keep (what
    `tree_mask` gives every tree node, within its ancestors); a chunk of several tokens
    attends as mlx-lm's concatenating update lays it out (`make_mask`)."""

    base = 0

    def __init__(self, max_size: int, keep: int = 4):
        super().__init__(max_size=max_size, keep=keep)

    @property
    def window(self) -> int:
        return self.max_size - self.keep

    def held_positions(self) -> mx.array:
        """The positions the slots hold once a chunk of several tokens is appended (mlx-lm's
        concatenating update: in order, the kept ones then the latest, trimmed to
        max_size - 1)."""
        keys, _, n, keep, max_size, idx = self.state
        if keys is None:
            return mx.zeros((0,), dtype=mx.int32)
        held = keys.shape[2] if (idx == keys.shape[2] or idx < n) else idx
        held = min(held, max_size - 1)
        if held <= keep:
            return mx.arange(n - held, n)
        return mx.concatenate([mx.arange(keep), mx.arange(n - (held - keep), n)])

    def tree_mask(self, anc: mx.array, queries: mx.array) -> mx.array:
        """[T, slots] for a tree of T nodes at positions `queries` with ancestor-or-self mask
        `anc` [T, T]: the kept positions, the committed ones within each node's window, its
        ancestors — what one-token steps at those positions would see."""
        held = self.held_positions()
        seen = (held[None, :] < self.keep) | ((queries[:, None] - held[None, :]) < self.window)
        return mx.concatenate([seen, anc], axis=1)

    def keep_rows(self, start: int, rows) -> None:
        """After a tree pass (mlx-lm's concatenating update appended it, in order, at the
        end; a lone root was written in place): the accepted rows `rows` (absolute positions,
        root first) stay, moved to follow the committed ones."""
        keys, values, offset, keep, max_size, idx = self.state
        rows = [int(r) for r in (rows.tolist() if isinstance(rows, mx.array) else rows)]
        T = offset - start
        if T == 1:
            return  # (in place)
        first = keys.shape[2] - T                       # the tree's first slot
        picked = mx.array([first + (r - start) for r in rows])
        keys = mx.concatenate([keys[..., :first, :], mx.take(keys, picked, axis=2)], axis=2)
        values = mx.concatenate([values[..., :first, :], mx.take(values, picked, axis=2)],
                                axis=2)
        self.state = (keys, values, start + len(rows), keep, max_size, first + len(rows))

    def reusable(self, length: int) -> bool:
        return length >= self.offset or self.offset < self.max_size

    truncate = TreeKVCache.truncate

    def arrays(self):
        keys, values = self.state[:2]
        return () if keys is None else (keys, values)


class WindowKVCache(TreeKVCache):
    """The cache of a sliding-window layer: the last `window + 1` positions (a new token
    sees the last `window - 1` besides itself; a Gemma 4 assistant's query, at the position
    after them, reads `window + 1`) plus room for a prefill chunk or a tree, in slots that
    never wrap.

    Slot i holds absolute position `base + i`; positions stay in order, so a tree's rows
    are appended and kept exactly as in a full cache, and cutting back is exact while the
    positions it needs are still held. When an update would overflow the buffer, the
    positions no new token can see are dropped: the kept ones are copied to the front of a
    buffer sized for them, the update and `room` (= window) more slots, so the copy (window
    slots) is paid once per ~window tokens, and the buffer holds at most about twice the
    window besides a prefill chunk or a tree. Between such copies the buffer also holds
    positions older than the window; the band mask (`make_mask`, `band`) hides them.
    """

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.room = window  # slots beyond what an update needs: a copy per ~window tokens
        self.base = 0

    def _fits(self, n: int) -> bool:
        return self.keys is not None and self.offset - self.base + n <= self.keys.shape[2]

    def base_after(self, n: int) -> int:
        """The position of slot 0 once `n` new positions are appended."""
        return self.base if self._fits(n) else max(self.base, self.offset - self.window - 1)

    def width_after(self, n: int) -> int:
        return self.keys.shape[2] if self._fits(n) else \
            self.offset - self.base_after(n) + n + self.room

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        if not self._fits(n):
            base = self.base_after(n)
            held = self.offset - base
            size = held + n + self.room
            k = mx.zeros((*keys.shape[:2], size, keys.shape[3]), keys.dtype)
            v = mx.zeros((*values.shape[:2], size, values.shape[3]), values.dtype)
            if self.keys is not None and held:
                k[..., :held, :] = self.keys[..., base - self.base : self.offset - self.base, :]
                v[..., :held, :] = self.values[..., base - self.base : self.offset - self.base, :]
            self.keys, self.values, self.base = k, v, base
        start = self.offset - self.base
        self.keys[..., start : start + n, :] = keys
        self.values[..., start : start + n, :] = values
        self.offset += n
        return self._fetched(self.keys[..., : self.offset - self.base, :],
                             self.values[..., : self.offset - self.base, :])

    @property
    def state(self):
        return () if self.keys is None else (self.keys[..., : self.offset - self.base, :],
                                             self.values[..., : self.offset - self.base, :])

    def band(self, queries: mx.array, n: int) -> mx.array:
        """[T, keys] True where a query at absolute position `queries[t]` is within the
        window of the key in each slot, for an update of n positions (the tree's own rows
        carry the queries' positions)."""
        base = self.base_after(n)
        held = mx.arange(base, self.offset)
        kpos = mx.concatenate([held, queries]) if self.offset > base else queries
        return (queries[:, None] - kpos[None, :]) < self.window

    def make_mask(self, n: int, window_size=None, return_array: bool = False):
        """mlx-lm's mask call (its models ask the first cache of each kind): causal within
        the window, over this cache's slots."""
        base = self.base_after(n)
        if n == 1 and self.offset - base < self.window:
            return None  # every held position is within the window
        return create_causal_mask(n, self.offset - base, window_size=self.window)

    def keep(self, start: int, rows) -> None:
        b = self.base
        super().keep(start - b, [r - b for r in rows] if isinstance(rows, list) else rows - b)
        self.offset += b

    @property
    def to_quantized(self):
        """(None: a window stays in float under `kv_bits`, as mlx-lm's rotating caches
        cannot be quantized; `hasattr` says so to mlx-lm's switch.)"""
        raise AttributeError("a sliding window's cache is not quantized")

    def reusable(self, length: int) -> bool:
        # the next token at `length` must see positions length-window+1.. (all held)
        return length >= self.offset or self.base == 0 or length - self.base >= self.window - 1

    def truncate(self, length: int) -> None:
        if length >= self.offset:
            return
        if not self.reusable(length):
            raise ValueError(f"positions before {self.base} are no longer cached")
        self.offset = length


class RecurrentCache(ArraysCache):
    """The cache of a linear-attention (Gated DeltaNet) layer: mlx-lm's `ArraysCache` of
    [convolution window (the last K-1 projected rows), recurrent state], plus the number
    of positions it has absorbed and, between a tree verify and its acceptance, every
    node's state and projected row (`pending`).

    A recurrent state cannot be cut back: the cache is reusable only at the length it
    holds (`reusable`); acceptance makes the accepted node's state and the window ending
    at it the cache (`keep`), with no recomputation."""

    def __init__(self, conv_rows: int):
        super().__init__(size=2)
        self.conv_rows = conv_rows  # K - 1
        self.offset = 0
        self.pending = None  # (states [T, Hv, Dv, Dk], rows [T, conv_dim]) of a tree

    def advance(self, n: int) -> None:
        super().advance(n)
        self.offset += n

    def window(self, width: int, dtype) -> mx.array:
        """The projected rows the next position's convolution sees before its own [K-1,
        width] (zeros before the first position, as mlx-lm's layer starts)."""
        if self[0] is not None:
            return self[0][0]
        return mx.zeros((self.conv_rows, width), dtype)

    def keep(self, start: int, rows) -> None:
        states, projected = self.pending
        rows = mx.array(rows) if isinstance(rows, list) else rows
        path = rows - start
        self[1] = states[path[-1:]]
        window = mx.concatenate([self.window(projected.shape[-1], projected.dtype),
                                 projected[path]])
        self[0] = window[-self.conv_rows:][None]
        self.offset = start + rows.shape[0]
        self.pending = None

    def reusable(self, length: int) -> bool:
        return length == self.offset

    def truncate(self, length: int) -> None:
        if length != self.offset:
            raise ValueError(f"a recurrent state holds {self.offset} positions, not {length}")

    def arrays(self):
        return tuple(a for a in self.cache if a is not None)


class PositionedKVCache(TreeKVCache):
    """A draft head's cache for a sliding-window layer: also the position of every slot
    (the nodes of a drafted tree level share one), which the window's mask reads."""

    def __init__(self):
        super().__init__()
        self.positions = mx.zeros((0,), dtype=mx.int32)

    def record_positions(self, positions: mx.array) -> None:
        """The positions of the next update (called before it)."""
        self.positions = mx.concatenate([self.positions[: self.offset],
                                         positions.astype(mx.int32)])

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.positions = self.positions[: self.offset]


class HeadCache:
    """A draft head's per-sequence state with one cache per decoder layer (EAGLE-3 heads
    of several layers, MTP modules): they hold the same positions, so `offset` and
    `truncate` are the first's and every layer's."""

    def __init__(self, layers: int, positioned: bool = False, window: Optional[int] = None):
        """positioned: layers that record their positions (a head with sliding windows);
        window: a draft window (`DraftWindowKVCache`)."""
        self.layers = [PositionedKVCache() if positioned else
                       TreeKVCache() if window is None else DraftWindowKVCache(window)
                       for _ in range(layers)]

    @property
    def offset(self) -> int:
        return self.layers[0].offset

    def truncate(self, length: int) -> None:
        for c in self.layers:
            c.truncate(length)

    def arrays(self):
        return tuple(a for c in self.layers for a in c.arrays())


class RaggedKVCache:
    """One attention layer's cache for a batch of sequences of different lengths (batched
    speculation): buffers [B, heads, slots, D] where row b's slot s holds position
    `bases[b] + s` for the positions `bases[b]..lengths[b]-1` it holds (a row joined from a
    sliding-window cache starts at that cache's base), each row's new positions (a tree
    padded to the batch's widest) written after its own, and each row's accepted tree rows
    kept in place — per row only the slots it appends or keeps are written, the batch is
    never copied by a cycle. `mask` gives the [B, 1, T, slots] boolean mask of a pass (each
    row's own prefix — within `window` of each query for a sliding layer — then its tree's
    ancestors); `keep` ends the pass. Rows join (`extend`, from a sequence's own cache
    after its prefill) and leave (`filter`) between cycles.

    Not mlx-lm's `BatchKVCache`: it left-pads rows so that they end together, which would
    give every row's tree another offset per cycle (rows accept different numbers of
    nodes); right-ragged rows keep each tree at its own row's end."""

    step = 256
    offset = 0  # (mlx-lm's modules read it for RoPE; a batch gives positions instead)

    def __init__(self, lengths=(), bases=None):
        self.lengths = [int(n) for n in lengths]
        self.bases = [0] * len(self.lengths) if bases is None else [int(b) for b in bases]
        self.keys = self.values = None
        self.written = 0  # positions the current pass appended per row

    @property
    def held(self):
        return [n - b for n, b in zip(self.lengths, self.bases)]

    def _grow(self, B, H, D, Dv, dtype, need):
        have = 0 if self.keys is None else self.keys.shape[2]
        if need <= have:
            return
        extra = ((need - have + self.step - 1) // self.step) * self.step
        k, v = mx.zeros((B, H, extra, D), dtype), mx.zeros((B, H, extra, Dv), dtype)
        self.keys = k if self.keys is None else mx.concatenate([self.keys, k], axis=2)
        self.values = v if self.values is None else mx.concatenate([self.values, v], axis=2)

    def update_and_fetch(self, keys, values):
        """keys/values [B, heads, T, D]: row b's T new positions go after what it holds;
        returns every slot any row uses (rows' masks hide the others)."""
        B, H, T, D = keys.shape
        need = max(self.held) + T
        self._grow(B, H, D, values.shape[-1], keys.dtype, need)
        slots = (mx.array(self.held)[:, None] + mx.arange(T)[None, :])[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(slots, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(slots, values.shape),
                                        values, axis=2)
        self.written = T
        return self.keys[..., :need, :], self.values[..., :need, :]

    def mask(self, tree=None, T=None, window=None, positions=None) -> mx.array:
        """[B, 1, T, slots] for a pass appending T positions a row (asked before or after
        the update): a row's queries see its own prefix, and among its new positions those
        `tree` [B, T, T] allows (None: causally). window: a sliding layer's W, with
        `positions` [B, T] the queries' positions: a query at p sees keys at p-W+1..p."""
        T = T or self.written
        B = len(self.lengths)
        held = mx.array(self.held)[:, None]
        slot = mx.arange(max(self.held) + T)[None, :]
        prefix = slot < held                                            # [B, S]
        j = slot - held                                                 # slot's place in the pass
        inside = (j >= 0) & (j < T)
        if tree is None:
            tree = mx.tril(mx.ones((T, T), dtype=mx.bool_))[None]
        jj = mx.clip(j, 0, T - 1)                                       # [B, S]
        allowed = mx.take_along_axis(mx.broadcast_to(tree, (B, T, T)),
                                     mx.broadcast_to(jj[:, None, :], (B, T, jj.shape[1])), axis=2)
        mask = prefix[:, None, :] | (inside[:, None, :] & allowed)
        if window is not None:
            if positions is None:
                positions = mx.array(self.lengths)[:, None] + mx.arange(T)[None, :]
            bases = mx.array(self.bases)[:, None]
            kpos = mx.where(prefix, bases + slot,
                            mx.take_along_axis(positions, jj, axis=1))     # [B, S]
            mask = mask & ((positions[:, :, None] - kpos[:, None, :]) < window)
        return mask[:, None]

    def keep(self, kept=None) -> None:
        """End a pass: every row keeps all its new positions (kept None) or kept[b], the
        pass-relative indices of its accepted nodes (root first, parents before children),
        moved to follow its prefix."""
        T = self.written
        if kept is None:
            self.lengths = [n + T for n in self.lengths]
        else:
            width = max(1, max(len(k) for k in kept))
            # per row: source slots (padded by repeating the last; a row keeping nothing
            # rewrites the slot after its own)
            src = mx.array([[n + i for i in k] + [n + (k[-1] if k else 0)] * (width - len(k))
                            for n, k in zip(self.held, kept)])
            dst = mx.array([[n + min(i, max(len(k) - 1, 0)) for i in range(width)]
                            for n, k in zip(self.held, kept)])
            for name in ("keys", "values"):
                buf = getattr(self, name)
                B, H, _, D = buf.shape
                rows = mx.take_along_axis(buf, mx.broadcast_to(src[:, None, :, None],
                                                               (B, H, width, D)), axis=2)
                setattr(self, name, mx.put_along_axis(
                    buf, mx.broadcast_to(dst[:, None, :, None], (B, H, width, D)), rows, axis=2))
            self.lengths = [n + len(k) for n, k in zip(self.lengths, kept)]
        self.written = 0

    def row(self, b: int):
        """Row b's keys and values [1, heads, held, D] (positions bases[b]..lengths[b]-1)."""
        n = self.held[b]
        return self.keys[b: b + 1, :, :n, :], self.values[b: b + 1, :, :n, :]

    def extend(self, cache) -> None:
        """Add a row: a sequence's own cache (`TreeKVCache` / `WindowKVCache`) after its
        prefill, its positions copied once (None or an empty cache: an empty row)."""
        if cache is None or cache.keys is None or cache.offset == 0:
            self.lengths.append(0)
            self.bases.append(0)
            if self.keys is not None:
                z = lambda a: mx.zeros((1, *a.shape[1:]), a.dtype)  # noqa: E731
                self.keys = mx.concatenate([self.keys, z(self.keys)])
                self.values = mx.concatenate([self.values, z(self.values)])
            return
        n, base = cache.offset, getattr(cache, "base", 0)
        k, v = cache.keys[..., : n - base, :], cache.values[..., : n - base, :]
        if self.keys is None:
            H, D, Dv = k.shape[1], k.shape[3], v.shape[3]
            B = len(self.lengths)  # (rows so far: empty)
            self.keys = mx.zeros((B, H, 0, D), k.dtype)
            self.values = mx.zeros((B, H, 0, Dv), v.dtype)
        width = max(self.keys.shape[2], ((n - base + self.step - 1) // self.step + 1) * self.step)
        pad = lambda a, s: mx.pad(a, [(0, 0), (0, 0), (0, width - s), (0, 0)])  # noqa: E731
        self.keys = mx.concatenate([pad(self.keys, self.keys.shape[2]), pad(k, n - base)])
        self.values = mx.concatenate([pad(self.values, self.values.shape[2]),
                                      pad(v, n - base)])
        self.lengths.append(n)
        self.bases.append(base)

    def extract(self, b: int, window=None):
        """Row b as a sequence's own cache (`TreeKVCache`, or a `WindowKVCache` of `window`),
        copied: what it keeps for its next turn after leaving the batch."""
        k, v = self.row(b)
        c = TreeKVCache() if window is None else WindowKVCache(window)
        n = self.held[b]
        step = TreeKVCache.step
        size = ((n + step - 1) // step + 1) * step
        c.keys = mx.pad(k, [(0, 0), (0, 0), (0, size - n), (0, 0)])
        c.values = mx.pad(v, [(0, 0), (0, 0), (0, size - n), (0, 0)])
        # copied now: left lazy, the copy would keep the whole batch's buffer alive until
        # the sequence's next turn (a long run's memory grew by a batch per waiting turn)
        mx.eval(c.keys, c.values)
        c.offset = self.lengths[b]
        if window is not None:
            c.base = self.bases[b]
        return c

    def set_row(self, b: int, cache) -> None:
        """Row b replaced by a sequence's own cache (a drafter that ran on its own)."""
        n = cache.offset
        if n == 0:
            self.lengths[b] = 0
            return
        k, v = cache.keys[..., :n, :], cache.values[..., :n, :]
        self._grow(len(self.lengths), k.shape[1], k.shape[3], v.shape[3], k.dtype, n)
        self.keys[b: b + 1, :, :n, :] = k
        self.values[b: b + 1, :, :n, :] = v
        self.lengths[b], self.bases[b] = n, 0

    def truncate_rows(self, lengths) -> None:
        """Every row back to `lengths` positions (a draft's levels dropped)."""
        self.lengths = [int(n) for n in lengths]

    def level_mask(self, stable, tree_mask: mx.array) -> mx.array:
        """[B, 1, T, slots] for a draft level appended after each row's drafted levels: row
        b's queries see its `stable[b]` real positions, then the drafted slots that
        `tree_mask[b]` [T, drafted + T] allows."""
        B, T, W = tree_mask.shape
        st = mx.array(list(stable))[:, None]
        slot = mx.arange(max(self.held) + T)[None, :]
        prefix = slot < st
        j = slot - st
        inside = (j >= 0) & (j < W)
        allowed = mx.take_along_axis(tree_mask, mx.broadcast_to(
            mx.clip(j, 0, W - 1)[:, None, :], (B, T, slot.shape[1])), axis=2)
        return (prefix[:, None, :] | (inside[:, None, :] & allowed))[:, None]

    def filter(self, rows) -> None:
        """Keep only `rows` (indices, in order): the others have left the batch."""
        idx = mx.array(list(rows), dtype=mx.int32)
        if self.keys is not None:
            self.keys, self.values = self.keys[idx], self.values[idx]
        self.lengths = [self.lengths[i] for i in rows]
        self.bases = [self.bases[i] for i in rows]

    def arrays(self):
        return () if self.keys is None else (self.keys, self.values)


class BatchRecurrentCache:
    """A linear-attention layer's caches for a batch: each row's convolution window [B, K-1,
    C] and recurrent state [B, Hv, Dv, Dk] stacked, and between a tree verify and its
    acceptance every node's state and projected row ([B, T, ...], `pending`)."""

    offset = 0

    def __init__(self, conv_rows: int):
        self.conv_rows = conv_rows
        self.windows = self.states = None
        self.pending = None

    def extend(self, cache) -> None:
        """Add a row: a sequence's own `RecurrentCache` after its prefill."""
        w, s = cache[0], cache[1]
        self.windows = w if self.windows is None else mx.concatenate([self.windows, w])
        self.states = s if self.states is None else mx.concatenate([self.states, s])

    def filter(self, rows) -> None:
        idx = mx.array(list(rows), dtype=mx.int32)
        self.windows, self.states = self.windows[idx], self.states[idx]

    def extract(self, b: int, offset: int) -> "RecurrentCache":
        """Row b as a sequence's own `RecurrentCache` (holding `offset` positions)."""
        c = RecurrentCache(self.conv_rows)
        c[0], c[1] = self.windows[b: b + 1], self.states[b: b + 1]
        c.offset = offset
        return c

    def keep(self, kept) -> None:
        """Each row keeps the state of its deepest accepted node and the window ending at it
        (kept[b]: the pass-relative indices of its accepted nodes, root first)."""
        states, rows = self.pending            # [B, T, Hv, Dv, Dk], [B, T, C]
        K1 = self.conv_rows
        last = mx.array([[k[-1]] for k in kept])
        self.states = mx.take_along_axis(states, last[:, :, None, None, None], axis=1)[:, 0]
        # the last K-1 of (held window, accepted rows)
        width = max(len(k) for k in kept)
        path = mx.array([k + [k[-1]] * (width - len(k)) for k in kept])
        accepted = mx.take_along_axis(rows, path[:, :, None], axis=1)        # [B, width, C]
        joined = mx.concatenate([self.windows, accepted], axis=1)
        ends = mx.array([K1 + len(k) for k in kept])
        pick = ends[:, None] - K1 + mx.arange(K1)[None, :]
        self.windows = mx.take_along_axis(joined, pick[:, :, None], axis=1)
        self.pending = None

    def arrays(self):
        return () if self.states is None else (self.windows, self.states)


class BatchHeadCache:
    """A batch of draft heads' caches, one `RaggedKVCache` per head layer (rows aligned
    with the batch's rows): what `draft_dynamic_batch` drafts against. A sequence's own
    head caches (one per layer, None: a row without a head) move in when it joins and out
    when it leaves or drafts on its own."""

    def __init__(self, layers: int):
        self.layers = [RaggedKVCache() for _ in range(layers)]

    def join(self, own: Optional[list]) -> None:
        """Add a row: a sequence's own head caches."""
        for i, c in enumerate(self.layers):
            c.extend(None if own is None else own[i])

    def copy_out(self, b: int, own: list) -> None:
        """Row b into the sequence's own head caches (it leaves, or drafts on its own)."""
        for mine, c in zip(own, self.layers):
            if c.lengths[b] == 0:
                mine.keys = mine.values = None
                mine.offset = 0
                continue
            row = c.extract(b)
            mine.keys, mine.values, mine.offset = row.keys, row.values, row.offset

    def copy_in(self, b: int, own: list) -> None:
        """Row b replaced by the sequence's own head caches (after it drafted on its own)."""
        for mine, c in zip(own, self.layers):
            c.set_row(b, mine)

    def filter(self, rows) -> None:
        for c in self.layers:
            c.filter(rows)

    def arrays(self):
        return tuple(a for c in self.layers for a in c.arrays())
