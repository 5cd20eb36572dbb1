"""Adaptive speculation (`speculate="auto"`): the controller's choices on stubbed costs and
acceptances against the ones worked out by hand, its exploration's bound, and the engine
under switching — greedy output equal to plain decoding, sampling with the target's
exactly enumerated distribution."""


import mlx.core as mx
import pytest

import eagle_mlx
from eagle_mlx.decoding.adaptive import (EXPLORE, MARGIN, AdaptiveDrafter, Controller, Costs,
                                         Option, PLAIN, head_chain)
from eagle_mlx.decoding.engine import SamplingParams
from eagle_mlx.decoding.lookup import LookupSettings
from eagle_mlx.decoding.steps import speculative_steps
from tiny import make_eagle_head, make_hf_model, tiny_llama

TREE = Option("head", 16, 5, 4)
CHAINS = [head_chain(d) for d in (1, 2, 3, 4, 6)]


def geometric(p, n):
    """1 + p + p^2 + ... + p^n, term by term."""
    return 1 + sum(p ** d for d in range(1, n + 1))


def test_plain_when_verifying_costs_as_much_as_the_tokens_it_may_yield():
    """Verify linear in the nodes (a CPU): no head option, and no lookup chain after a short
    match (per-token acceptance 0.85), yields more than it costs."""
    costs = Costs({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}, {"head chain 1": 0.1, "head chain 6": 0.6})
    c = Controller(costs, CHAINS + [TREE], lookup_p=LookupSettings().p, head_prior=0.7,
                   tree_prior=0.8)
    assert c.choose().option == PLAIN
    # lookup chain 1 after a 2-token match: 1.85 tokens for 2.0 s, plain 1 token a second
    assert c.choose(2, [5, 6, 7]).option == PLAIN
    assert c.expect(Option("lookup", 2, 1), 2, 3) == pytest.approx(1.85)


def test_the_longest_lookup_chain_on_repeated_text_when_verifying_is_cheap():
    """Verify nearly flat (a GPU), a long match (0.98 a token), a head that drafts dearly:
    the 16-token lookup chain, whose expected tokens per second are worked out here."""
    costs = Costs({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4, 32: 1.8},
                  {"head chain 1": 0.3, "head chain 6": 1.8})
    c = Controller(costs, CHAINS, lookup_p=LookupSettings().p, head_prior=0.5)
    copied = list(range(20))
    choice = c.choose(9, copied)
    assert choice.option == Option("lookup", 17, 16)
    verify17 = 1.4 + (17 - 16) / (32 - 16) * 0.4  # interpolated
    assert choice.tokens == pytest.approx(geometric(0.98, 16))
    assert choice.seconds == pytest.approx(verify17)
    # each shorter chain, by hand, yields fewer tokens per second
    for n, verify in ((12, 1.2 + 5 / 8 * 0.2), (8, 1.2 + 1 / 8 * 0.2)):
        assert geometric(0.98, n) / verify < choice.rate


def test_a_tree_when_verifying_is_cheap_and_the_head_is_good():
    costs = Costs({1: 1.0, 2: 1.1, 16: 1.5}, {"head chain 1": 0.1, "head chain 6": 0.6,
                                              "head tree 16/5/4": 0.3})
    c = Controller(costs, CHAINS + [TREE], lookup_p=None, head_prior=0.6, tree_prior=0.75)
    choice = c.choose()
    assert choice.option == TREE
    assert choice.rate == pytest.approx(geometric(0.75, 5) / (1.5 + 0.3))
    for d in (1, 2, 3, 4, 6):  # each chain, by hand: drafting costs 0.1 s a level
        verify = 1.1 + (d + 1 - 2) / 14 * 0.4
        assert geometric(0.6, d) / (verify + 0.1 * d) < choice.rate
    # the head's acceptance collapses: a few cycles later it is plain decoding again
    for cycles in range(1, 20):
        choice = c.choose()
        if choice.option == PLAIN:
            break
        c.update(choice, [])
    assert cycles <= 10


@pytest.mark.parametrize("kind", ["head", "lookup"])
def test_exploration_costs_at_most_its_share_where_nothing_pays(kind):
    """A head, or lookup after a long match, that never gets a token accepted, on a machine
    where verifying is dear, under a hopeful prior (0.9 a token; lookup's 0.95): the time
    spent over plain decoding stays within EXPLORE of the whole, EXPLORE / (1 - EXPLORE) of
    plain decoding's time, and a little for the budget still held at the end — each try
    pays what it really lost, not what the hopeful estimate said it would (charged only the
    estimate, lookup's tries lose about twice their share)."""
    costs = Costs({1: 1.0, 2: 1.6, 4: 2.8, 8: 5.2, 16: 10.0},
                  {"head chain 1": 0.2, "head chain 6": 1.2})
    if kind == "head":
        c, where = Controller(costs, CHAINS, lookup_p=None, head_prior=0.9), ()
    else:
        c, where = Controller(costs, [], lookup_p=lambda m: 0.95), (6, [7] * 16)
    spent, tokens, tries = 0.0, 0, 0
    while tokens < 5000:
        choice = c.choose(*where)
        seconds = costs.cycle(choice.option)
        c.update(choice, [], seconds)
        spent += seconds
        tokens += 1
        tries += choice.option.kind != "plain"
    assert 20 < tries
    assert spent / (tokens * costs.cycle(PLAIN)) < 1 + EXPLORE / (1 - EXPLORE) + 0.002


def test_nothing_is_tried_that_could_not_pay_with_every_token_accepted():
    """Verify linear in the nodes: a head chain of d tokens yields at most d + 1 tokens for
    more than d + 1 plain steps' time, so no head option is ever tried; with verify a
    little cheaper, the chain of 1 (2 tokens for 1.6 + 0.2 s, 1.11 a second against plain's
    1.0: above MARGIN) is."""
    linear = Costs({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}, {"head chain 1": 0.1, "head chain 6": 0.6})
    c = Controller(linear, CHAINS + [TREE], lookup_p=None, head_prior=0.9, tree_prior=0.95)
    for _ in range(500):
        choice = c.choose()
        c.update(choice, [], linear.cycle(choice.option))
        assert choice.option == PLAIN
    cheaper = Costs({1: 1.0, 2: 1.6, 4: 4.0}, {"head chain 1": 0.2, "head chain 6": 1.2})
    assert 2 / 1.8 >= MARGIN
    c = Controller(cheaper, CHAINS, lookup_p=None, head_prior=0.1)
    tried = set()
    for _ in range(2000):
        choice = c.choose()
        c.update(choice, [], cheaper.cycle(choice.option))
        tried.add(choice.option)
    assert tried == {PLAIN, head_chain(1)}


def test_a_try_of_the_head_pays_for_its_catching_up():
    """The head is 100 positions behind at 0.05 s each: a try costs 5 s more than it would
    caught up, so it waits until the budget (EXPLORE of the time spent) covers that too."""
    costs = Costs({1: 1.0, 2: 1.2, 4: 1.4, 8: 1.8}, {"head chain 1": 0.3, "head chain 6": 1.0},
                  catch_up=0.05)
    first = {}
    for pending in (0, 100):
        c = Controller(costs.copy(), CHAINS, lookup_p=None, head_prior=0.3)
        for cycle in range(1000):
            choice = c.choose(pending=pending)
            if choice.probe:
                first[pending] = cycle
                assert choice.catch_up == pytest.approx(
                    0.05 * max(pending - choice.option.depth - 1, 0))
                break
            c.update(choice, [], 1.0)
    # a try at p = 0.3 costs about its verify and draft less 1.4 tokens' time; 5 s more
    # takes about 5 / EXPLORE = 167 more plain cycles of budget
    assert first[0] < 30 and 150 < first[100] - first[0] < 190


def test_a_head_that_starts_to_pay_is_taken_up():
    """After a stretch where the head's drafts are all rejected, they start being accepted:
    the first try after that shows it, and the head is the choice from then on."""
    costs = Costs({1: 1.0, 2: 1.2, 4: 1.4, 8: 1.8}, {"head chain 1": 0.3, "head chain 6": 1.0})
    c = Controller(costs, CHAINS, lookup_p=None, head_prior=0.3)
    for cycle in range(2000):
        choice = c.choose()
        good = cycle >= 1000
        c.update(choice, list(range(choice.option.depth)) if good else [], None)
        if cycle == 999:
            assert c.counts.get("head", 0) < 100
            c.counts.clear()
    assert c.counts["head"] > 900


# ---------------------------------------------------------------------------- the engine
class Rotating(Controller):
    """A controller that switches every cycle, by what it has produced so far (so the
    choice depends only on the past): plain, a lookup chain, the head's chain, its tree,
    merged."""

    def choose(self, match=0, copied=(), pending=0, context=None):
        cands = self.candidates(match, len(copied), pending, context)
        n = sum(self.counts.values())
        kind = ("plain", "lookup", "head", "merged")[n % 4]
        of_kind = [c for c in cands if c.option.kind == kind] or \
            [c for c in cands if c.option.kind == "head"]
        choice = of_kind[n // 4 % len(of_kind)]
        if choice.option.kind in ("lookup", "merged"):
            choice.copied = list(copied)
        return choice


def rotating_drafter(model):
    costs = Costs({1: 1.0, 16: 1.0}, {"head chain 1": 0.0})
    drafter = AdaptiveDrafter(costs, model.target, model.head, CHAINS + [Option("head", 6, 3, 2)],
                              LookupSettings(min_match=1))
    make = drafter._controller

    def controller():
        c = make()
        c.__class__ = Rotating
        return c

    drafter._controller = controller
    return drafter


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    target = tiny_llama(root / "t", num_hidden_layers=4)
    return target, make_eagle_head(root / "h", target, "eagle1", seed=1)


def test_greedy_auto_and_switching_equal_plain_decoding(pair):
    target, head = pair
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    for prompt in ([1, 5, 9, 13, 7], [1, 40, 41, 40, 41, 40]):
        plain = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=60,
                                                      speculate=False) for t in r.tokens]
        rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=60,
                                            speculate="auto"))
        assert [t for r in rs for t in r.tokens] == plain
        steps = speculative_steps(model.target, rotating_drafter(model), prompt,
                                  SamplingParams())
        out, kinds = [], set()
        for step in steps:
            out += step.tokens
            kinds.add((step.choice or "plain").split()[0])
            if len(out) >= 60:
                break
        assert out[:60] == plain
        assert kinds == {"plain", "lookup", "head", "merged"}


@pytest.mark.long
def test_sampling_with_switching_is_lossless(tmp_path):
    """The first three tokens of sampled generations that switch between plain, lookup, the
    head's chains and trees, and merged, every cycle: the target's exactly enumerated
    distribution (chi-square)."""
    from test_engine import _chi_square_p, _exact_distribution

    target = make_hf_model(tmp_path / "t", "llama", seed=3, vocab_size=8, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=2, scale=1.0)
    head = make_eagle_head(tmp_path / "h", target, "eagle1", seed=4)
    model, _ = eagle_mlx.load(str(target), eagle=str(head))
    sampling = SamplingParams(temp=0.8, top_k=6, top_p=0.95)
    prompt, runs, n = [1, 3, 1, 3], 1000, 3
    counts = {}
    for seed in range(runs):
        mx.random.seed(seed)
        out = []
        for step in speculative_steps(model.target, rotating_drafter(model), prompt, sampling):
            out += step.tokens
            if len(out) >= n:
                break
        counts[tuple(out[:n])] = counts.get(tuple(out[:n]), 0) + 1
    dist = _exact_distribution(model, prompt, n, sampling)
    assert set(counts) <= set(dist)
    p_value, stat = _chi_square_p(counts, dist, runs)
    assert p_value > 1e-3, (p_value, stat)


def test_plain_passes_decided_ahead_equal_plain_decoding(pair, monkeypatch):
    """Where verifying costs what its tokens would (linear), every pass is plain, decided
    before the token before it is known and started at once on the caches' snapshot: greedy,
    the tokens are plain decoding's; seeded, the draws are those of the same seed without
    drafting ahead (one pass at a time; lossless by the chi-square tests). A choice that
    turns from plain (a repeated text, where verifying is cheap) forgets the pass built
    ahead exactly."""
    from eagle_mlx.decoding.accept import KeyChain
    from eagle_mlx.decoding import adaptive

    target, head = pair
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    started = []
    plain_ahead = adaptive.AdaptiveDrafter.plain_ahead

    def spy(self, state):
        started.append(plain_ahead(self, state))
        return started[-1]

    monkeypatch.setattr(adaptive.AdaptiveDrafter, "plain_ahead", spy)
    prompt = [1, 40, 41, 40, 41, 40, 41, 40]
    dear_head = {"head chain 1": 5.0, "head chain 6": 30.0}
    for costs in (Costs({1: 1.0, 2: 2.0, 4: 4.0, 16: 16.0}),
                  Costs({1: 1.0, 2: 1.1, 4: 1.3, 16: 3.0}, dear_head)):
        model.measured = costs
        for settings in (dict(), dict(temp=0.9, seed=11)):
            if settings:  # (stream_generate's first token is the prefill's, then cycles)
                steps = speculative_steps(model.target, model.adaptive_drafter(), prompt,
                                          SamplingParams(temp=0.9), keys=KeyChain.start(11),
                                          pipeline=False)
                plain = [t for _, s in zip(range(40), steps) for t in s.tokens][:40]
            else:
                plain = [t for r in eagle_mlx.stream_generate(model, tok, prompt,
                                                              max_tokens=40, speculate=False)
                         for t in r.tokens]
            started.clear()
            rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=40, **settings))
            assert [t for r in rs for t in r.tokens] == plain
            if costs.verify(16) > 10:
                assert rs[-1].passes == {"plain": len(plain) - 1} and all(started[:-1])
            elif not settings:  # (lookup pays after a match; the head never)
                assert set(rs[-1].passes) == {"plain", "lookup"}
                assert True in started and False in started


def test_batch_rows_under_auto_equal_their_runs_alone(pair):
    """Greedy and seeded sampling rows under auto, batched: each is its run alone (sampled
    rows choose from the measured costs and their own acceptance only, so a seed repeats)."""
    from eagle_mlx import GenerationSettings

    target, head = pair
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    prompts = [[1, 40, 41, 40, 41, 40], [1, 5, 9, 13, 7], [1, 22, 3, 22, 3]]
    settings = [GenerationSettings(max_tokens=30), GenerationSettings(max_tokens=30, temp=0.8,
                                                                      seed=7),
                GenerationSettings(max_tokens=30, temp=1.0, top_k=8, seed=3)]
    alone = [[t for r in eagle_mlx.stream_generate(model, tok, p, settings=s) for t in r.tokens]
             for p, s in zip(prompts, settings)]
    again = [t for r in eagle_mlx.stream_generate(model, tok, prompts[1], settings=settings[1])
             for t in r.tokens]
    assert again == alone[1]  # a seed repeats its draws
    out = eagle_mlx.batch_generate(model, tok, prompts, settings=settings)
    assert [r.tokens for r in out.results] == alone
    assert all(sum(r.passes.values()) > 0 for r in out.results)


def test_a_second_turn_under_auto_reuses_the_cache_and_equals_a_fresh_run(pair):
    """The head's pending features and lookup's automaton live in the prompt cache with the
    target's caches: the next turn prefills only what is new, and writes what a fresh run
    writes."""
    target, head = pair
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    pc = eagle_mlx.PromptCache()
    first = [1, 40, 41, 40, 41, 40, 41]
    a = [t for r in eagle_mlx.stream_generate(model, tok, first, max_tokens=20, prompt_cache=pc)
         for t in r.tokens]
    second = first + a + [9, 40, 41]
    b = [t for r in eagle_mlx.stream_generate(model, tok, second, max_tokens=20,
                                              prompt_cache=pc) for t in r.tokens]
    assert pc.reused > len(first)
    fresh = [t for r in eagle_mlx.stream_generate(model, tok, second, max_tokens=20,
                                                  speculate=False) for t in r.tokens]
    assert b == fresh


def test_costs_are_measured_once_and_kept(pair, tmp_path, monkeypatch):
    """The first use measures (one line said), later ones read the cache silently; a damaged
    cache entry is measured again; every option's cost is positive and a larger chain never
    costs less."""
    from eagle_mlx.costs import costs_path, model_costs

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path))
    target, head = pair
    model, _ = eagle_mlx.load(str(target), eagle=str(head))
    said = []
    costs = model_costs(model, say=said.append)
    assert len(said) == 2 and "measuring" in said[0] and costs_path(model).is_file()
    verify = [s for _, s in costs.verify_points]
    assert verify == sorted(verify) and verify[0] > 0
    again = model_costs(model, say=said.append)
    assert len(said) == 2 and again.asdict() == costs.asdict()
    costs_path(model).write_text("{not json")
    model_costs(model, say=said.append)
    assert len(said) == 4



def test_a_process_waits_for_another_measuring_and_reads_its_costs(pair, tmp_path,
                                                                  monkeypatch):
    """While another holder has the cache's measuring lock, asking for the costs waits (and
    says so) instead of measuring beside it; the costs it then reads are what the holder
    wrote (here costs made up, no measurement's), and it measures nothing itself."""
    import json
    import threading

    from eagle_mlx.costs import costs_path, model_costs, one_measurement_at_a_time

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path))
    target, head = pair
    model, _ = eagle_mlx.load(str(target), eagle=str(head))
    made_up = Costs({1: 0.125, 2: 0.25, 4: 0.5, 8: 1.0, 16: 2.0})
    said, got = [], []
    with one_measurement_at_a_time(said.append):
        waiter = threading.Thread(target=lambda: got.append(
            model_costs(model, say=said.append)), daemon=True)
        waiter.start()
        for _ in range(500):  # (until it says it waits: at most 5 s)
            if said:
                break
            threading.Event().wait(0.01)
        assert said and "waiting" in said[0] and not got, said
        costs_path(model).parent.mkdir(parents=True, exist_ok=True)
        costs_path(model).write_text(json.dumps({"costs": made_up.asdict()}))
    waiter.join(60)
    assert len(said) == 1 and got and got[0].verify_points == made_up.verify_points

def test_costs_grow_with_the_context_on_the_measured_line():
    """Costs measured after 12 positions and after 1012 that follow an exact line in the
    context (a verify pass of n nodes: 2e-3 + 1e-3 n seconds more per position; a drafted
    level 5e-4): the fitted growth is that line's, and the cost at any length is the line's
    value, worked out here. A draft window of 100 stops the drafter's growth there."""
    def verify(n, ctx):
        return 1.0 + 0.1 * n + (2e-3 + 1e-3 * n) * (ctx - 12)

    def draft(depth, read, base=12):
        return 0.2 * depth + 5e-4 * depth * (read - base)

    ns = (1, 2, 4, 8, 16)
    labels = {"head chain 1": 1, "head chain 6": 6, "head tree 16/5/4": 5}
    for window in (None, 100):
        far = 1012 if window is None else 100
        costs = Costs({n: verify(n, 12) for n in ns}, {k: draft(d, 12) for k, d in
                                                       labels.items()}, at=12,
                      longer={"at": 1012, "draft_at": far, "draft_window": window,
                              "verify": {n: verify(n, 1012) for n in (1, 4, 16)},
                              "draft": {k: draft(d, far) for k, d in labels.items()}})
        costs = Costs.fromdict(costs.asdict())  # (as kept in the cache)
        assert costs.grow_fixed == pytest.approx(2e-3) and costs.grow_node == pytest.approx(1e-3)
        for ctx in (12, 500, 4096, 20000):
            for n in (1, 3, 16, 32):
                linear_in_n = 1.0 + 0.1 * n  # (the short curve is exact: a line in n too)
                assert costs.verify(n, ctx) == pytest.approx(
                    linear_in_n + (2e-3 + 1e-3 * n) * (ctx - 12))
            read = ctx if window is None else min(ctx, window)
            assert costs.draft(head_chain(3), ctx) == pytest.approx(draft(3, read))
            assert costs.draft(TREE, ctx) == pytest.approx(draft(5, read))
            assert costs.cycle(head_chain(3), ctx) == pytest.approx(
                verify(4, ctx) + draft(3, read))
        assert costs.verify(4) == pytest.approx(verify(4, 12))  # (no length: the short one)


def test_the_controller_turns_to_plain_where_the_context_makes_the_head_dear():
    """A head chain that pays after a short prompt stops paying as the verify pass's nodes
    grow dearer with the context (a CPU: every node attends to every position): the choice
    at each length is the option with the most tokens per second there, worked out by hand
    from the line, and plain beyond the length where none beats it by MARGIN."""
    short = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4}
    grow = 1e-3  # seconds per node per position
    costs = Costs(short, {"head chain 1": 0.05, "head chain 6": 0.3}, at=0,
                  longer={"at": 1000, "verify": {n: s + grow * n * 1000 for n, s in
                                                 short.items()},
                          "draft": {"head chain 1": 0.05, "head chain 6": 0.3}})
    c = Controller(costs, CHAINS, lookup_p=None, head_prior=0.8)

    def by_hand(ctx):
        """(the option, whether it is a try): the fastest where it beats plain by MARGIN;
        else, with no budget saved yet, a try only of a head option that costs nothing
        beyond plain's rate (and could pay with every token accepted)."""
        plain = 1.0 / (1.0 + grow * ctx)
        rates = {}
        for o in CHAINS:
            seconds = costs._curve(costs.verify_points, o.nodes) + grow * o.nodes * ctx + \
                0.05 * o.depth  # (the draft does not grow here)
            rates[o] = (geometric(0.8, o.depth) / seconds, (o.depth + 1) / seconds)
        best = max(rates, key=lambda o: rates[o][0])
        if rates[best][0] >= MARGIN * plain:
            return best, False
        tries = [o for o in rates if rates[o][1] >= MARGIN * plain and rates[o][0] >= plain]
        return (max(tries, key=lambda o: rates[o][0]), True) if tries else (PLAIN, False)

    seen = set()
    for ctx in (0, 100, 300, 1000, 3000, 10000):
        choice = c.choose(context=ctx)
        assert (choice.option, choice.probe) == by_hand(ctx) and choice.context == ctx
        seen.add((choice.option.kind, choice.probe))
    assert seen == {("head", False), ("head", True), ("plain", False)}


def test_auto_chooses_by_the_cost_at_the_sequence_s_own_length(pair):
    """Costs whose verify pass grows by 0.2 s per node per position of context (and a
    short-prompt curve that is flat): after a 2-token prompt the head's chains pay and are
    drafted; after a 110-token one none could pay even with every token accepted, so every
    pass is plain — where the same costs without their growth draft after that prompt too.
    Either way the tokens are plain decoding's."""
    target, head = pair
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    model.head.source = model.head.source.replace(held_out_top1=0.9)  # (the prior)
    flat = {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08}
    draft = {"head chain 1": 0.01, "head chain 6": 0.06}
    growing = Costs(flat, draft, at=0, longer={"at": 100, "verify": {
        n: s + 0.2 * n * 100 for n, s in flat.items()}, "draft": draft})
    long_prompt = [1] + [(7 * i) % 60 + 3 for i in range(109)]
    for costs, prompt, head_drafts in ((growing, [1, 5], True), (growing, long_prompt, False),
                                       (Costs(flat, draft), long_prompt, True)):
        model.measured = costs
        plain = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=12,
                                                      speculate=False) for t in r.tokens]
        rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=12))
        assert [t for r in rs for t in r.tokens] == plain
        drafted = {k for k in rs[-1].passes if k.startswith("head")}
        assert bool(drafted) == head_drafts, (len(prompt), rs[-1].passes)


def test_costs_are_measured_again_after_a_long_prompt(tmp_path, monkeypatch):
    """A target with room (512 positions) is measured after a short prompt and again after
    half its context, at the same chain sizes and head options, the growth never negative;
    a head with a draft window has costs of its own (its growth stops at the window), and a
    target too short to tell a slope is measured once."""
    from eagle_mlx.costs import LONG_CONTEXT, MEASURE_PROMPT, costs_path, model_costs

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path / "cache"))
    target = tiny_llama(tmp_path / "t", num_hidden_layers=2, max_position_embeddings=512)
    head = make_eagle_head(tmp_path / "h", target, "eagle1", seed=1)
    paths = set()
    for window in (None, 16):
        model, _ = eagle_mlx.load(str(target), eagle=str(head), draft_window=window)
        costs = model_costs(model, say=lambda m: None)
        paths.add(costs_path(model))
        long = costs.longer
        assert costs.at == MEASURE_PROMPT and long["at"] == min(LONG_CONTEXT, 256)
        assert long["draft_window"] == window and long["draft_at"] == (window or 256)
        assert set(long["draft"]) == set(costs.draft_costs)
        assert {n for n, _ in long["verify"]} <= {n for n, _ in costs.verify_points}
        assert min(costs.grow_fixed, costs.grow_node, costs.grow_level) >= 0
        assert costs.cycle(PLAIN, 5000) >= costs.cycle(PLAIN, 12)
    assert len(paths) == 2
    short = tiny_llama(tmp_path / "s", num_hidden_layers=2, max_position_embeddings=128)
    model, _ = eagle_mlx.load(str(short), eagle=str(head))
    assert model_costs(model, say=lambda m: None).longer is None



def test_the_long_measurement_fits_a_short_prefill():
    """The second measurement's prompt: 1024 positions, half the context where that is
    shorter, and where passes are slow (a CPU's reference BLAS: 4 tokens in 0.2 s), what
    about LONG_PREFILL seconds of prefill reach at the largest chain's rate — none below
    MIN_LONG_CONTEXT."""
    from types import SimpleNamespace

    from eagle_mlx.costs import LONG_PREFILL, MIN_LONG_CONTEXT, long_context

    roomy, short = SimpleNamespace(max_context=32768), SimpleNamespace(max_context=600)
    assert long_context(roomy) == 1024 and long_context(short) == 300
    assert long_context(roomy, Costs({1: 0.001, 16: 0.004})) == 1024
    rate = 16 / 0.25  # tokens a second at the 16-node chain's pace
    assert long_context(roomy, Costs({1: 0.02, 16: 0.25})) == int(LONG_PREFILL * rate)
    slow = Costs({1: 0.05, 2: 0.1, 4: 0.2})
    assert LONG_PREFILL * 4 / 0.2 < MIN_LONG_CONTEXT and long_context(roomy, slow) == 0


def test_draft_costs_are_never_below_the_heads_own_drafting(pair, tmp_path, monkeypatch):
    """A machine loaded while the verify points are measured (every lookup chain's cycle,
    plain passes included, 40 ms slower) makes a head cycle less the verify of as many nodes
    negative; each head option is still charged at least its own drafting timed alone (the
    head's forward here sleeps 10 ms a call and 3 ms a position it reads, so a chain of d
    costs at least 10 ms x d: its first level comes with the catching up), and catching up is priced at about its 3 ms a position
    from the drafting alone, not from two cycles' difference."""
    import time

    from eagle_mlx.costs import head_options, measure
    from eagle_mlx.decoding.adaptive import _parse_label

    target, head = pair
    model, _ = eagle_mlx.load(str(target), eagle=str(head))
    head_call, propose = type(model.head).__call__, AdaptiveDrafter.propose

    def slow_head(self, features, tokens, *args, **kwargs):
        time.sleep(0.01 + 0.003 * int(tokens.shape[-1]))
        return head_call(self, features, tokens, *args, **kwargs)

    def loaded(self, state, *args):
        if state.forced is not None and state.forced.kind == "lookup":
            time.sleep(0.04)
        return propose(self, state, *args)

    monkeypatch.setattr(type(model.head), "__call__", slow_head)
    monkeypatch.setattr(AdaptiveDrafter, "propose", loaded)
    monkeypatch.setattr("eagle_mlx.costs.long_context", lambda target, short=None: 0)
    costs = measure(model, head_options(model))
    assert costs.draft_costs
    for label, seconds in costs.draft_costs.items():
        option = _parse_label(label)
        assert seconds >= 0.01 * option.depth, (label, seconds)
    assert 0.002 < costs.catch_up < 0.006, costs.catch_up


def test_the_heads_drafting_is_priced_where_no_head_option_can_pay(pair, monkeypatch):
    """A machine where a pass over n tokens costs n plain ones (every chain's cycle 50 ms a
    node more): no head option can pay, and the shortest chain's drafting and the catching
    up are measured all the same (the head here sleeps 10 ms a call and 3 ms a position it
    reads), so that no head option is ever priced as drafting for free."""
    import time

    from eagle_mlx.costs import head_options, measure

    target, head = pair
    model, _ = eagle_mlx.load(str(target), eagle=str(head))
    head_call, propose = type(model.head).__call__, AdaptiveDrafter.propose

    def slow_head(self, features, tokens, *args, **kwargs):
        time.sleep(0.01 + 0.003 * int(tokens.shape[-1]))
        return head_call(self, features, tokens, *args, **kwargs)

    def linear(self, state, *args):
        if state.forced is not None and state.forced.kind == "lookup":
            time.sleep(0.05 * state.forced.nodes)
        return propose(self, state, *args)

    monkeypatch.setattr(type(model.head), "__call__", slow_head)
    monkeypatch.setattr(AdaptiveDrafter, "propose", linear)
    monkeypatch.setattr("eagle_mlx.costs.long_context", lambda target, short=None: 0)
    costs = measure(model, head_options(model))
    # (linear: each chain's cycle holds its 50 ms a node, whatever a loaded machine adds)
    assert all(s >= 0.045 * n for n, s in costs.verify_points if n >= 4)
    # (chain 1 where no option can pay; a loaded machine's slow plain pass can let one pay,
    # and the shortest that can is measured then: either way a chain's drafting is timed)
    assert any(k.startswith("head chain ") for k in costs.draft_costs), costs.draft_costs
    for option in head_options(model):
        assert costs.draft(option) >= 0.01 * option.depth, option
    assert 0.002 < costs.catch_up < 0.006, costs.catch_up

def test_costs_measured_on_a_loaded_machine_are_noticed_and_measured_again(pair, tmp_path,
                                                                           monkeypatch):
    """A costs cache whose passes all cost 10x what they do now (measured while the machine
    was loaded) is noticed by the first plain passes of the next greedy generation, which
    correct the plain pass at once, and its other points are timed again as cycles of the
    greedy generations that follow, as their share of the time allows (within some dozens
    of generations of 64 tokens on this tiny model): every point comes down by more than half
    (a shared machine's noise is within that), `notes` says why, and the tokens are plain
    decoding's. Sampling generations choose by the costs as read, before and after (a seed
    draws the same tokens), and the cache file is left as it was. A point whose runs spread
    when it was measured is timed again even where plain passes agree with the costs."""
    from eagle_mlx.costs import costs_path, model_costs

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path))
    target, _ = pair
    model, tok = eagle_mlx.load(str(target))
    tok.eos_token_ids = set()
    fresh = model_costs(model, say=lambda m: None)
    prompt = [1, 5, 9, 13, 7, 22, 31, 3, 18, 27, 11, 60]
    plain = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=64,
                                                  speculate=False) for t in r.tokens]

    def cached(scale, spread=None):
        loaded = Costs.fromdict(fresh.asdict())
        loaded.verify_points = [(n, s * scale.get(n, scale.get(0, 1.0)))
                                for n, s in loaded.verify_points]
        loaded.spread = spread or {}
        costs_path(model).write_text(__import__("json").dumps({"costs": loaded.asdict()}))
        model.measured = None  # (read from the cache file, as a new process reads it)
        return model.costs()

    def sampled():
        return [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=64,
                                                     temp=0.8, seed=5) for t in r.tokens]

    def greedy_until_checked(costs):
        # (a generation of 64 tokens lets about 2.5 plain passes' time go to timing points
        # again: a point cached at 10x a pass over 2 tokens, which a noisy first measure can
        # make 15 plain passes dear, waits several generations for its turn)
        for _ in range(40):
            assert [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=64)
                    for t in r.tokens] == plain
            if costs.recheck.done:
                return
        raise AssertionError((costs.recheck.queue, costs.recheck.budget))

    costs = cached({0: 10.0})
    written = costs_path(model).read_text()
    before = sampled()
    assert not costs.recheck.plain and not costs.recheck.done
    out = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=64)
           for t in r.tokens]
    assert out == plain
    assert "plain passes ran" in costs.recheck.notes[0], costs.recheck.notes
    assert costs.verify(1) < 0.5 * 10 * fresh.verify(1)  # (within the first generation)
    greedy_until_checked(costs)
    assert len(costs.recheck.notes) == len(costs.verify_points), costs.recheck.notes  # (each)
    for (n, s), (_, truth) in zip(costs.verify_points, fresh.verify_points):
        assert s < 0.5 * 10 * truth, (n, s, truth)
    assert sampled() == before and costs_path(model).read_text() == written
    costs = cached({2: 10.0}, spread={2: 0.9})
    greedy_until_checked(costs)
    assert "spread 90%" in " ".join(costs.recheck.notes)
    assert costs.verify(2) < 0.5 * 10 * fresh.verify(2)
    if "plain passes ran" not in " ".join(costs.recheck.notes):  # (the others as they were,
        low = costs.verify(2)                                     # or raised to stay above)
        for (n, s), (_, f) in zip(costs.verify_points[2:], fresh.verify_points[2:]):
            low = max(f, low)
            assert s == low, (n, s, f)


def test_plain_passes_decided_ahead_copy_no_cache(pair, monkeypatch):
    """A plain pass decided ahead runs on the caches as they are: the caches are
    snapshotted (every layer's buffers copied) only where the next pass may still be
    forgotten, not on every pass of a generation that decodes plainly throughout — and the
    tokens are plain decoding's."""
    from eagle_mlx.targets.cache import TreeKVCache

    target, head = pair
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    model.measured = Costs({1: 1.0, 2: 2.0, 4: 4.0, 16: 16.0}, {"head chain 1": 5.0})
    prompt = [1, 5, 9, 13, 7]
    plain = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=40,
                                                  speculate=False) for t in r.tokens]
    copies = []
    snapshot = TreeKVCache.snapshot
    monkeypatch.setattr(TreeKVCache, "snapshot",
                        lambda self: copies.append(1) or snapshot(self))
    rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=40))
    assert [t for r in rs for t in r.tokens] == plain
    assert rs[-1].passes == {"plain": 39}
    assert len(copies) <= model.target.num_layers, len(copies)  # (at most one pass's)


def test_a_lookup_chain_costed_too_dear_is_tried_and_taken_up():
    """Costs measured on a loaded machine put a pass over 2, 4, 8 tokens at 1.9, 3.6, 7.0
    plain ones where it takes 1.4, 2.4, 4.4, on text that repeats (every copied token
    accepted): as measured, no lookup chain is expected to beat plain decoding by MARGIN,
    but one would with every token accepted, so lookup is tried from its exploration
    budget, its cycles' own timings and acceptance correct the estimate, and lookup is the
    choice from then on; the time spent is below plain decoding's for the same tokens."""
    measured = {1: 1.0, 2: 1.9, 4: 3.6, 8: 7.0}
    true = Costs({1: 1.0, 2: 1.4, 4: 2.4, 8: 4.4})
    c = Controller(Costs(measured), [], lookup_p=LookupSettings().p)
    copied = list(range(20))
    first = c.choose(4, copied)
    assert first.option == PLAIN and not first.probe  # (as measured, plain is the choice)
    cands = c.candidates(4, len(copied))
    assert cands[0].option == PLAIN and len(cands) > 1
    assert all(ch.rate < MARGIN * cands[0].rate for ch in cands[1:])
    c.update(first, [], true.cycle(PLAIN))
    spent, tokens, kinds = true.cycle(PLAIN), 1, []
    for _ in range(300):
        choice = c.choose(4, copied)
        drafted = choice.copied[: choice.option.depth]
        seconds = true.cycle(choice.option)
        c.update(choice, drafted, seconds)
        spent, tokens = spent + seconds, tokens + len(drafted) + 1
        kinds.append(choice.option.kind)
    assert "lookup" in kinds[:100] and kinds[-100:].count("lookup") == 100
    assert spent < 0.8 * tokens * true.cycle(PLAIN)


def test_what_a_greedy_generation_learned_of_the_costs_is_where_the_next_starts(
        pair, tmp_path, monkeypatch):
    """Cached costs whose passes over several tokens are 0.05 s a node cheaper than this
    machine runs them (a point measured while the machine was loaded differently): a greedy
    generation that drafts lookup chains learns the difference from its cycles' timings (here
    each cycle is charged the true cost of what it chose), and the next greedy generation
    starts from it — its first lookup cycle's cost is expected within 10 % of the truth,
    where the first generation's was expected 0.05 s a node short. A sampled generation takes
    the costs as read (a seed draws the same tokens in every process). Every greedy text is
    plain decoding's."""
    import json

    from eagle_mlx.costs import costs_path

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path))
    target, _ = pair
    model, tok = eagle_mlx.load(str(target))
    tok.eos_token_ids = set()
    cached = Costs({1: 0.1, 2: 0.15, 4: 0.25, 8: 0.45, 16: 0.85})
    costs_path(model).parent.mkdir(parents=True, exist_ok=True)
    costs_path(model).write_text(json.dumps({"costs": cached.asdict()}))

    def truth(option):
        return cached.cycle(option) + 0.05 * (option.nodes - 1)

    observe, update, firsts = AdaptiveDrafter.observe, Controller.update, []

    def charged(self, state, accepted, seconds):
        if seconds is not None and state.choice is not None:
            seconds = truth(state.choice.option)
        return observe(self, state, accepted, seconds)

    def first_lookup(self, choice, accepted, seconds=None):
        if choice.option.kind == "lookup" and len(firsts) < run[0]:
            firsts.append((choice.option, choice.seconds))
        return update(self, choice, accepted, seconds)

    monkeypatch.setattr(AdaptiveDrafter, "observe", charged)
    monkeypatch.setattr(Controller, "update", first_lookup)
    prompt = [1] + [5, 6, 7, 8, 9, 10, 11, 12] * 4
    plain = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=40,
                                                  speculate=False) for t in r.tokens]
    run = [0]
    for temp in (0.0, 0.0, 0.2):
        run[0] += 1
        out = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=40,
                                                    temp=temp, seed=3) for t in r.tokens]
        assert temp or out == plain
        assert len(firsts) == run[0], f"generation {run[0]} drafted no lookup chain"
    (o1, s1), (o2, s2), (o3, s3) = firsts
    assert s1 == pytest.approx(cached.cycle(o1))  # (the costs as read: a node 0.05 s short)
    assert abs(s2 - truth(o2)) <= 0.1 * truth(o2), (o2, s2, truth(o2))
    assert s3 == pytest.approx(cached.cycle(o3))


def test_the_benchmarks_loaded_machine_is_a_process_that_works_and_is_gone_after():
    """`benchmark --auto --measure-under-load` measures while `busy_core` runs: a second
    process that spends CPU time while the block runs (read from /proc, where there is one)
    and is stopped and reaped when it ends, by an error too."""
    import os
    import time

    from eagle_mlx.bench.auto import busy_core

    with pytest.raises(KeyboardInterrupt):
        with busy_core() as proc:
            assert proc.poll() is None
            stat = f"/proc/{proc.pid}/stat"
            if os.path.exists(stat):
                time.sleep(1.0)
                ticks = sum(int(x) for x in open(stat).read().rsplit(")", 1)[1].split()[11:13])
                assert ticks / os.sysconf("SC_CLK_TCK") > 0.3, ticks
            raise KeyboardInterrupt
    assert proc.returncode is not None  # (stopped and reaped)


def test_timing_points_again_spends_a_bounded_share_on_a_cpu_like_curve(pair, tmp_path,
                                                                        monkeypatch):
    """A CPU whose pass over n tokens costs n plain ones (0.1 s each: every cycle is charged
    that), and a costs cache measured 1.5x dear: the first plain passes notice it and the
    plain pass is corrected at once; the passes over more tokens are timed again only as
    RECHECK_SHARE of the time spent allows (a pass over 2 tokens within the first 64, the
    dear ones later), so the generation spends at most that share more than plain decoding
    of the same tokens would — timing every point at once would have cost 2.6 s of 6.4 —
    with plain decoding's tokens."""
    import json

    from eagle_mlx.costs import costs_path
    from eagle_mlx.decoding.adaptive import RECHECK_SHARE

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path))
    target, _ = pair
    model, tok = eagle_mlx.load(str(target))
    tok.eos_token_ids = set()
    cached = Costs({n: 0.15 * n for n in (1, 2, 4, 8, 16)})
    costs_path(model).parent.mkdir(parents=True, exist_ok=True)
    costs_path(model).write_text(json.dumps({"costs": cached.asdict()}))
    observe, spent = AdaptiveDrafter.observe, []

    def charged(self, state, accepted, seconds):
        if seconds is not None and state.choice is not None:
            seconds = 0.1 * state.choice.option.nodes
            spent.append(seconds)
        return observe(self, state, accepted, seconds)

    monkeypatch.setattr(AdaptiveDrafter, "observe", charged)
    prompt = [1, 5, 9, 13, 7, 22, 31, 3, 18, 27, 11, 60]
    plain = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=64,
                                                  speculate=False) for t in r.tokens]
    out = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=64)
           for t in r.tokens]
    assert out == plain
    recheck = model.costs().recheck
    assert "plain passes ran 0.67x" in recheck.notes[0], recheck.notes
    assert model.costs().verify(1) == pytest.approx(0.1)
    assert 2 in recheck.timed and 16 not in recheck.timed, recheck.timed
    assert sum(spent) <= (1 + RECHECK_SHARE) * 0.1 * (len(out) - 1) + 1e-9, sum(spent)


def test_the_auto_benchmark_turns_the_order_every_round(pair, tmp_path, monkeypatch):
    """`benchmark --auto --rounds 2`: every prompt is decoded twice in each mode, the pair's
    order turning each time (plain, auto, auto, plain on the first prompt; auto first on
    the second), and the report's speeds are the runs' tokens over their seconds, summed
    over the prompts and rounds, with the median of the prompts' own ratios beside them."""
    import json
    import statistics

    import eagle_mlx.bench.auto as bench_auto
    from tiny import tool

    from eagle_mlx.costs import costs_path

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path / "cache"))
    target, head = pair
    model, _ = eagle_mlx.load(str(target), eagle=str(head))  # (costs on record: none measured)
    costs_path(model).parent.mkdir(parents=True, exist_ok=True)
    costs_path(model).write_text(json.dumps({"costs": Costs({1: 1.0, 2: 1.1, 4: 1.2}).asdict()}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in ("t5 t9 t11 t20", "t7 t8 t7 t8 t7")))
    order, timed = [], bench_auto.timed_generation

    def recorded(model, tok, ids, **kw):
        order.append((tuple(ids), "auto" if kw["speculate"] == "auto" else "plain"))
        return timed(model, tok, ids, **kw)

    monkeypatch.setattr(bench_auto, "timed_generation", recorded)
    out = tmp_path / "auto.json"
    proc = tool("benchmark", "--model", target, "--eagle", head, "--auto", "--rounds", "2",
                "--prompts", prompts, "--num-prompts", "2", "--max-tokens", "8",
                "--ignore-chat-template", "--output", out)
    assert proc.returncode == 0, proc.stderr
    first, second = dict.fromkeys(ids for ids, _ in order)
    assert [(ids == first, m) for ids, m in order] == [
        (True, "plain"), (True, "auto"), (True, "auto"), (True, "plain"),
        (False, "auto"), (False, "plain"), (False, "plain"), (False, "auto")]
    t = json.loads(out.read_text())["temps"]["0.0"]
    rows, s = t["prompts"], t["summary"]["p.jsonl"]

    def speed(runs):
        return sum(len(g["tokens"]) - 1 for g in runs) / sum(g["seconds"] for g in runs)

    assert all(len(r["plain"]) == len(r["auto"]) == 2 and r["identical"] for r in rows)
    for m in ("plain", "auto"):
        assert s[f"{m}_tokens_per_second"] == pytest.approx(speed([g for r in rows
                                                                   for g in r[m]]))
    assert s["ratio"] == pytest.approx(s["auto_tokens_per_second"] /
                                       s["plain_tokens_per_second"])
    assert s["median_prompt_ratio"] == pytest.approx(statistics.median(
        speed(r["auto"]) / speed(r["plain"]) for r in rows))
    assert s["identical"] is True and sum(s["passes"].values()) > 0
