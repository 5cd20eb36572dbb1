"""Continuous batching: every sequence of a batch is exactly what it would be alone.

The reference of each sequence is `stream_generate` on it alone (whose greedy output the
other test files hold against transformers, and whose sampling against the target's
distribution); the batch must give the same tokens (greedy), the same draws (sampling with
a seed), and after every cycle caches equal to those the sequence keeps alone."""

import numpy as np
import pytest

import eagle_mlx
from eagle_mlx import BatchGenerator, batch_generate
from eagle_mlx.decoding.engine import Engine, SamplingParams
from eagle_mlx.errors import EagleError
from eagle_mlx.decoding.settings import GenerationSettings
from tiny import make_eagle_head, make_hf_model

FAMILIES = ["llama2_mha", "gemma3_swa", "gpt_oss_swa", "qwen3_5"]
LONG_FAMILIES = ["qwen3_moe", "mistral_swa", "gemma4_swa", "ministral3_swa", "qwen3_next",
                 "llama_dynamic"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from conftest import TINY_TARGETS

    root = tmp_path_factory.mktemp("batch")
    made = {}

    def get(name, kind="eagle1"):
        if (name, kind) not in made:
            k, overrides = TINY_TARGETS[name]
            overrides = dict(overrides)
            if kind == "eagle3":
                overrides["num_hidden_layers"] = 7
                if "layer_types" in overrides:
                    overrides["layer_types"] = (["sliding_attention"] * 2 + ["full_attention"]) \
                        * 2 + ["sliding_attention"]
            t = make_hf_model(root / f"{name}-{kind}", k, seed=11, vocab_size=64, scale=4.0,
                              **overrides)
            h = make_eagle_head(root / f"{name}-{kind}-h", t, kind, seed=3,
                                draft_vocab_size=40 if kind == "eagle3" else 0)
            made[name, kind] = (t, h)
        return made[name, kind]

    return get


# prompts that repeat themselves, so that prompt lookup's branches are accepted too (the
# random heads alone accept little): sequences accept different lengths in one cycle
PROMPTS = [[5 + (i * 7) % 11 for i in range(n)] for n in (3, 9, 17, 30, 6, 12)]
TREE = dict(total_tokens=8, depth=3, draft_top_k=2)
SETTINGS = [
    GenerationSettings(max_tokens=24, **TREE),
    GenerationSettings(max_tokens=30, temp=0.7, seed=5, **TREE),
    GenerationSettings(max_tokens=20, speculate=False),
    GenerationSettings(max_tokens=28, temp=1.0, seed=9, speculate=False),
    GenerationSettings(max_tokens=16, tree_choices=[[0], [1], [0, 0]]),
    GenerationSettings(max_tokens=26, temp=0.5, top_k=5, top_p=0.9, seed=2, speculate=True),
]


def alone(model, tok, prompt, settings):
    rs = list(eagle_mlx.stream_generate(model, tok, prompt, settings=settings))
    return [t for r in rs for t in r.tokens], "".join(r.text for r in rs), rs[-1]


def check_batch_equals_alone(model, tok, max_batch, prompts=PROMPTS, settings=SETTINGS):
    ref = [alone(model, tok, p, s) for p, s in zip(prompts, settings)]
    res = batch_generate(model, tok, prompts, settings=settings, max_batch=max_batch)
    assert len(res.texts) == len(prompts)
    for (tokens, text, last), r, got in zip(ref, res.results, res.texts):
        assert r.tokens == tokens
        assert got == text
        assert r.finish_reason == last.finish_reason
        assert r.mean_accept_length == pytest.approx(last.mean_accept_length)
    return ref, res


@pytest.mark.parametrize("name", FAMILIES)
def test_batch_equals_each_sequence_alone(pairs, name):
    """Six requests (prompt lengths 3..30, greedy and seeded sampling, dynamic, static and
    no trees, the head merged with prompt lookup) through batches of at most 4: the later
    ones join as the first finish. Every sequence's tokens, text, finish reason and tau
    equal its run alone."""
    t, h = pairs(name)
    model, tok = eagle_mlx.load(str(t), eagle=str(h), lookup=True)
    ref, res = check_batch_equals_alone(model, tok, max_batch=4)
    # sequences accept different numbers of drafted tokens in the same cycles
    assert {0, 1} <= {a for r in res.results for a in r.accept_lengths}


@pytest.mark.long
@pytest.mark.parametrize("name", LONG_FAMILIES)
def test_batch_equals_alone_other_families(pairs, name):
    """The other families, shorter: four of the requests, at most 3 at once."""
    t, h = pairs(name)
    model, tok = eagle_mlx.load(str(t), eagle=str(h), lookup=True)
    short = [s.replace(max_tokens=10) for s in SETTINGS]
    check_batch_equals_alone(model, tok, max_batch=3, prompts=PROMPTS[1:5], settings=short[1:5])


@pytest.mark.parametrize("name", ["llama2_mha", "gemma3_swa"])
def test_batch_equals_alone_eagle3_head(pairs, name):
    """An EAGLE-3 head (three tap layers, a draft vocabulary): the batch verify hands each
    row its own taps."""
    t, h = pairs(name, "eagle3")
    model, tok = eagle_mlx.load(str(t), eagle=str(h))
    check_batch_equals_alone(model, tok, max_batch=6)


def test_head_alone_and_lookup_alone(pairs):
    t, h = pairs("llama2_mha")
    model, tok = eagle_mlx.load(str(t), eagle=str(h))
    check_batch_equals_alone(model, tok, max_batch=6)
    model, tok = eagle_mlx.load(str(t), lookup=True)
    check_batch_equals_alone(model, tok, max_batch=2, settings=[
        GenerationSettings(max_tokens=s.max_tokens, temp=s.temp, top_k=s.top_k, top_p=s.top_p,
                           seed=s.seed, speculate=True) for s in SETTINGS])


def _rows(cache, b):
    """Row b of a batch cache as (first position, keys, values) / (window, state)."""
    if hasattr(cache, "row"):
        k, v = cache.row(b)
        return cache.bases[b], k, v
    return None, cache.windows[b: b + 1], cache.states[b: b + 1]


def _alone(cache):
    if hasattr(cache, "keys"):
        base = getattr(cache, "base", 0)
        n = cache.offset - base
        return base, cache.keys[..., :n, :], cache.values[..., :n, :]
    return None, cache[0], cache[1]


@pytest.mark.parametrize("name", ["gemma3_swa", "qwen3_5"])
def test_batch_caches_equal_each_sequence_alone(pairs, name):
    """After every cycle each row of every layer's batch cache (keys and values of the
    positions both hold; a linear-attention layer's window and state) equals the cache
    the sequence's own engine keeps, cycle by cycle, with three sequences joining (one
    prefilled in chunks over several steps) and one leaving early."""
    from eagle_mlx.decoding.eagle import EagleDrafter
    from eagle_mlx.decoding.lookup import LookupDrafter, MergedDrafter

    t, h = pairs(name)
    model, tok = eagle_mlx.load(str(t), eagle=str(h), lookup=True)
    target = model.target
    gen = BatchGenerator(model, tok, max_batch=3, prefill_chunk=4)
    prompts, lengths = PROMPTS[1:4], [40, 12, 40]
    engines, states = [], []
    for p, n in zip(prompts, lengths):
        gen.add(p, GenerationSettings(max_tokens=n, **TREE))
        d = MergedDrafter(EagleDrafter(model.head, target, 8, 3, 2), LookupDrafter(model.lookup), 8)
        e = Engine(target, d, SamplingParams(), target.max_context)
        s = e.new_state()
        e.prefill(s, p)
        engines.append(e)
        states.append(s)
    cycles = 0
    while gen.busy:
        for uid, r in gen.step():
            if r.accept_length is not None:  # a cycle (not the prefill's first token)
                engines[uid - 1].cycle(states[uid - 1])
                cycles += 1
        for b, seq in enumerate(gen.active):
            alone_state = states[seq.uid - 1]
            assert seq.state.n == alone_state.n
            for bc, c in zip(gen.caches, alone_state.caches):
                base_b, *got = _rows(bc, b)
                base_a, *want = _alone(c)
                if base_b is not None:  # the positions both hold (a window drops old ones)
                    first = max(base_a, base_b)
                    got = [g[..., first - base_b:, :] for g in got]
                    want = [w[..., first - base_a:, :] for w in want]
                for g, w in zip(got, want):
                    assert g.shape == w.shape
                    np.testing.assert_allclose(np.array(g), np.array(w), atol=2e-5, rtol=1e-4)
            # the head's cache (drafted for every row in one pass a level) as well
            own = alone_state.drafter[0]
            _, hk, hv = _rows(gen.head_caches.layers[0], b)
            n = own.offset
            assert hk.shape[2] == n
            np.testing.assert_allclose(np.array(hk), np.array(own.keys[..., :n, :]), atol=2e-5,
                                       rtol=1e-4)
            np.testing.assert_allclose(np.array(hv), np.array(own.values[..., :n, :]), atol=2e-5,
                                       rtol=1e-4)
    assert cycles >= 12


def test_stop_strings_and_cancel(pairs):
    """A stop string cuts a sequence's text before its first occurrence in what it would
    write alone (and ends it there, the others unaffected); a cancelled sequence leaves at
    once; a sequence added while others decode joins them."""
    t, h = pairs("llama2_mha")
    model, tok = eagle_mlx.load(str(t), eagle=str(h), lookup=True)
    ref = [alone(model, tok, p, s) for p, s in zip(PROMPTS, SETTINGS)]
    stops = [[text[6:9]] if len(text) > 12 else [] for _, text, _ in ref]
    res = batch_generate(model, tok, PROMPTS, settings=SETTINGS, stop=stops, max_batch=6)
    for (tokens, text, _), stop, got, r in zip(ref, stops, res.texts, res.results):
        if stop:
            assert got == text[: text.find(stop[0])]
            assert r.finish_reason == "stop"
        else:
            assert got == text
    gen = BatchGenerator(model, tok, max_batch=4)
    a = gen.add(PROMPTS[3], SETTINGS[0])
    b = gen.add(PROMPTS[4], SETTINGS[1])
    got = {a: [], b: []}
    for _ in range(3):
        for uid, r in gen.step():
            got[uid] += r.tokens
    c = gen.add(PROMPTS[5], SETTINGS[5])  # arrives while a and b decode
    got[c] = []
    gen.cancel(b)
    assert [s.uid for s in gen.active] == [a]
    while gen.busy:
        for uid, r in gen.step():
            got[uid] += r.tokens
    want = {u: alone(model, tok, PROMPTS[i], SETTINGS[j])[0]
            for u, i, j in ((a, 3, 0), (b, 4, 1), (c, 5, 5))}
    assert got[a] == want[a] and got[c] == want[c]
    assert got[b] == want[b][: len(got[b])]


def test_bad_requests(pairs):
    t, h = pairs("llama2_mha")
    model, tok = eagle_mlx.load(str(t), eagle=str(h))
    for kwargs, words in [(dict(max_batch=0), "max_batch"),
                          (dict(settings=[GenerationSettings()]), "settings has 1 entries"),
                          (dict(stop=[["x"]]), "stop has 1 entries"),
                          (dict(max_tokens=[3]), "max_tokens has 1 values")]:
        with pytest.raises(EagleError, match=words):
            batch_generate(model, tok, [[5, 6], [7, 8]], **kwargs)
    with pytest.raises(EagleError, match="vocabulary"):
        batch_generate(model, tok, [[5, 6], [7, 999]])
    gen = BatchGenerator(model, tok)
    gen.add([5, 6, 7], max_tokens=4)
    with pytest.raises(EagleError, match="temp"):
        gen.add([5, 6], temp=-1.0)
    assert len(gen.waiting) == 1  # the bad request queued nothing; the good one runs
    out = []
    while gen.busy:
        out += gen.step()
    assert out[-1][1].finish_reason == "length"


def test_the_batch_size_tuning_picks_each_joining_sequence_tree(pairs, tmp_path, monkeypatch):
    """With the benchmark's per-batch-size choices saved (here: a tree of 8 alone, plain
    decoding in a batch of 2, a tree of 4 from 3 sequences on), each sequence drafts the
    choice for the batch size it joins, and writes what stream_generate writes alone with
    that choice given explicitly."""
    from eagle_mlx.tuning import write_tuning

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path))
    t, h = pairs("llama2_mha")
    model, tok = eagle_mlx.load(str(t), eagle=str(h))
    tree4 = dict(total_tokens=4, depth=2, draft_top_k=2)
    write_tuning(model.head_path, model.target.path, model.target.dtype, {
        "speculate": True, **TREE, "batch": {"2": {"speculate": False, **TREE},
                                             "3": {"speculate": True, **tree4}}})
    model, tok = eagle_mlx.load(str(t), eagle=str(h))
    assert model.tree_settings(5).asdict() == tree4 and not model.speculates_at(2)
    gen = BatchGenerator(model, tok, max_batch=3)
    uids = [gen.add(p, max_tokens=20, speculate=None) for p in PROMPTS[:3]]
    got, trees = {u: [] for u in uids}, {}
    while gen.busy:
        for uid, r in gen.step():
            got[uid] += r.tokens
        for s in gen.active:
            d = s.engine.drafter
            trees.setdefault(s.uid, None if s.plain else d.total_tokens)
    assert [trees[u] for u in uids] == [8, None, 4]
    for u, p, s in zip(uids, PROMPTS, [GenerationSettings(max_tokens=20, **TREE),
                                       GenerationSettings(max_tokens=20, speculate=False),
                                       GenerationSettings(max_tokens=20, **tree4)]):
        assert got[u] == alone(model, tok, p, s)[0]


@pytest.mark.parametrize("name", ["llama2_mha", "gemma3_swa", "qwen3_5"])
def test_prompt_caches_carry_each_conversation_to_its_next_turn(pairs, name):
    """Three conversations of two turns each, batched, each with its own PromptCache: the
    second turn (the first turn's prompt and answer, then more) is prefilled only from where
    it differs, and every turn equals stream_generate's with a PromptCache of its own."""
    from eagle_mlx import PromptCache

    t, h = pairs(name)
    model, tok = eagle_mlx.load(str(t), eagle=str(h), lookup=True)
    s = [GenerationSettings(max_tokens=14, **TREE), GenerationSettings(max_tokens=10,
                                                                       speculate=None),
         GenerationSettings(max_tokens=12, temp=0.8, seed=4, **TREE)]
    firsts = PROMPTS[1:4]
    want = []
    for p, st in zip(firsts, s):  # alone: each conversation with its own cache
        pc = PromptCache()
        a = [x for r in eagle_mlx.stream_generate(model, tok, p, settings=st, prompt_cache=pc)
             for x in r.tokens]
        second = p + a + [7, 8, 9]
        b = [x for r in eagle_mlx.stream_generate(model, tok, second, settings=st,
                                                  prompt_cache=pc) for x in r.tokens]
        want.append((a, b, pc.reused))
    caches = [PromptCache() for _ in firsts]
    gen = BatchGenerator(model, tok, max_batch=3)
    uids = [gen.add(p, st, prompt_cache=c) for p, st, c in zip(firsts, s, caches)]
    got = {u: [] for u in uids}
    while gen.busy:
        for uid, r in gen.step():
            got[uid] += r.tokens
    seconds = [p + got[u] + [7, 8, 9] for p, u in zip(firsts, uids)]
    uids2 = [gen.add(q, st, prompt_cache=c) for q, st, c in zip(seconds, s, caches)]
    got2 = {u: [] for u in uids2}
    while gen.busy:
        for uid, r in gen.step():
            got2[uid] += r.tokens
    for (a, b, reused), u, u2, c, p in zip(want, uids, uids2, caches, firsts):
        assert got[u] == a and got2[u2] == b
        assert c.reused == reused > len(p)  # the first turn's prompt and (most of) its answer


def test_sequences_done_with_their_first_token(pairs):
    """max_tokens 1 (the prefill's token only): each leaves at its join, as alone."""
    t, h = pairs("llama2_mha")
    model, tok = eagle_mlx.load(str(t), eagle=str(h))
    s = [GenerationSettings(max_tokens=1), GenerationSettings(max_tokens=1, temp=0.9, seed=3),
         GenerationSettings(max_tokens=5)]
    check_batch_equals_alone(model, tok, max_batch=2, prompts=PROMPTS[:3], settings=s)


def test_a_batch_verify_curve_is_measured_once_and_cached(pairs, tmp_path, monkeypatch):
    """The batch's verify pass is timed at its size and width (every row a chain of n nodes)
    and kept in the cost cache by batch size: a larger width never costs less, the curve
    read back is the one measured, and a row's costs are its share of it."""
    from eagle_mlx import costs as costs_mod
    from eagle_mlx.decoding.adaptive import batch_size_measured

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path))
    t, h = pairs("llama2_mha")
    model, _ = eagle_mlx.load(str(t), eagle=str(h))
    said = []
    row = costs_mod.batch_costs(model, 4, say=said.append)
    assert any("batches of 4" in m for m in said)
    curve = dict(row.verify_points)
    assert curve[1] > 0 and list(curve) == sorted(curve) and len(curve) >= 3
    assert all(a <= b for a, b in zip(curve.values(), list(curve.values())[1:]))
    said.clear()
    again = costs_mod.batch_costs(model, 4, say=said.append)  # (read back, not measured)
    assert not said and dict(again.verify_points) == curve
    # refresh (`benchmark --measure-under-load`): measured again, and what it measured kept
    kept = costs_mod.costs_path(model, batch=4)
    measured = costs_mod._read_batch_curve(kept)
    monkeypatch.setattr(costs_mod, "measure_batch", lambda m, b: {n: 2 * v for n, v in
                                                                   measured.items()})
    costs_mod.batch_costs(model, 4, say=said.append, refresh=True)
    assert any("batches of 4" in m for m in said)
    assert costs_mod._read_batch_curve(kept) == {n: 2 * v for n, v in measured.items()}
    assert row.draft_costs == model.costs().draft_costs
    assert [batch_size_measured(b) for b in (1, 2, 3, 4, 7, 8)] == [1, 2, 2, 4, 4, 8]


def test_greedy_rows_choose_with_the_batch_costs(pairs, monkeypatch, tmp_path):
    """Where a sequence's own costs make the head's trees pay and the batch's (each row's
    share of a pass as wide as its tree) make them dear, greedy rows decode plainly in every
    cycle of a batch of 2 or more while alone they speculate, with alone's tokens; a
    sampled row keeps a sequence's costs, so its choices and draws are its run alone."""
    from eagle_mlx.costs import head_options
    from eagle_mlx.decoding.adaptive import Costs

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path))
    t, h = pairs("llama2_mha")
    model, tok = eagle_mlx.load(str(t), eagle=str(h), lookup=True)
    cheap = {1: 1.0, 2: 1.0, 4: 1.01, 8: 1.02, 16: 1.04}
    draft = {o.label(): 1e-4 for o in head_options(model)}
    model.measured = Costs(cheap, draft)
    model.measured_batch[2] = model.measured.in_batch({n: 2.0 * n for n in cheap}, 2)
    prompts = PROMPTS[3:6]
    settings = [GenerationSettings(max_tokens=24), GenerationSettings(max_tokens=20),
                GenerationSettings(max_tokens=20, temp=0.8, seed=4)]
    ref = [alone(model, tok, p, s) for p, s in zip(prompts, settings)]
    assert all(set(last.passes) - {"plain"} for _, _, last in ref)  # (alone: speculation)
    gen = BatchGenerator(model, tok, max_batch=3)
    uids = [gen.add(p, settings=s) for p, s in zip(prompts, settings)]
    cycle, in_batch = gen._cycle, []

    def recorded(**kw):
        rows = list(gen.active)
        out = cycle(**kw)
        in_batch.extend(s.engine.drafter.chosen(s.state.drafter) for s in rows
                        if len(rows) >= 2 and s.uid != uids[2])
        return out

    gen._cycle = recorded
    got, last = {u: [] for u in uids}, {}
    while gen.busy:
        for uid, r in gen.step():
            got[uid] += r.tokens
            last[uid] = r
    assert len(in_batch) > 20 and set(in_batch) == {"plain"}
    for (tokens, _, alone_last), u in zip(ref, uids):
        assert got[u] == tokens
    assert last[uids[2]].passes == ref[2][2].passes


def test_a_batchs_costs_that_lie_are_corrected_by_its_own_cycles(pairs, monkeypatch,
                                                                  tmp_path):
    """A batch's costs that price a pass as wide as a tree like a plain one (as a loaded
    machine's measurement may) make greedy rows speculate; the batch's cycles, timed whole
    (a clock here that charges a cycle by its width), teach the rows that they do not pay,
    and the rows turn to plain decoding within the generation, with alone's tokens. Where
    the clock charges what the costs say, the rows keep speculating: the change comes from
    the timing."""
    import eagle_mlx.decoding.batch as batch_mod
    from eagle_mlx.costs import head_options
    from eagle_mlx.decoding.adaptive import Costs

    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path))
    t, h = pairs("llama2_mha")
    model, tok = eagle_mlx.load(str(t), eagle=str(h), lookup=True)
    flat = {1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0}
    model.measured = Costs({n: v / 2 for n, v in flat.items()},
                           {o.label(): 1e-4 for o in head_options(model)})
    model.measured_batch[2] = model.measured.in_batch(flat, 2)
    prompts = PROMPTS[3:5]
    settings = [GenerationSettings(max_tokens=48), GenerationSettings(max_tokens=48)]
    ref = [alone(model, tok, p, s) for p, s in zip(prompts, settings)]

    def run(per_node_width):
        width = [1]

        class Clock:  # (two readings a cycle: its start and its end)
            now, ticks = 0.0, 0

            def perf_counter(self):
                self.ticks += 1
                if self.ticks % 2 == 0:
                    self.now += 2.0 * (width[0] if per_node_width else 1)
                return self.now

        monkeypatch.setattr(batch_mod, "time", Clock())
        gen = BatchGenerator(model, tok, max_batch=2)
        uids = [gen.add(p, settings=s) for p, s in zip(prompts, settings)]
        verify, cycles = gen._verify, []

        def verify_recorded(rows, trees, speculative):
            width[0] = max(int(x.tokens.shape[0]) for x in trees)
            out = verify(rows, trees, speculative)
            if len(rows) == 2:
                cycles.append(width[0])
            return out

        gen._verify = verify_recorded
        got = {u: [] for u in uids}
        while gen.busy:
            for uid, r in gen.step():
                got[uid] += r.tokens
        for (tokens, _, _), u in zip(ref, uids):
            assert got[u] == tokens
        return cycles

    honest = run(per_node_width=False)
    half = len(honest) // 2
    assert sum(w > 1 for w in honest[half:]) >= 0.5 * len(honest[half:]), honest
    timed = run(per_node_width=True)
    half = len(timed) // 2
    assert any(w > 1 for w in timed[:half]), timed  # (the costs said speculation paid)
    assert sum(w > 1 for w in timed[half:]) <= 0.1 * len(timed[half:]), timed
