"""The machine's costs for adaptive speculation (`decoding/adaptive.py`), measured at first
use for a (machine, target, head, dtype) and kept in the user's cache
(`$EAGLE_MLX_CACHE`/costs, as the benchmark's tuning is); `benchmark --save-tuning` measures
them again.

A measurement runs real cycles of the engine, each option forced, after a short prefill: the
cycle of a chain of n nodes with nothing drafted (n = 1 is a plain step) at a few n, then the
head's options, whose cycles less the chain of as many nodes are what drafting adds, never
less than the head's own proposal of that option timed alone (catching up: priced from the
proposal timed alone after the head fell CATCH_UP_GAP passes behind). The
engine drafts ahead as it does when generating, and the costs are the cycles' own timings,
the ones the controller reads afterwards (from the cycle's draft to its one sync), so they
include the host's work as generating pays it.

Attention reads every cached position, so the same cycles are timed again after a long
prompt (LONG_CONTEXT positions, or half the model's context, or what a prefill of about
LONG_PREFILL seconds reaches): the controller takes each option's cost at the sequence's
current length from the growth fitted over the two (the drafter's within its draft
window).
"""

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .errors import EagleError
from .outputs import user_cache

COSTS_VERSION = 5                     # 5: the head's drafting always priced
VERIFY_POINTS = (1, 2, 4, 8, 16)      # chain nodes measured (interpolated between)
MEASURE_PROMPT = 12                   # prompt tokens prefilled before measuring
LONG_CONTEXT = 1024                   # ... before measuring again (the costs' growth)
MIN_LONG_CONTEXT = 128                # a model whose context is shorter: measured once
LONG_PREFILL = 4.0                    # seconds the long prompt's prefill may take, about
SLOW_CYCLE = 0.25                     # seconds: a cycle this slow is timed once, not twice
CATCH_UP_GAP = 16                     # plain passes the head falls behind by, to price catching up
LINEAR = 0.9                          # cost(n) >= LINEAR * n * cost(1) from n = 4 on: larger
#                                       n cannot pay (2 alone is too noisy to tell)


def costs_path(model, kv=None, batch: Optional[int] = None) -> Path:
    """The cache file of the model's costs (kv: with its caches quantized so; batch: a
    batch's verify curve at that many rows)."""
    from .tuning import tuning_key, entry_path

    key = dict(tuning_key(model.head_path, model.target.path, model.target.dtype),
               version=COSTS_VERSION)
    if kv is not None:  # (quantized attention costs otherwise)
        key.update(kv_bits=kv.bits, kv_group_size=kv.group_size)
    if batch is not None:
        key["batch"] = int(batch)
    window = draft_window(model.head)
    if window is not None:  # (a windowed head's draft cost stops growing)
        key["draft_window"] = window
    return entry_path(user_cache("costs"), key)


def read_costs(model, kv=None):
    """The cached costs of this model on this machine (None: none, or unreadable)."""
    from .decoding.adaptive import Costs

    f = costs_path(model, kv)
    try:
        return Costs.fromdict(json.loads(f.read_text())["costs"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent or damaged: measured again


def write_costs(model, costs, kv=None) -> Path:
    from .tuning import write_entry

    return write_entry(costs_path(model, kv), {"costs": costs.asdict(),
                                           "measured": time.strftime("%Y-%m-%d %H:%M")})


def head_options(model) -> List:
    """The head's options under adaptive speculation: chains of a few lengths, a small tree
    and the model's own tree (the benchmark's choice, or the default)."""
    from .decoding.adaptive import HEAD_CHAINS, Option, head_chain

    if model.head is None:
        return []
    options = [head_chain(d) for d in HEAD_CHAINS]
    tree = model.tree_settings()
    vocab = model.head.draft_vocab_size
    for total, depth, k in ((6, 2, 2), (tree.total_tokens, tree.depth, tree.draft_top_k)):
        o = Option("head", total, depth + 1, k)
        if 1 < k <= vocab and total <= k + depth * k * k + 1 and o not in options:
            options.append(o)
    return options


def draft_window(head) -> Optional[int]:
    """The positions a drafter reads at most (its draft window), None: all of them."""
    return getattr(head, "draft_window", None)


def long_context(target, short=None) -> int:
    """Where the second measurement is taken: LONG_CONTEXT positions, or half the model's
    context where that is shorter, or as many as a prefill of LONG_PREFILL seconds reaches
    at the rate of the largest chain measured (`short`: the first measurement; a CPU whose
    passes cost as many plain ones as they hold tokens gets a short one); 0: too short to
    tell a slope from noise."""
    n = min(LONG_CONTEXT, target.max_context // 2)
    if short is not None:
        nodes, seconds = short.verify_points[-1]
        n = min(n, int(LONG_PREFILL * nodes / max(seconds, 1e-9)))
    return n if n >= MIN_LONG_CONTEXT else 0


def measure(model, options: Sequence, kv=None):
    """Time cycles of each option on this machine, after a short prompt and again after a
    long one (see the module docstring; kv: a KVQuantization, the caches quantized from the
    start)."""
    from .decoding.adaptive import Costs

    if kv is not None:
        from dataclasses import replace

        kv = replace(kv, start=0)
    verify, draft, catch_up, spread = _measure_at(model, options, MEASURE_PROMPT, kv=kv)
    short = Costs(verify, draft, catch_up, MEASURE_PROMPT)
    longer, at = None, long_context(model.target, short)
    if at:
        ns = sorted(verify)  # (the first, a middle and the last: a line)
        long_verify, long_draft, _, _ = _measure_at(
            model, options, at, points=sorted({ns[0], ns[len(ns) // 2], ns[-1]}),
            labels=set(draft), kv=kv)
        window = draft_window(model.head)
        longer = {"at": at, "draft_at": at if window is None else min(at, window),
                  "draft_window": window, "verify": long_verify, "draft": long_draft}
    return Costs(verify, draft, catch_up, MEASURE_PROMPT, longer, spread)


def _measure_at(model, options: Sequence, prompt_len: int, points=None, labels=None,
                kv=None):
    """The costs after a prompt of `prompt_len` tokens: the chains of nothing drafted at
    VERIFY_POINTS (`points`: at these), then the head's options whose verify leaves room to
    pay (`labels`: those). Returns the seconds by chain size, the drafting's by option
    label, the catching up's per position, and the spread of each verify point's runs."""
    m = _Cycles(model, options, prompt_len, kv)
    try:
        verify, spread = m.verify_points(points)
        draft, catch_up = m.drafting(verify, labels)
    finally:
        m.finish()
    return verify, draft, catch_up, spread


class _Cycles:
    """Real cycles of the engine after a prompt, each option forced, timed as generating
    times them (`state.drafter.seconds`: under mx.distributed rank 0's, so every rank takes
    the same turns)."""

    def __init__(self, model, options: Sequence, prompt_len: int, kv=None):
        from .decoding.adaptive import AdaptiveDrafter, Costs
        from .decoding.engine import Engine, SamplingParams
        from .decoding.lookup import LookupSettings

        target = model.target
        self.drafter = AdaptiveDrafter(Costs({1: 1.0}), target, model.head, options,
                                       LookupSettings(), node_limit=target.tree_node_limit(),
                                       group=getattr(model, "group", None))  # (ranks in step)
        self.engine = Engine(target, self.drafter, SamplingParams(), target.max_context,
                             pipeline=self.drafter.group is None, kv=kv)  # (as generating)
        self.state = self.engine.new_state()
        V = target.vocab_size
        self.engine.prefill(self.state, [(7 + 7919 * i) % V for i in range(prompt_len)])
        self.verify: dict = {}

    def cycle(self) -> Optional[float]:
        if not self.engine.fits(self.state):
            return None
        self.engine.cycle(self.state)
        return self.state.drafter.seconds

    def expected(self, option) -> float:
        """What the points measured so far say of `option`, with room for noise."""
        from .decoding.adaptive import Costs

        if len(self.verify) < 2 or option.kind != "lookup":
            return float("inf") if not self.verify else 1.3 * self.verify[1] * option.nodes
        return 1.3 * Costs(self.verify).verify(option.nodes)

    def timed(self, option) -> List[float]:
        """The cycles of `option`: the first (a head's catches it up), then, the faster of
        two where cycles are fast (warmed up), or one more where the first was slower than
        its neighbours say. The cycle that drafted it ahead is the option before's, and is
        not counted."""
        import mlx.core as mx

        self.state.drafter.forced = option
        self.cycle()  # (the option drafted ahead before this one was forced)
        runs = [self.cycle()]
        if runs[0] is not None and runs[0] < SLOW_CYCLE:
            runs += [self.cycle(), self.cycle()]
        elif runs[0] is not None and runs[0] > self.expected(option):
            runs.append(self.cycle())
        mx.clear_cache()
        runs = [r for r in runs if r is not None]
        if not runs:
            raise EagleError("the model's context is too short to measure its costs in.")
        return runs

    def alone(self, option, runs: int = 2) -> List[tuple]:
        """The head's proposals of `option` timed alone over `runs` cycles, their inputs
        evaluated first and their trees after (a sync each side: not the cycle's own
        timing): (positions it caught up on, seconds) each."""
        import mlx.core as mx

        timings, propose = [], self.drafter.propose

        def timed_alone(st, features, tokens, root):
            mx.eval([x for x in (features, tokens, root) if isinstance(x, mx.array)])
            behind, start = st.pending() + (0 if tokens is None else int(tokens.shape[0])), \
                time.perf_counter()
            tree = propose(st, features, tokens, root)
            mx.eval(tree.tokens, tree.anc)
            timings.append((behind, time.perf_counter() - start))
            return tree

        self.drafter.propose = timed_alone
        self.state.drafter.forced = option
        try:
            for _ in range(runs):  # (each cycle drafts the next ahead: with `option`)
                self.cycle()
        finally:
            del self.drafter.propose
        return timings

    def verify_points(self, points=None):
        """Chains of nothing drafted at `points` (VERIFY_POINTS, stopping where the cost
        grows as fast as the tokens): seconds and their runs' spread, by node count."""
        from .decoding.adaptive import lookup_chain

        verify, spread = self.verify, {}
        self.timed(lookup_chain(0))  # (everything's first run)
        for n in points or VERIFY_POINTS:
            if n - 1 > self.drafter.max_lookup:
                break
            runs = self.timed(lookup_chain(n - 1))
            kept = runs[1:] or runs
            verify[n] = min(kept)
            spread[n] = (max(kept) - verify[n]) / max(verify[n], 1e-9)
            if points is None and n >= 4 and verify[n] >= LINEAR * n * verify[1]:
                break  # (longer chains cannot pay)
        low = 0.0  # (a larger chain never costs less: what noise says otherwise is evened out)
        for n in sorted(verify):
            verify[n] = low = max(verify[n], low)
        return verify, spread

    def drafting(self, verify: dict, labels=None):
        """What each head option's drafting adds (`labels`: those options; else the ones
        whose verify alone leaves room to pay: of the chains, the shortest and the longest;
        where none does, the shortest chain), never less than its proposal timed alone; and
        the catching up's per position."""
        from .decoding.adaptive import PLAIN, Costs

        costs, options = Costs(verify), self.drafter.head_options
        if labels is not None:
            measured = [o for o in options if o.label() in labels]
        else:  # (an option yields at most its depth + 1 tokens)
            can_pay = [o for o in options
                       if costs.verify(o.nodes) < LINEAR * (o.depth + 1) * costs.verify(1)]
            chains = [o for o in can_pay if o.chain]
            measured = chains[:1] + [o for o in can_pay if not o.chain] + chains[1:][-1:]
            if not measured:  # (none can: the shortest chain still, so that no head option
                # is ever priced as drafting for free, nor its catching up, if a loaded
                # machine's verify points corrected later make one look as if it could)
                measured = sorted((o for o in options if o.chain), key=lambda o: o.depth)[:1]
        draft, alone, catch_up = {}, {}, 0.0
        for o in measured:  # (a cycle less the verify of as many nodes, which noise can
            runs = self.timed(o)  # make near zero: never less than the drafting alone)
            alone[o.label()] = self.alone(o)
            draft[o.label()] = max(min(runs[1:] or runs) - costs.verify(o.nodes),
                                   min(s for _, s in alone[o.label()]))
        if measured and labels is None:  # the catching up, from the drafting alone too
            o = measured[0]
            self.state.drafter.forced = PLAIN
            for _ in range(CATCH_UP_GAP):  # (the head falls behind a position a pass)
                self.cycle()
            late = self.alone(o, 1)
            if late:
                steady = min(alone[o.label()], key=lambda r: r[1])
                catch_up = max(late[0][1] - steady[1], 0.0) / max(late[0][0] - steady[0], 1)
        return draft, catch_up

    def finish(self) -> None:
        """Nothing left running: a pass drafted ahead is, and under mx.distributed its
        collectives would meet the ranks' next ones."""
        import mlx.core as mx

        from .decoding.engine import generation_stream

        self.state.drafter.forced = None
        mx.synchronize(generation_stream)


def measure_batch(model, batch: int, points=VERIFY_POINTS, prompt_len: int = MEASURE_PROMPT,
                  until_linear: bool = True) -> Dict[int, float]:
    """Seconds of one verify pass of a batch of `batch` rows (after `prompt_len`
    positions each), every row a chain of n nodes, and its accept (the rows keep their
    root): by n, at `points`, stopping where the pass grows as fast as its tokens (unless
    not `until_linear`). What the batch's cycle pays for its width, whatever each row
    drafts."""
    import mlx.core as mx

    from .decoding.batch import RootDrafter
    from .decoding.engine import Engine, SamplingParams, generation_stream

    target = model.target
    V = target.vocab_size
    engine = Engine(target, RootDrafter(), SamplingParams(), target.max_context)
    caches, lengths = target.make_batch_cache(), []
    with mx.stream(generation_stream):
        for b in range(batch):
            state = engine.new_state()
            engine.prefill(state, [(7 + 7919 * i + 31 * b) % V for i in range(prompt_len)])
            target.batch_join(caches, state.caches)
            lengths.append(state.n)
        curve = {}
        for n in points:
            if max(lengths) + n + 4 > target.max_context:
                break
            runs = []
            for _ in range(3):  # (the first warms the shape up; one more where it is slow)
                if len(runs) == 2 and runs[1] > SLOW_CYCLE:
                    break
                tokens = mx.array([[(7 + 7919 * (m + j)) % V for j in range(n)]
                                   for m in lengths], dtype=mx.int32)
                positions = mx.array(lengths)[:, None] + mx.arange(n)[None]
                anc = mx.broadcast_to(mx.tril(mx.ones((n, n), dtype=mx.bool_)), (batch, n, n))
                mx.eval(tokens, positions, anc)
                start = time.perf_counter()
                hidden, _ = target.verify_batch(tokens, caches, lengths, positions, anc,
                                                max_depth=n - 1)
                picked = mx.argmax(target.lm_head(hidden[:, :1]), axis=-1)
                mx.eval(picked)
                target.batch_accept(caches, [[0]] * batch)
                mx.eval(target.cache_arrays(caches))
                runs.append(time.perf_counter() - start)
                lengths = [m + 1 for m in lengths]
            curve[n] = min(runs[1:])
            if until_linear and n >= 4 and curve[n] >= LINEAR * n * curve[1]:
                break  # (wider passes cannot pay)
        low = 0.0  # (a wider pass never costs less)
        for n in sorted(curve):
            curve[n] = low = max(curve[n], low)
    mx.clear_cache()
    return curve


@contextmanager
def one_measurement_at_a_time(say: Callable[[str], None], group=None):
    """Held while costs are read and, where absent, measured: an exclusive lock on the
    cache folder (`.measuring`), so that two processes of this machine never measure at
    once — each would time the other's load — and the second reads what the first
    measured. Under mx.distributed rank 0 alone holds it (the ranks measure together).
    Where the folder cannot be written or locks are not had, nothing is held."""
    try:
        import fcntl
    except ImportError:  # (no POSIX locks)
        yield
        return
    if group is not None and group.rank() != 0:
        yield
        return
    folder = user_cache("costs")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        f = open(folder / ".measuring", "a")
    except OSError:  # (an unwritable cache: said where the costs are written)
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            say("eagle_mlx: another process is measuring this machine's costs; waiting for "
                "it (two measurements at once would each time the other's load) ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_batch_curve(f: Path) -> Optional[Dict[int, float]]:
    try:
        return {int(n): float(v) for n, v in json.loads(f.read_text())["batch"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent or damaged: measured again


def batch_costs(model, batch: int,
                say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
                refresh: bool = False):
    """The costs a row of a batch of `batch` sequences chooses with (`Costs.in_batch`): the
    model's own, its verify curve the batch's (from the cache, else measured now and
    cached; refresh: measured again)."""
    single = model.costs()
    f = costs_path(model, batch=batch)
    curve = None if refresh else _read_batch_curve(f)
    if not curve:
        with one_measurement_at_a_time(say):
            # (measured meanwhile by another process)
            curve = None if refresh else _read_batch_curve(f)
            if not curve:
                say(f"eagle_mlx: measuring this machine's verify costs for batches of {batch} "
                    f"(once; kept in {user_cache('costs')}) ...")
                start = time.perf_counter()
                curve = measure_batch(model, batch)
                from .tuning import write_entry

                write_entry(f, {"batch": {str(n): v for n, v in curve.items()},
                                "measured": time.strftime("%Y-%m-%d %H:%M")})
                say(f"eagle_mlx: measured in {time.perf_counter() - start:.1f} s.")
    return single.in_batch(curve, batch)


def model_costs(model, refresh: bool = False,
                say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
                kv=None):
    """The model's costs on this machine: from the cache, else measured now (a few seconds,
    announced in one line) and cached. refresh: measure again; kv: with the caches quantized
    so (a KVQuantization). Under mx.distributed every rank takes rank 0's: read from its
    cache, or measured by all ranks together (each cycle timed by rank 0). One process of
    the machine measures at a time (`one_measurement_at_a_time`)."""
    from .decoding.adaptive import Recheck

    g = getattr(model, "group", None)
    costs = None if refresh or g is not None else read_costs(model, kv)
    if costs is None:
        with one_measurement_at_a_time(say, g):
            costs = _measured(model, refresh, say, kv, g)
    costs.recheck = Recheck(costs)
    return costs


def _measured(model, refresh: bool, say: Callable[[str], None], kv, g):
    """`model_costs`' read (again, under the lock: another process may have measured
    meanwhile) and, where there is nothing to read, its measurement."""
    from .decoding.adaptive import Costs
    from .distributed import share_text

    costs = None if refresh else read_costs(model, kv)
    if g is not None:
        shared = share_text(g, "" if costs is None else json.dumps(costs.asdict()))
        costs = Costs.fromdict(json.loads(shared)) if shared else None
    if costs is None:
        packed = "" if kv is None else f" with {kv.bits}-bit KV caches"
        say(f"eagle_mlx: measuring this machine's speculation costs for this model{packed} "
            f"(once; kept in {user_cache('costs')}) ...")
        start = time.perf_counter()
        costs = measure(model, head_options(model), kv)
        if g is not None:
            costs = Costs.fromdict(json.loads(share_text(g, json.dumps(costs.asdict()))))
        if g is None or g.rank() == 0:
            write_costs(model, costs, kv)
        say(f"eagle_mlx: measured in {time.perf_counter() - start:.1f} s.")
    return costs
