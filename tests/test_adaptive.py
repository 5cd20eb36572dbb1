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


def test_exploration_costs_at_most_its_share_where_nothing_pays():
    """A head that never gets a token accepted on a machine where verifying is dear: the
    time spent over plain decoding stays within EXPLORE (and a little)."""
    costs = Costs({1: 1.0, 2: 1.6, 4: 2.8, 8: 5.2}, {"head chain 1": 0.2, "head chain 6": 1.2})
    c = Controller(costs, CHAINS, lookup_p=None, head_prior=0.9)  # a hopeful prior
    spent, tokens, tries = 0.0, 0, 0
    while tokens < 5000:
        choice = c.choose()
        seconds = costs.cycle(choice.option)
        c.update(choice, [], seconds)
        spent += seconds
        tokens += 1
        tries += choice.option.kind != "plain"
    assert 5 < tries and spent / (tokens * costs.cycle(PLAIN)) < 1 + 1.5 * EXPLORE


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

    def choose(self, match=0, copied=(), pending=0):
        cands = self.candidates(match, len(copied), pending)
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
