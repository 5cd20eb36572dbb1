"""Prompt lookup: the matcher against a brute-force search, and lookup drafts (alone and
merged into a head's tree) lossless against plain decoding and transformers."""

import mlx.core as mx
import numpy as np
import pytest

import eagle_mlx
from eagle_mlx.decoding.lookup import LookupDrafter, LookupSettings, MergedDrafter, SuffixAutomaton
from tiny import make_eagle_head, make_hf_model


def brute_force(seq, min_match, max_draft):
    """Every (first token, match length, copied tokens) a lookup may propose: for each token
    that follows an earlier occurrence of a suffix of `seq` of length >= min_match, the
    longest such suffix and what followed its first occurrence with that token."""
    n = len(seq)
    found = {}
    for m in range(n - 1, min_match - 1, -1):
        suffix = seq[n - m:]
        for j in range(m - 1, n - 1):  # an occurrence ending at j < n - 1
            if seq[j - m + 1: j + 1] == suffix:
                c = seq[j + 1]
                if c not in found:  # the longest match first; its first occurrence
                    found[c] = (m, seq[j + 1: j + 1 + max_draft])
                elif found[c][0] == m:
                    pass  # a later occurrence of the same match: the first one copies
    return found


@pytest.mark.parametrize("alphabet", [2, 3, 6])
def test_the_matcher_proposes_exactly_what_a_brute_force_search_finds(alphabet):
    rng = np.random.default_rng(alphabet)
    for trial in range(30):
        seq = rng.integers(0, alphabet, int(rng.integers(1, 70))).tolist()
        sam = SuffixAutomaton()
        for i, t in enumerate(seq):  # checked after every token: built online
            sam.append(t)
            prefix = seq[: i + 1]
            for min_match, max_draft in ((1, 5), (2, 3), (3, 8)):
                expected = brute_force(prefix, min_match, max_draft)
                got = sam.continuations(min_match, max_draft, branches=1000)
                assert {c[0]: (m, c) for m, c in got} == expected, (prefix, min_match)
                lengths = [m for m, _ in got]
                assert lengths == sorted(lengths, reverse=True)  # longer matches first
                capped = sam.continuations(min_match, max_draft, branches=2)
                assert capped == got[:2]


def test_truncating_rebuilds_the_same_automaton():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 4, 50).tolist()
    d = LookupDrafter()
    state = d.new_state()
    d.catch_up(state, mx.array(seq))
    d.truncate(state, 30)
    fresh = SuffixAutomaton(seq[:30])
    assert d.offset(state) == 30
    assert state.automaton.continuations(1, 6, 10) == fresh.continuations(1, 6, 10)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup")
    t = make_hf_model(root / "target", "llama", seed=41, vocab_size=64, scale=4.0,
                      num_hidden_layers=4, num_key_value_heads=2)
    return t, make_eagle_head(root / "head", t, "eagle1", seed=2)


def repeating_prompts(rng, n):
    """Prompts that repeat pieces of themselves (what lookup drafts from)."""
    out = []
    for _ in range(n):
        piece = rng.integers(3, 64, int(rng.integers(4, 10))).tolist()
        filler = rng.integers(3, 64, int(rng.integers(2, 6))).tolist()
        out.append(piece + filler + piece + filler[:1] + piece[:3])
    return out


TREES = [dict(total_tokens=8, depth=2, draft_top_k=2), dict(total_tokens=20, depth=5, draft_top_k=3),
         dict(total_tokens=2, depth=1, draft_top_k=1)]
LOOKUPS = [LookupSettings(), LookupSettings(min_match=1, max_draft=3, branches=1),
           LookupSettings(min_match=3, max_draft=12, branches=4)]


def test_greedy_with_lookup_alone_and_merged_equals_plain(pair):
    target_dir, head_dir = pair
    rng = np.random.default_rng(5)
    prompts = repeating_prompts(rng, 3)
    plain_model, tok = eagle_mlx.load(str(target_dir))
    tok.eos_token_ids = set()
    expected = [eagle_mlx.generate(plain_model, tok, p, max_tokens=24) for p in prompts]
    drafted = 0
    for settings in LOOKUPS:
        alone, _ = eagle_mlx.load(str(target_dir), lookup=settings)
        merged, _ = eagle_mlx.load(str(target_dir), eagle=str(head_dir), lookup=settings)
        for p, want in zip(prompts, expected):
            rs = list(eagle_mlx.stream_generate(alone, tok, p, max_tokens=24))
            assert "".join(r.text for r in rs) == want, settings
            drafted += sum(r.accept_length or 0 for r in rs)
            for tree in TREES:
                text = eagle_mlx.generate(merged, tok, p, max_tokens=24, **tree)
                assert text == want, (settings, tree)
    assert drafted > 0  # lookup drafts were accepted, not just proposed


def test_merged_trees_stay_within_the_budget_and_hold_both_sources(pair):
    """The merged tree has at most total_tokens nodes, no duplicate siblings, and holds the
    lookup branch where the head's tree lacks it."""
    from eagle_mlx.decoding.eagle import EagleDrafter

    target_dir, head_dir = pair
    model, _ = eagle_mlx.load(str(target_dir), eagle=str(head_dir), lookup=True)
    head_drafter = EagleDrafter(model.head, model.target, 10, 3, 3)
    merged = MergedDrafter(head_drafter, LookupDrafter(model.lookup), 10)
    state = merged.new_state()
    seq = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    feats = mx.zeros((len(seq) - 1, model.head.feature_size))
    tree = merged.propose(state, feats, mx.array(seq[1:]), mx.array(seq[-1]))
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    assert len(tokens) <= 10
    children = [(parents[i], tokens[i]) for i in range(1, len(tokens))]
    assert len(children) == len(set(children))
    paths = {0: ()}
    for i in range(1, len(tokens)):
        paths[i] = paths[parents[i]] + (tokens[i],)
    assert (8,) in paths.values()  # lookup: "5 6 7" was followed by 8


def chi_square_merged(target_dir, head_dir, prompt, runs=1500):
    """p-value of the first three sampled tokens with lookup merged into the head's tree
    (temperature 0.7, top-k 5, top-p 0.9) against transformers' logits enumerated."""
    import test_windows
    from eagle_mlx.decoding.eagle import EagleDrafter
    from eagle_mlx.decoding.steps import speculative_steps

    def steps(target, head, prompt, sampling, total_tokens, depth, draft_top_k):
        drafter = MergedDrafter(EagleDrafter(head, target, total_tokens, depth, draft_top_k),
                                LookupDrafter(LookupSettings(min_match=1)), total_tokens)
        return speculative_steps(target, drafter, prompt, sampling)

    return test_windows.chi_square_against_transformers(target_dir, head_dir, prompt, runs,
                                                        steps=steps)


@pytest.mark.long
def test_sampling_with_lookup_merged_is_lossless(pair):
    p = chi_square_merged(*pair, [9, 10, 11, 9, 10, 11, 9, 10], runs=400)
    assert p > 1e-3, p


@pytest.fixture(scope="module")
def demo():
    from eagle_mlx.demo import demo_paths

    try:
        target, head = demo_paths()
    except eagle_mlx.EagleError as e:
        pytest.skip(f"the demo pair is not installed ({e})")
    return target, head


REPEAT = ("Repeat the following text exactly, word for word:\n\n"
          "The committee met on Tuesday to review the budget and agreed to postpone the "
          "vote until the next meeting.")


def test_lookup_alone_copies_a_repeated_text_at_tau_3_on_the_demo_pair(demo):
    """Asked to repeat a text, the demo target's output is the context: lookup alone
    reaches tau >= 3 with exactly plain decoding's tokens; merged with the demo head too."""
    from eagle_mlx.cli import chat_prompt

    from dataclasses import replace

    target, head = demo
    # (copies of 4 at most: a pass over k tokens costs about k plain passes on this CPU)
    merged, tok = eagle_mlx.load(target, eagle=head, lookup=LookupSettings(max_draft=4))
    alone = replace(merged, head=None, head_path=None, tuning=None)  # the same target
    ids = chat_prompt(tok, [{"role": "user", "content": REPEAT}])
    plain = [t for r in eagle_mlx.stream_generate(alone, tok, ids, max_tokens=16,
                                                  speculate=False) for t in r.tokens]
    rs = list(eagle_mlx.stream_generate(alone, tok, ids, max_tokens=16, speculate=True))
    assert [t for r in rs for t in r.tokens] == plain
    assert rs[-1].mean_accept_length >= 3, rs[-1].mean_accept_length
    both = [t for r in eagle_mlx.stream_generate(merged, tok, ids, max_tokens=16,
                                                 total_tokens=6, depth=3, draft_top_k=2)
            for t in r.tokens]
    assert both == plain


def test_bad_lookup_settings_are_refused():
    with pytest.raises(eagle_mlx.EagleError) as e:
        LookupSettings(min_match=0).check()
    assert "min_match" in str(e.value)


def test_the_tools_take_lookup_and_refuse_its_bad_values(pair):
    """generate --lookup (no head) prints what plain decoding prints; the settings without
    --lookup, or out of range, are refused in one sentence (exit 2)."""
    from test_cli import chat_ids, one_sentence, tool

    target, _ = pair
    proc = tool("generate", "--model", target, "--lookup", "--prompt", "t5 t9 t5 t9 t5",
               "--max-tokens", 20, "--verbose", "--speculate", "always")
    assert proc.returncode == 0, proc.stderr
    assert "prompt lookup alone" in proc.stdout + proc.stderr
    model, tok = eagle_mlx.load(str(target))
    ids = chat_ids(tok, [{"role": "user", "content": "t5 t9 t5 t9 t5"}])
    assert proc.stdout.split("==========\n")[1] == eagle_mlx.generate(model, tok, ids,
                                                                      max_tokens=20) + "\n"
    one_sentence(tool("generate", "--model", target, "--lookup-max-draft", "3", "--prompt", "t5"),
                 2, "--lookup-max-draft", "needs --lookup")
    one_sentence(tool("generate", "--model", target, "--lookup", "--lookup-min-match", "0",
                     "--prompt", "t5"), 2, "--lookup-min-match")
