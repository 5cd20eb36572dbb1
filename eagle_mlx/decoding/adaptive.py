"""Adaptive speculation (`speculate="auto"`): every cycle takes the option with the highest
expected tokens per second, from the machine's measured costs and the sequence's own
acceptance so far.

The options: plain decoding (the root alone), a prompt-lookup chain of chosen length (where
the context's end occurred before), the head's chains and trees at a few sizes, and the
head's tree merged with the lookup branches. For each:

* **expected tokens** of a cycle, 1 + sum over depths d of P(the first d drafted tokens are
  accepted): for a head, from per-depth acceptance (`Survival`: the share of cycles that
  reached depth d - 1 and accepted depth d, with a prior and a short memory, so a sequence
  whose text changes is noticed within a few cycles); for lookup, from the per-token
  acceptance after a match of m tokens (`LookupAcceptance`: the calibration as prior,
  corrected by what this sequence accepted); merged, either accepting;
* **seconds** of a cycle (`Costs`): measured once per machine, target and drafter
  (`eagle_mlx.costs`), scaled by the drift the cycles' own timings show (context growth,
  throttling, other processes).

Exploration: an option that does not pay is not drafted, so its estimate would never
change; it is tried again from an exploration budget that grows by EXPLORE of every cycle's
time, each try spending what it is expected to cost beyond the best option (the time its
expected tokens would take at the best option's rate) and, once run, what it really lost
beyond that (the time it overran, the tokens it fell short by at that rate: a hopeful prior
spends no more than its share). A sequence where nothing pays loses at most about EXPLORE
of its time; a try that shows the head pays makes it the choice at
once. Lookup chains are tried so too where the context's end occurred before and plain
decoding is the choice (half the budget is theirs then, half the head's): costs measured on
a loaded machine can make a pass over a few tokens look dearer than it is, and only a
lookup cycle's own timing (`Costs.per_node`) and acceptance correct that.

The choice for a cycle depends only on what came before it, and every option's tree is
deterministic, so the output is exactly the target's whatever is chosen (greedy: plain
decoding's tokens; sampling: its distribution).
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from .drafters import Drafter
from .lookup import LookupDrafter, LookupSettings, build_tree, head_trie
from .registry import head_drafter
from .tree import Tree

EXPLORE = 0.03         # the share of the time spent trying options that do not pay
MARGIN = 1.05          # speculation is chosen (or tried) where it beats plain decoding by this
#                        much: within it, the costs' own error could make it the slower one
LOOKUP_CHAINS = (1, 2, 3, 4, 6, 8, 12, 16)   # lookup drafts this many tokens, at most
HEAD_CHAINS = (1, 2, 3, 4, 6)                # head chains of this many drafted tokens
DRIFT_RATE = 0.2       # weight of a plain pass's timing in the drift of every option's cost
NODE_RATE = 0.3        # ... of a lookup chain's in the cost of a node beyond the curve
RESIDUAL_RATE = 0.3    # ... of a head option's in the correction of its own
SPREAD_BOUND = 0.3     # a verify point whose runs spread more (relative) is timed again
DISAGREE = 1.25        # ... as are all where plain passes run this much off what costs say
PLAIN_SAMPLES = 6      # plain passes compared with the costs (their median)
RECHECK_EVERY = 2      # cycles from one point timed again to the next (decoding goes on)
RECHECK_SHARE = 0.04   # the share of decoding's time that timing points again may spend


@dataclass(frozen=True)
class Option:
    """What one cycle drafts. kind: "plain" (the root alone), "lookup" (a chain copied from
    the context), "head" (the head's chain, top_k 1, or tree), "merged" (the head's tree and
    the lookup branches in one). nodes: the tree's nodes with the root; depth: the drafted
    levels below the root; top_k: the head's children per node."""

    kind: str
    nodes: int = 1
    depth: int = 0
    top_k: int = 1

    @property
    def chain(self) -> bool:
        return self.top_k == 1

    def label(self) -> str:
        if self.kind == "plain":
            return "plain"
        if self.kind == "lookup":
            return f"lookup {self.depth}"
        shape = f"chain {self.depth}" if self.chain else \
            f"tree {self.nodes}/{self.depth}/{self.top_k}"
        return ("head " if self.kind == "head" else "merged ") + shape


PLAIN = Option("plain")


def head_chain(drafted: int) -> Option:
    return Option("head", drafted + 1, drafted, 1)


def lookup_chain(drafted: int) -> Option:
    return Option("lookup", drafted + 1, drafted, 1)


class Survival:
    """P(drafted token d is accepted | tokens 1..d-1 were), per depth d, from counts that
    fade by `memory` at every update, mixed with a prior of `weight` pseudo-cycles."""

    def __init__(self, prior: Sequence[float], weight: float = 1.0, memory: float = 0.9):
        self.prior, self.weight, self.memory = list(prior), weight, memory
        self.hit = [0.0] * len(self.prior)
        self.tried = [0.0] * len(self.prior)

    def update(self, drafted: int, accepted: int) -> None:
        """A cycle that drafted `drafted` levels accepted `accepted` of them."""
        for d in range(len(self.prior)):
            self.hit[d] *= self.memory
            self.tried[d] *= self.memory
        for d in range(min(drafted, accepted + 1, len(self.prior))):  # depth d + 1 tried
            self.tried[d] += 1
            self.hit[d] += d < accepted

    def p(self, d: int) -> float:
        """Acceptance of depth d + 1 given depth d (beyond the known depths: the last)."""
        d = min(d, len(self.prior) - 1)
        return (self.hit[d] + self.weight * self.prior[d]) / (self.tried[d] + self.weight)

    def reach(self, depth: int) -> List[float]:
        """P(the first d drafted tokens are all accepted), d = 1..depth."""
        out, s = [], 1.0
        for d in range(depth):
            s *= self.p(d)
            out.append(s)
        return out


class LookupAcceptance:
    """Per-token acceptance of a lookup draft after a match of m tokens: the calibration
    (`lookup.LookupSettings.p`) as the prior, corrected by this sequence's own counts, kept
    per range of match lengths the calibration has a value for (`keys`: the range's first
    length; none: each length to max_key its own), so a few drafts teach every length."""

    def __init__(self, prior, weight: float = 4.0, memory: float = 0.9, max_key: int = 8,
                 keys: Sequence[int] = ()):
        self.prior, self.weight, self.memory, self.max_key = prior, weight, memory, max_key
        self.keys = sorted(keys)
        self.counts: Dict[int, List[float]] = {}

    def _key(self, match: int) -> int:
        below = [k for k in self.keys if k <= match]
        return below[-1] if below else min(match, self.max_key)

    def update(self, match: int, drafted: int, accepted: int) -> None:
        c = self.counts.setdefault(self._key(match), [0.0, 0.0])
        c[0] = c[0] * self.memory + accepted
        c[1] = c[1] * self.memory + accepted + (accepted < drafted)

    def p(self, match: int) -> float:
        hit, tried = self.counts.get(self._key(match), (0.0, 0.0))
        return (hit + self.weight * self.prior(match)) / (tried + self.weight)

    def reach(self, match: int, depth: int) -> List[float]:
        p = self.p(match)
        return [p ** d for d in range(1, depth + 1)]


class Costs:
    """Seconds a cycle takes on this machine, by option: `verify` — the cycle of a chain of n
    nodes with nothing to draft (n = 1: a plain step), measured at a few n and interpolated
    (linear beyond the last); `draft` — what the head's proposal adds to the cycle of its
    tree, by option label (chains between the measured ones: linear in the depth);
    `catch_up` — what the head's catching up costs a position (after cycles without it).

    Both are measured after a short prompt (`at` positions) and, where `longer` is given
    (`{"at": L, "verify": {...}, "draft": {...}, "draft_at": L', "draft_window": W}`), again
    after a long one: attention reads every cached position, so a cycle's cost grows
    linearly with the context, and the cost at the sequence's current length is the line
    through the two (interpolated, extrapolated beyond). The drafter's own context stops
    growing at its draft window W (None: none; `draft_at`: the positions it read at the
    long measurement, min(L, W)).

    The cycles' own timings keep them current: `scale`, the drift of all (throttling,
    another process), `per_node`, what a node costs beyond the model (lookup chains show it),
    and per head option a residual, what its measurement missed."""

    def __init__(self, verify: Dict[int, float], draft: Optional[Dict[str, float]] = None,
                 catch_up: float = 0.0, at: int = 0, longer: Optional[dict] = None,
                 spread: Optional[Dict[int, float]] = None):
        self.verify_points = sorted((int(n), float(s)) for n, s in verify.items())
        # each verify point's runs, (slowest - fastest) / fastest, as measured
        self.spread = {int(n): float(v) for n, v in (spread or {}).items()}
        self.recheck: Optional["Recheck"] = None  # (the measured costs': `Recheck`)
        self.draft_costs = dict(draft or {})
        self.catch_up = catch_up
        self.at = int(at)
        self.longer = None
        if longer is not None and int(longer["at"]) > self.at:
            window = longer.get("draft_window")
            self.longer = {"at": int(longer["at"]),
                           "draft_at": int(longer.get("draft_at", longer["at"])),
                           "draft_window": None if window is None else int(window),
                           "verify": sorted((int(n), float(s))
                                            for n, s in longer["verify"].items()),
                           "draft": {str(k): float(v) for k, v in longer["draft"].items()}}
            self._fit()
        self.scale = 1.0
        self.per_node = 0.0
        self.residual: Dict[str, float] = {}
        # a batch's row (`in_batch`): (the rows of the batch measured, its plain pass's
        # seconds); None: a sequence's own costs
        self.batch: Optional[tuple] = None

    @staticmethod
    def _curve(pts, nodes: int) -> float:
        if len(pts) == 1:
            return pts[0][1] * nodes / pts[0][0]
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if nodes <= n1:
                break
        t = (nodes - n0) / (n1 - n0)
        return max(s0 + t * (s1 - s0), pts[0][1])

    def _fit(self) -> None:
        """The growth per position of context, from the two measurements pooled (noise in
        one option's pair would be multiplied by the length it is extrapolated to): a verify
        pass of n nodes, `grow_fixed + n * grow_node` (the cached keys read once, and
        attended by every node); a drafted level, `grow_level` (the drafter reads its context
        once a level)."""
        long, span = self.longer, self.longer["at"] - self.at
        short = dict(self.verify_points)
        pts = [(n, (s - short[n]) / span) for n, s in long["verify"] if n in short]
        a, b = 0.0, 0.0
        if pts:
            k = len(pts)
            mn, mg = sum(n for n, _ in pts) / k, sum(g for _, g in pts) / k
            var = sum((n - mn) ** 2 for n, _ in pts)
            b = sum((n - mn) * (g - mg) for n, g in pts) / var if var else 0.0
            a = mg - b * mn
            if b < 0:  # (growth does not shrink with the nodes: noise)
                a, b = max(mg, 0.0), 0.0
            elif a < 0:
                a, b = 0.0, max(sum(n * g for n, g in pts) / sum(n * n for n, _ in pts), 0.0)
        self.grow_fixed, self.grow_node = a, b
        window = long["draft_window"]
        read = long["draft_at"] - (self.at if window is None else min(self.at, window))
        pairs = [(Costs._draft(self.draft_costs, o), v, o.depth) for o, v in
                 ((_parse_label(k), v) for k, v in long["draft"].items()) if o is not None]
        levels = sum(d for _, _, d in pairs)
        self.grow_level = max(sum(v - s for s, v, _ in pairs), 0.0) / (levels * read) \
            if levels and read > 0 else 0.0

    def verify(self, nodes: int, context: Optional[int] = None) -> float:
        short = self._curve(self.verify_points, nodes)
        if self.longer is None or context is None or context <= self.at:
            return short
        return short + (self.grow_fixed + nodes * self.grow_node) * (context - self.at)

    @staticmethod
    def _draft(costs: Dict[str, float], option: "Option") -> float:
        label = _head_part(option).label()
        if label in costs:
            return costs[label]
        chains = sorted((int(k.split()[-1]), v) for k, v in costs.items()
                        if k.startswith("head chain "))
        if not chains:
            return 0.0
        if not option.chain:  # (a tree not measured: as the chain of its depth)
            return Costs._draft(costs, head_chain(option.depth))
        if len(chains) == 1:
            return chains[0][1] * option.depth / chains[0][0]
        (d0, s0), (d1, s1) = chains[0], chains[-1]
        return max(s0 + (option.depth - d0) * (s1 - s0) / (d1 - d0), 0.0)

    def draft(self, option: "Option", context: Optional[int] = None) -> float:
        if option.kind in ("plain", "lookup"):
            return 0.0
        short = self._draft(self.draft_costs, option)
        if self.longer is None or context is None:
            return short
        window = self.longer["draft_window"]
        read = context if window is None else min(context, window)  # (within its window)
        base = self.at if window is None else min(self.at, window)
        return short + self.grow_level * option.depth * max(read - base, 0)

    def cycle(self, option: "Option", context: Optional[int] = None) -> float:
        """Seconds of a cycle with this option, now, `context` positions into the sequence
        (None: at the short measurement's)."""
        base = self.scale * (self.verify(option.nodes, context) + self.draft(option, context)) \
            + self.per_node * (option.nodes - 1)
        base = max(base, 0.5 * self.scale * self.verify(1, context))
        return base * self.residual.get(option.label(), 1.0)

    def observe(self, option: "Option", seconds: float, context: Optional[int] = None) -> None:
        """A cycle with `option` took `seconds`: a plain pass moves the drift of all options, a
        lookup chain what each node costs beyond the model, a head's option its own
        residual."""
        predicted = self.cycle(option, context)
        if predicted <= 0 or seconds <= 0:
            return
        ratio = min(max(seconds / predicted, 0.1), 10.0)
        if option.kind == "plain":
            self.scale *= ratio ** DRIFT_RATE
        elif option.kind == "lookup":
            self.per_node += NODE_RATE * (seconds - predicted) / (option.nodes - 1)
        else:
            label = option.label()
            self.residual[label] = self.residual.get(label, 1.0) * ratio ** RESIDUAL_RATE

    def catching_up(self, option: "Option", pending: int) -> float:
        """Seconds the head takes to catch up before drafting `option`, `pending` positions
        behind (beyond what a cycle of its own leaves it, which its draft cost holds)."""
        if option.kind not in ("head", "merged"):
            return 0.0
        return self.scale * self.catch_up * max(pending - option.depth - 1, 0)

    def copy(self) -> "Costs":
        return Costs.fromdict(self.asdict())

    def learned(self) -> dict:
        """What the cycles' timings taught (`scale`, `per_node`, the head options' residuals),
        which `learn` hands to the next generation's costs."""
        return {"scale": self.scale, "per_node": self.per_node, "residual": dict(self.residual)}

    def learn(self, learned: dict) -> "Costs":
        self.scale, self.per_node = learned["scale"], learned["per_node"]
        self.residual = dict(learned["residual"])
        return self

    def asdict(self) -> dict:
        out = {"verify": {str(n): s for n, s in self.verify_points},
               "draft": dict(self.draft_costs), "catch_up": self.catch_up, "at": self.at,
               "spread": {str(n): v for n, v in self.spread.items()}}
        if self.batch is not None:
            out["batch"] = {"rows": self.batch[0], "plain": self.batch[1]}
        if self.longer is not None:
            out["longer"] = {"at": self.longer["at"], "draft_at": self.longer["draft_at"],
                             "draft_window": self.longer["draft_window"],
                             "verify": {str(n): s for n, s in self.longer["verify"]},
                             "draft": dict(self.longer["draft"])}
        return out

    @classmethod
    def fromdict(cls, d: dict) -> "Costs":
        out = cls({int(n): float(s) for n, s in d["verify"].items()},
                  {str(k): float(v) for k, v in d.get("draft", {}).items()},
                  float(d.get("catch_up", 0.0)), int(d.get("at", 0)), d.get("longer"),
                  {int(n): float(v) for n, v in d.get("spread", {}).items()})
        if d.get("batch") is not None:
            out.batch = (int(d["batch"]["rows"]), float(d["batch"]["plain"]))
        return out

    def in_batch(self, curve: Dict[int, float], batch: int) -> "Costs":
        """The costs of one row of a batch of `batch` rows, from the batch's verify pass of
        each width (`curve`, seconds by nodes per row: `costs.measure_batch`): a plain pass,
        its share of the batch's plain pass; a tree of n nodes, that share and all that
        widening the batch to n costs (every row is padded to the widest tree, so a row that
        drafts alone pays the whole widening: a choice that pays so pays for the batch);
        its own drafting and catching up; the growth with its context a sequence's."""
        row = self.copy()
        base = float(curve[min(curve)])
        row.verify_points = sorted((int(n), float(v) - base * (batch - 1) / batch)
                                   for n, v in curve.items())
        row.spread = {}
        row.batch = (int(batch), base)
        return row

    def batch_pass(self, nodes: int, context: Optional[int] = None) -> float:
        """Seconds of the whole verify pass of the batch this row is in, `nodes` nodes a row
        wide, as its costs say now (a sequence's costs: its own pass)."""
        rows, plain = self.batch or (1, 0.0)
        return self.scale * (self.verify(nodes, context) + plain * (rows - 1) / rows) \
            + self.per_node * (nodes - 1)

    def drafting(self, option: "Option", context: Optional[int] = None) -> float:
        """Seconds of a cycle with `option` spent drafting, as the costs say now."""
        return self.scale * self.draft(option, context) * self.residual.get(option.label(), 1.0)

    def rescaled(self, ratios: Dict[int, float]) -> None:
        """The verify points timed again times their ratio to what they were (`ratios`, by
        node count): what a loaded machine had made them, corrected; the others, the growth
        with the context and the drafting costs stay."""
        points, low = [], 0.0  # (a larger chain never costs less)
        for n, s in self.verify_points:
            low = max(s * ratios.get(n, 1.0), low)
            points.append((n, low))
        self.verify_points = points
        self.spread = {n: v for n, v in self.spread.items() if n not in ratios}


def batch_size_measured(batch: int) -> int:
    """The batch size whose costs a batch of `batch` rows takes: the largest power of two
    not above it (1: a sequence's own)."""
    return 1 << (max(int(batch), 1).bit_length() - 1)


@dataclass
class Choice:
    """A cycle's option, with what was expected of it (tokens, seconds)."""

    option: Option
    tokens: float
    seconds: float
    match: int = 0               # the lookup match its lookup part copies after
    copied: List[int] = field(default_factory=list)  # the lookup tokens it may draft
    probe: bool = False          # a try of a head or lookup option that did not pay
    against: float = 0.0         # a try's: the rate of the option it displaced
    charged: float = 0.0         # ... and the exploration budget it was charged when chosen
    catch_up: float = 0.0        # of `seconds`, the head's catching up
    context: Optional[int] = None  # the positions before the cycle (None: not known)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Controller:
    """One sequence's choices (see the module docstring). head_options: the head's options
    (chains and trees; none without a head); lookup: whether lookup may draft; head_prior:
    the prior per-token acceptance of the head's chain (and of its trees' best path); the
    lookup prior `lookup_p(match)` (and `lookup_keys`: the match lengths from which it
    changes)."""

    def __init__(self, costs: Costs, head_options: Sequence[Option] = (), lookup: bool = True,
                 lookup_p=None, head_prior: float = 0.6, tree_prior: float = 0.75,
                 lookup_keys: Sequence[int] = (),
                 max_lookup: int = max(LOOKUP_CHAINS)):
        self.costs = costs
        self.head_options = list(head_options)
        self.lookup = lookup and lookup_p is not None
        self.max_lookup = max_lookup
        depth = max([o.depth for o in self.head_options] + [1])
        self.chain = Survival([head_prior] * depth)
        self.trees = {o: Survival([tree_prior] * o.depth) for o in self.head_options
                      if not o.chain}
        self.lookup_acc = LookupAcceptance(lookup_p or (lambda m: 0.0), keys=lookup_keys)
        self.budget = {"head": 0.0, "lookup": 0.0}  # seconds of exploration allowed now
        self.lookup_open = False  # whether lookup could draft at the last choice
        self.packed = False  # whether `costs` are those of quantized caches
        self.counts: Dict[str, int] = {}  # cycles by option kind

    # ---------------------------------------------------------------- estimates
    def _head_reach(self, o: Option) -> List[float]:
        return self._survival(o).reach(o.depth)

    def _survival(self, o: Option) -> Survival:
        return self.chain if o.chain else self.trees[_head_part(o)]

    def expect(self, o: Option, match: int = 0, available: int = 0) -> float:
        """Expected tokens of a cycle with option o (match, available: the lookup match
        length and how many tokens it can copy)."""
        if o.kind == "plain":
            return 1.0
        if o.kind == "lookup":
            return 1.0 + sum(self.lookup_acc.reach(match, min(o.depth, available)))
        head = self._head_reach(o)
        if o.kind == "head":
            return 1.0 + sum(head)
        look = self.lookup_acc.reach(match, min(available, o.depth))
        look += [0.0] * (len(head) - len(look))
        return 1.0 + sum(1 - (1 - h) * (1 - lk) for h, lk in zip(head, look))

    def candidates(self, match: int, available: int, pending: int = 0,
                   context: Optional[int] = None) -> List[Choice]:
        cost = self.costs.cycle
        out = [Choice(PLAIN, 1.0, cost(PLAIN, context), context=context)]
        if self.lookup and available > 0:
            for n in LOOKUP_CHAINS:
                if n > self.max_lookup:
                    break
                o = lookup_chain(min(n, available))
                out.append(Choice(o, self.expect(o, match, available), cost(o, context),
                                  match, context=context))
                if n >= available:
                    break
        for o in self.head_options:
            catch = self.costs.catching_up(o, pending)
            out.append(Choice(o, self.expect(o), cost(o, context) + catch,
                              catch_up=catch, context=context))
            if self.lookup and available > 0 and not o.chain:
                m = Option("merged", o.nodes, o.depth, o.top_k)
                # (the lookup branch takes some of the tree's nodes: costed as the tree)
                out.append(Choice(m, self.expect(m, match, available),
                                  cost(o, context) + catch, match, catch_up=catch,
                                  context=context))
        return out

    # ---------------------------------------------------------------- choosing
    def choose(self, match: int = 0, copied: Sequence[int] = (), pending: int = 0,
               context: Optional[int] = None) -> Choice:
        """The option for the next cycle (match, copied: the lookup match at the context's
        end and the tokens that followed it before, none: no match; pending: the positions
        the head has to catch up on; context: the positions the sequence holds, which the
        costs grow with): the highest expected tokens per second where it beats plain
        decoding by MARGIN, or a try of the head's best option or, where plain decoding is
        the choice, of lookup's, where its budget allows and it could pay at all."""
        cands = self.candidates(match, len(copied), pending, context)
        plain = cands[0]
        best = max(cands, key=lambda c: c.rate)
        if best.rate < MARGIN * plain.rate:
            best = plain
        self.lookup_open = any(c.option.kind == "lookup" for c in cands)
        kinds = (["head"] if self.head_options and best.option.kind in ("plain", "lookup")
                 else []) + (["lookup"] if best.option.kind == "plain" and self.lookup_open
                             else [])
        for kind in kinds:
            # (an option that would not pay with every drafted token accepted, once caught
            # up, is not tried)
            fits = [c for c in cands if c.option.kind == kind and
                    (c.option.depth + 1) / (c.seconds - c.catch_up) >= MARGIN * plain.rate]
            trial = max(fits, key=lambda c: c.rate) if fits else None
            extra = 0.0 if trial is None else trial.seconds - trial.tokens / best.rate
            self.budget[kind] = min(self.budget[kind], 2 * max(extra, 0.0))  # (no bursts)
            if trial is not None and extra <= self.budget[kind]:
                self.budget[kind] -= max(extra, 0.0)
                trial.probe, trial.against, trial.charged = True, best.rate, max(extra, 0.0)
                best = trial
                break
        if best.option.kind in ("lookup", "merged"):
            best.copied = list(copied)
        return best

    def plain_whatever(self, matches: Sequence[int], available: int, pending: int,
                       context: Optional[int] = None) -> bool:
        """Whether no option but plain decoding beats it by MARGIN at any of these lookup
        match lengths (with `available` tokens to copy), `pending` positions for the head
        to catch up on and `context` positions (tries of the head aside: `choose` makes
        them)."""
        for m in matches:
            cands = self.candidates(m, available if m else 0, pending, context)
            if any(c.rate >= MARGIN * cands[0].rate for c in cands[1:]):
                return False
        return True

    def drafting(self, choice: Choice) -> float:
        """Seconds the cycle of `choice` drafts, its catching up included, as the costs say."""
        if choice.option.kind not in ("head", "merged"):
            return 0.0
        return self.costs.drafting(choice.option, choice.context) + choice.catch_up

    def update_in_batch(self, choice: Choice, accepted: Sequence[int], seconds: float,
                        width: int, drafting: float) -> None:
        """What a row's cycle in a batch accepted, and the whole batch's cycle `seconds`
        (its pass `width` nodes a row, every row padded to the widest tree; `drafting`: all
        rows' drafting as their costs say): the row's choice is charged its own prediction
        times the cycle's time over what the batch's costs, as this row holds them, said
        the whole cycle would take — a plain pass moves the drift, a lookup chain the cost
        of a node, a head's option its residual, as a sequence's own cycles do, so costs
        measured on a loaded machine, or a batch between measured sizes, are corrected by
        the batch's cycles. (Only the row whose tree set the width is handed its time: a
        row padded to another's tree says nothing of its own option.)"""
        predicted = self.costs.batch_pass(width, choice.context) + drafting
        spent = None
        if predicted > 0 and seconds > 0:
            spent = self.costs.cycle(choice.option, choice.context) * seconds / predicted \
                + choice.catch_up
        self.update(choice, accepted, spent)

    def update(self, choice: Choice, accepted: Sequence[int],
               seconds: Optional[float] = None) -> None:
        """What the cycle of `choice` accepted (the drafted tokens, in order), and how long
        it took."""
        o, n = choice.option, len(accepted)
        self.counts[o.kind] = self.counts.get(o.kind, 0) + 1
        if seconds is not None:
            self.costs.observe(o, seconds - choice.catch_up, choice.context)
        spent = choice.seconds if seconds is None else seconds
        # (where lookup could draft, its tries and the head's share the exploration)
        share = 0.5 if self.lookup_open and self.head_options else 1.0
        if self.head_options:
            self.budget["head"] += share * EXPLORE * spent
        if self.lookup_open:
            self.budget["lookup"] += share * EXPLORE * spent
        if choice.probe:  # a try pays what it lost against the option it displaced: beyond
            # its charge when chosen, the time it overran (a long catch-up) and the tokens it
            # fell short by (a hopeful estimate) at that option's rate, or gets back a gain
            pot = "lookup" if o.kind == "lookup" else "head"
            self.budget[pot] -= spent - (n + 1) / choice.against - choice.charged
        copied = choice.copied[: o.depth]
        from_lookup = 0  # the accepted tokens the lookup draft holds too
        while from_lookup < min(n, len(copied)) and copied[from_lookup] == accepted[from_lookup]:
            from_lookup += 1
        if copied:
            self.lookup_acc.update(choice.match, len(copied), from_lookup)
        if o.kind == "head" or (o.kind == "merged" and from_lookup == 0):
            # (where the lookup branch carried the path, the head's own part is unknown)
            self._survival(o).update(o.depth, n)


class Recheck:
    """The measured costs checked while decoding, once in a process. The first PLAIN_SAMPLES
    plain passes are timed against the costs' plain pass: where their median runs DISAGREE
    times off (a measurement taken while the machine was loaded, or before it was), the plain
    pass's cost is corrected at once — alone where it ran cheaper (a loaded machine slows a
    plain pass more than a pass over many tokens, so the others stay as measured, the
    cautious reading, until timed themselves), all points with it where it ran dearer — and
    every other point is queued to be timed again; so is a point whose runs spread beyond
    SPREAD_BOUND when it was measured. A queued point is timed as a cycle of decoding (a
    chain of that many nodes; the tokens are what they would be), never blocking, smallest
    first, at most every RECHECK_EVERY cycles, and only where what it is expected to cost
    beyond a plain pass fits a budget of RECHECK_SHARE of the time decoding spent (on a CPU
    a pass over 16 tokens costs many plain ones: such points are timed as the process goes
    on, not in its first generation's first tokens). A point off by more than DISAGREE is
    corrected (`Costs.rescaled`) for the greedy generations of this process, and `notes`
    says so. The costs as read (`as_read`) stay what sampling generations choose by, here
    and in every process, so a seed draws the same tokens wherever it runs; the cache is
    rewritten only by a measurement (`benchmark --save-tuning`)."""

    def __init__(self, costs: Costs):
        self.costs = costs
        self.as_read = Costs.fromdict(costs.asdict())
        self.queue = sorted(n for n, v in costs.spread.items() if v > SPREAD_BOUND and n > 1)
        self.why = {n: f"its runs spread {costs.spread[n]:.0%} when measured"
                    for n in self.queue}
        self.plain: List[float] = []   # plain passes' seconds over what the costs say
        self.ratio = 1.0               # ... their median, where it disagreed (else 1)
        self.timed: Dict[int, float] = {}  # node count -> seconds over what the costs said
        self.budget = 0.0              # seconds the points' timing may still spend
        self.done = False
        self.notes: List[str] = []
        # what the latest greedy generation's cycles taught its costs (`Costs.learned`),
        # where the next starts from: a drift that only some options show (a plain pass
        # slowed more than a pass over many tokens on a loaded machine) is carried over to
        # generations that draft throughout and never time a plain pass themselves
        self.learned: Optional[dict] = None

    def spend(self, seconds: float) -> None:
        """A timed cycle took `seconds`: the points' timing may spend its share."""
        if not self.done:
            self.budget += RECHECK_SHARE * seconds

    def extra(self, nodes: int) -> float:
        """What timing a point is expected to cost beyond a plain pass: the point as the
        plain passes ran (where they ran cheaper) or at its fastest run (a spread one)."""
        expected = self.costs.verify(nodes) * min(self.ratio, 1.0) / \
            (1.0 + self.costs.spread.get(nodes, 0.0))
        return max(expected - self.costs.verify(1), 0.0)

    def due(self, cycles: int) -> Optional[int]:
        """The node count to time now, `cycles` cycles into a generation (None: none)."""
        if self.done or not self.queue or cycles % RECHECK_EVERY or \
                self.extra(self.queue[0]) > self.budget:
            return None
        return self.queue[0]

    def plain_pass(self, seconds: float, context: int) -> bool:
        """A plain pass took `seconds` at `context` positions: whether the costs changed."""
        if self.done or len(self.plain) >= PLAIN_SAMPLES:
            return False
        self.plain.append(seconds / self.costs.verify(1, context))
        if len(self.plain) < PLAIN_SAMPLES:
            return False
        ratio = sorted(self.plain)[PLAIN_SAMPLES // 2]
        changed = not 1 / DISAGREE <= ratio <= DISAGREE
        if changed:
            self.ratio = self.timed[1] = ratio
            points = [n for n, _ in self.costs.verify_points]
            self.costs.rescaled({n: ratio for n in points if n == 1 or ratio > 1})
            for n in points:
                self.why.setdefault(n, f"plain passes ran {ratio:.2f}x the costs")
            self.queue = sorted((set(points) | set(self.queue)) - set(self.timed))
            self.notes.append(f"costs measured again while decoding (plain passes ran "
                              f"{ratio:.2f}x the cached cost: corrected"
                              + (", every point with it" if ratio > 1 else
                                 "; the passes over more tokens timed again as decoding goes")
                              + ")")
        self._settle()
        return changed

    def point(self, nodes: int, seconds: float, context: int) -> bool:
        """A cycle of `nodes` nodes timed again took `seconds`: whether the costs changed."""
        self.queue = [n for n in self.queue if n != nodes]
        self.budget -= max(seconds - self.costs.verify(1, context), 0.0)
        ratio = self.timed[nodes] = seconds / self.costs.verify(nodes, context)
        self._settle()
        if 1 / DISAGREE <= ratio <= DISAGREE:
            return False
        self.costs.rescaled({nodes: ratio})
        self.notes.append(f"costs measured again while decoding (a pass of {nodes} took "
                          f"{ratio:.2f}x the cached cost, {self.why.get(nodes, 'timed again')})")
        return True

    def _settle(self) -> None:
        """Done once the plain passes are in and every point queued is timed."""
        self.done = not self.queue and len(self.plain) >= PLAIN_SAMPLES


def rank0_seconds(group, seconds: float) -> float:
    """Rank 0's `seconds` on every rank of `group` (so every rank decides alike), and a
    check that every rank took part: where a rank has died, a collective can come back
    holding this rank's own part alone (MLX's ring, once it fails its pending tasks, left a
    rank decoding with half a model), which is raised as a lost peer (`distributed.peer_lost`)
    instead."""
    mine = seconds if group.rank() == 0 else 0.0
    total, ranks = mx.distributed.all_sum(mx.array([mine, 1.0]), group=group).tolist()
    if round(ranks) != group.size():
        raise RuntimeError(f"[collective] {round(ranks)} of {group.size()} ranks took part in "
                           "a collective")
    return total


# ---------------------------------------------------------------------------- the drafter
class AdaptiveState:
    """One sequence's state under the adaptive drafter: the head's (None without a head),
    lookup's automaton, the positions the head has not caught up on yet (their features and
    tokens, kept through the cycles that did not draft with it), the controller and its
    latest choice."""

    def __init__(self, head_state, lookup_state, controller: Controller):
        self.head, self.lookup, self.controller = head_state, lookup_state, controller
        self.feats: List = []
        self.tokens: List = []
        self.choice: Optional[Choice] = None
        self.forced: Optional[Option] = None  # every cycle drafts this (measuring its cost)
        self.seconds: Optional[float] = None  # what the latest cycle took
        self.decided: Optional[Choice] = None  # the next cycle's choice, made ahead
        self.cycles = 0                        # cycles so far in this generation
        self.rechecking: Optional[int] = None  # the verify point this cycle times again
        self.timed = False                     # whether its cycles are timed (greedy)

    def pending(self) -> int:
        return sum(int(t.shape[0]) for t in self.tokens)

    def keep_pending(self, keep: int) -> None:
        """The first `keep` pending positions kept, the rest cut."""
        feats, tokens = [], []
        for f, t in zip(self.feats, self.tokens):
            n = min(int(t.shape[0]), keep)
            if n > 0:
                feats.append(f[:n])
                tokens.append(t[:n])
            keep -= n
        self.feats, self.tokens = feats, tokens


class AdaptiveDrafter(Drafter):
    """Speculation that chooses every cycle (see the module docstring): plain, lookup, the
    head's chains and trees, or the head merged with lookup. It chooses from what every
    cycle before accepted, so the engine may draft ahead (`Engine.ahead`)."""

    drafts_ahead = True

    def __init__(self, costs: Costs, target=None, head=None,
                 head_options: Sequence[Option] = (), lookup: Optional[LookupSettings] = None,
                 head_prior: Optional[float] = None, node_limit: Optional[int] = None,
                 depth_limit: Optional[int] = None, max_kv_size: Optional[int] = None,
                 kv_costs: Optional[tuple] = None, group=None, timed: bool = True):
        """node_limit: the most nodes a tree may have; depth_limit: the most levels, the
        root's included (a bounded cache's window); max_kv_size: the most positions the
        target's caches hold (a bounded cache: its cost stops growing there); kv_costs:
        (the costs with quantized caches, the position from which the caches are
        quantized), which a sequence's choices take from there on; group: the
        `mx.distributed` group the target is sharded over, whose ranks all take rank 0's
        timing of every cycle, so they choose alike (their costs are rank 0's too); timed:
        whether the generations' cycles are timed (greedy; when sampling, choices follow only
        what repeats with a seed: the costs as read, never timed again)."""
        if not timed:
            costs = costs if costs.recheck is None else costs.recheck.as_read
            if kv_costs is not None and kv_costs[0].recheck is not None:
                kv_costs = (kv_costs[0].recheck.as_read, kv_costs[1])
        self.costs, self.target, self.head = costs, target, head
        self.max_kv_size = max_kv_size
        self.kv_costs = kv_costs
        limit = node_limit or MAX_NODES
        deepest = depth_limit or MAX_NODES
        self.head_options = [o for o in head_options if o.nodes <= limit and o.depth < deepest]
        self.lookup_settings = lookup
        self.lookup = LookupDrafter(lookup) if lookup is not None else None
        self.max_lookup = min(max(LOOKUP_CHAINS), limit - 1, deepest - 1)
        self.drafters = {o: head_drafter(head, target, o.nodes, o.depth - 1, o.top_k)
                         for o in self.head_options}
        self.features = head.feature_taps(target) if head is not None else None
        self.reads_kv = bool(getattr(head, "reads_kv", False))
        self.max_depth = max([o.depth for o in self.head_options] +
                             [self.max_lookup if lookup is not None else 0, 1])
        self.head_prior = head_prior
        self.recheck = costs.recheck  # (None: costs given as they are, not measured here)
        self.group = group
        # the costs of a row of a batch of that many (None: a batch's rows choose with these)
        self.batch_costs: Optional[Callable[[int], Costs]] = None

    @property
    def owner(self):
        return (None if self.head is None else self.head, LookupDrafter)

    def _controller(self) -> Controller:
        prior = {} if self.head_prior is None else {"head_prior": self.head_prior,
                                                    "tree_prior": min(0.95,
                                                                      self.head_prior + 0.15)}
        # (each generation follows the drift it sees itself, from the measured costs and what
        # the cycles of this process's greedy generations before it taught them)
        costs = self.costs.copy()
        if self.recheck is not None and self.recheck.learned is not None:
            costs.learn(self.recheck.learned)
        return Controller(costs, self.head_options, self.lookup is not None,
                          None if self.lookup is None else self.lookup.settings.p,
                          max_lookup=self.max_lookup, lookup_keys=() if self.lookup is None
                          else tuple(self.lookup.settings.accept), **prior)

    def new_state(self):
        return AdaptiveState(None if self.head is None else self.head.make_cache(),
                             LookupDrafter().new_state(), self._controller())

    def begin(self, state) -> None:
        """A generation starts (perhaps on a prompt cache's state): its choices start afresh,
        as they would alone."""
        state.controller, state.choice, state.cycles = self._controller(), None, 0

    def offset(self, state) -> int:
        if self.head is None:
            return len(state.lookup.automaton.tokens)
        return state.head.offset + state.pending()

    def truncate(self, state, length: int) -> None:
        LookupDrafter().truncate(state.lookup, length)
        if self.head is None:
            return
        if length >= state.head.offset:
            state.keep_pending(length - state.head.offset)
        else:
            state.head.truncate(length)
            state.feats, state.tokens = [], []

    def head_caches(self, state) -> Optional[list]:
        return None if self.head is None else self.head.cache_layers(state.head)

    def take_kv(self, state, caches, n: int, row=None) -> None:
        for drafter in self.drafters.values():  # (one hands over for all: the same state)
            drafter.take_kv(state.head, caches, n, row)
            break

    def propose(self, state, features, tokens, root) -> Tree:
        _catch_up(state.lookup, tokens)
        match, copied = 0, []
        if self.lookup is not None:
            s = self.lookup.settings
            found = state.lookup.automaton.continuations(s.min_match, self.max_lookup, 1)
            if found:
                match, copied = found[0]
        state.rechecking = None
        recheck = self._recheck_due(state)
        if state.decided is not None:
            choice, state.decided = state.decided, None
        elif recheck is not None:  # (a verify point timed again: a chain of that many nodes)
            state.rechecking = recheck
            o = lookup_chain(recheck - 1)
            copied = (copied + [int(root.item())] * o.depth)[: o.depth]
            choice = Choice(o, 0.0, 0.0, match, copied, context=self._context(state))
        elif state.forced is None:
            pending = state.pending() + int(tokens.shape[0]) if self.head is not None else 0
            context = self._context(state)
            self._packed(state, context)
            choice = state.controller.choose(match, copied, pending, context)
        else:  # (a lookup chain without a match drafts the root's token again)
            o = state.forced
            copied = (copied + [int(root.item())] * o.depth)[: o.depth]
            choice = Choice(o, 0.0, 0.0, match, copied)
        state.choice = choice
        o = choice.option
        if o.kind in ("head", "merged"):
            feats = state.feats + [features]
            toks = state.tokens + [tokens]
            state.feats, state.tokens = [], []
            feats = feats[0] if len(feats) == 1 else mx.concatenate(feats)
            toks = toks[0] if len(toks) == 1 else mx.concatenate(toks)
            tree = self.drafters[_head_part(o)].propose(state.head, feats, toks, root)
            if o.kind == "merged":
                tree = _merge(tree, choice.match, copied, self.lookup.settings.p, o.nodes)
            tree.levels = max(o.depth, len(copied) if o.kind == "merged" else 0)
            return tree
        if self.head is not None:  # the head catches up when it drafts again
            state.feats.append(features)
            state.tokens.append(tokens)
        r = int(root.item())
        if o.kind == "plain":
            return _with_levels(build_tree(r, [], 0), 0)
        chain = copied[: o.depth]
        return _with_levels(build_tree(r, [(t, i, 0.0) for i, t in enumerate(chain)],
                                       len(chain)), len(chain))

    def plain_ahead(self, state) -> bool:
        """Decided before this cycle's token is known, from the lookup match the context's
        end has without it (so a copy that starts with that token is taken up a pass later:
        where the match already pays, nothing is decided ahead), the head one position
        further behind."""
        if state.forced is not None:
            return state.forced == PLAIN
        if self._recheck_due(state, 1) is not None:
            return False
        c = state.controller
        pending = state.pending() + 2 if self.head is not None else 0
        matches = [0]
        if self.lookup is not None:
            a = state.lookup.automaton
            now = a.length[a.link[a.last]] if a.last else 0
            if now >= self.lookup.settings.min_match:
                matches.append(now)
        context = self._context(state, 1)
        self._packed(state, context)
        if not c.plain_whatever(matches, self.max_lookup, pending, context):
            return False
        state.decided = c.choose(0, (), pending, context)  # (plain, or a try of the head)
        return state.decided.option == PLAIN

    def _packed(self, state, context: int) -> None:
        """From the position where the caches are quantized on, the costs measured so (the
        drift followed so far starts over with them, from what earlier greedy generations'
        quantized cycles taught them)."""
        c = state.controller
        if self.kv_costs is not None and context >= self.kv_costs[1] and not c.packed:
            c.costs, c.packed = self.kv_costs[0].copy(), True
            held = self.kv_costs[0].recheck
            if held is not None and held.learned is not None:
                c.costs.learn(held.learned)

    def _context(self, state, ahead: int = 0) -> int:
        """The positions the target's caches hold at the next verify pass (`ahead`: the
        tokens it has yet to see), within a bounded cache's."""
        n = len(state.lookup.automaton.tokens) + ahead
        return n if self.max_kv_size is None else min(n, self.max_kv_size)

    def _recheck_due(self, state, ahead: int = 0) -> Optional[int]:
        """The verify point to time again `ahead` cycles after the next (None: none; only
        where the chain fits what lookup may draft)."""
        if state.forced is not None or self.recheck is None or self.recheck.done or \
                not state.timed or state.controller.packed:
            return None  # (sampling: choices follow only what repeats with a seed)
        n = self.recheck.due(state.cycles + ahead)
        return n if n is not None and n - 1 <= self.max_lookup else None

    def observe(self, state, accepted: List[int], seconds: Optional[float]) -> None:
        if self.group is not None and seconds is not None:
            seconds = rank0_seconds(self.group, seconds)
        state.seconds = seconds
        state.cycles += 1
        state.timed = seconds is not None
        if state.choice is None or state.forced is not None:
            return
        context = state.choice.context if state.choice.context is not None else \
            self._context(state)
        # (the measured costs are checked against cycles with the caches they were measured
        # with: not those quantized, which have costs of their own)
        recheck = None if state.controller.packed else self.recheck
        if seconds is not None and recheck is not None:
            recheck.spend(seconds)
        if state.rechecking is not None:  # (greedy: timed; sampling: never chosen by time)
            if seconds is not None and self.recheck.point(state.rechecking, seconds, context):
                self._corrected(state)
            return
        if seconds is not None and state.choice.option == PLAIN and recheck is not None \
                and recheck.plain_pass(seconds, context):
            self._corrected(state)
        state.controller.update(state.choice, accepted, seconds)
        c = state.controller
        if seconds is not None:  # (greedy: kept for the next generation with these costs)
            holder = self.recheck if not c.packed else self.kv_costs[0].recheck
            if holder is not None:
                holder.learned = c.costs.learned()

    def drafting(self, state) -> Optional[float]:
        return 0.0 if state.choice is None else state.controller.drafting(state.choice)

    def observe_in_batch(self, state, accepted: List[int], seconds: Optional[float],
                         width: int, drafting: float) -> None:
        """A greedy row choosing with its batch's costs (`batch_costs`) learns from the
        batch's cycle as a sequence does from its own (`Controller.update_in_batch`); what
        it learns stays with the generation (nothing rechecked or handed on)."""
        if seconds is None or self.batch_costs is None or state.choice is None or \
                state.forced is not None:
            self.observe(state, accepted, None)
            return
        state.seconds, state.timed = None, False
        state.cycles += 1
        state.controller.update_in_batch(state.choice, accepted, seconds, width, drafting)

    def _corrected(self, state) -> None:
        """The measured costs were corrected: the generation goes on with them, what the
        cycles taught the costs before (relative to the points as they were) forgotten."""
        self.recheck.learned = None
        if not state.controller.packed:
            state.controller.costs = self.costs.copy()

    def chosen(self, state) -> Optional[str]:
        return None if state.choice is None else state.choice.option.label()


MAX_NODES = 1024


def _parse_label(label: str) -> Optional[Option]:
    """The head option a label names ("head chain 3", "head tree 16/5/4"; None: another)."""
    parts = label.split()
    try:
        if parts[:2] == ["head", "chain"]:
            return head_chain(int(parts[2]))
        if parts[:2] == ["head", "tree"]:
            nodes, depth, k = (int(x) for x in parts[2].split("/"))
            return Option("head", nodes, depth, k)
    except (IndexError, ValueError):
        pass
    return None


def _head_part(o: Option) -> Option:
    return Option("head", o.nodes, o.depth, o.top_k)


def _with_levels(tree: Tree, levels: int) -> Tree:
    tree.levels = levels
    return tree


def _catch_up(lookup_state, tokens) -> None:
    for t in tokens.tolist():
        lookup_state.automaton.append(int(t))


def _merge(drafted: Tree, match: int, copied: List[int], p, nodes: int) -> Tree:
    """The head's tree and the lookup chain as one tree of `nodes` nodes (as
    `lookup.MergedDrafter` merges them)."""
    trie, root = head_trie(drafted)
    q = p(match)
    for d in range(1, len(copied) + 1):
        trie.add(tuple(copied[:d]), q ** d, "lookup")
    return trie.tree(root, nodes)
