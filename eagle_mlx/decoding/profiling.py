"""Profiling the cycle from outside: the same phases as `Engine.cycle`, each evaluated and
timed on its own (a sync after every phase: for profiling, not for measuring speed), and
the MLX operations each phase evaluates counted."""

import io
import re
import time

import mlx.core as mx

from .engine import generation_stream


class PhaseTimer:
    """Seconds spent in each phase of the cycle: draft / verify / accept / update."""

    def __init__(self):
        self.seconds = {"draft": 0.0, "verify": 0.0, "accept": 0.0, "update": 0.0}
        self.cycles = 0
        self._last = None

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, phase: str, *arrays) -> None:
        if self._last is None:
            return
        mx.eval(*arrays)  # SYNC (profiling only)
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now
        self.cycles += phase == "update"


class GraphCounter(PhaseTimer):
    """Counts the MLX operations (graph nodes) each phase of the cycle evaluates, by kind:
    what a device's per-kernel launch cost multiplies. On the CPU, MLX's fast kernels
    (RoPE, attention, RMSNorm) run as their composite graphs and count as many nodes; on
    a GPU each is one. It times the phases as PhaseTimer does; the counting itself is kept
    out of them (and added up in `counting_seconds`)."""

    def __init__(self):
        super().__init__()
        self.nodes = {phase: 0 for phase in self.seconds}
        self.kinds = {}
        self.counting_seconds = 0.0

    def lap(self, phase: str, *arrays) -> None:
        if self._last is not None and arrays:
            start = time.perf_counter()
            dot = io.StringIO()
            mx.export_to_dot(dot, *arrays)
            labels = re.findall(r'label ="([^"]+)"', dot.getvalue())
            self.nodes[phase] += len(labels)
            for label in labels:
                self.kinds[label] = self.kinds.get(label, 0) + 1
            spent = time.perf_counter() - start
            self._last += spent
            self.counting_seconds += spent
        super().lap(phase, *arrays)

    def per_cycle(self) -> dict:
        cycles = max(self.cycles, 1)
        return {"nodes": {k: v / cycles for k, v in self.nodes.items()},
                "total": sum(self.nodes.values()) / cycles,
                "by_kind": {k: v / cycles for k, v in
                            sorted(self.kinds.items(), key=lambda kv: -kv[1])}}


def profiled_cycle(engine, state, timer: PhaseTimer):
    """`engine.cycle(state)`, phase by phase, with `timer` lapping after each."""
    timer.start()
    with mx.stream(generation_stream):
        tree = engine.draft(state)
        timer.lap("draft", tree.tokens, tree.anc)
        verified = engine.verify(state, tree)
        timer.lap("verify", verified.logits)
        accepted = engine.accept(tree, verified, state.key())
        timer.lap("accept", *accepted, tree.tokens)
        step = engine.update(state, tree, verified, accepted)
        timer.lap("update", *engine.updated_arrays(state))
    return step
