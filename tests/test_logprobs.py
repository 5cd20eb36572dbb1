"""Log-probabilities of the emitted tokens (`logprobs`): each token's and its top
alternatives, against mlx-lm's own plain decoding (`generate_step` returns the target's
log-probabilities of every step) for the same model and tokens — greedy with and without
speculation, single and batched — and, when sampling, against the sampling distribution
written independently in NumPy."""

import mlx.core as mx
import numpy as np
import pytest

import eagle_mlx
from eagle_mlx import GenerationSettings
from tiny import (ORACLE, make_eagle_head, numpy_sampling_distribution, oracle_reference,
                  requires_oracle, tiny_llama)

PROMPTS = [[1, 5, 9, 13, 7], [1, 22, 3], [1, 40, 41, 42, 43, 44, 45]]
TOP = 5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    target = tiny_llama(root / "target", num_hidden_layers=8)
    return target, {"eagle1": make_eagle_head(root / "h1", target, "eagle1", seed=1),
                    "eagle3": make_eagle_head(root / "h3", target, "eagle3", seed=2,
                                              draft_vocab_size=40)}


def mlx_lm_logprobs(target_dir, prompt, tokens) -> np.ndarray:
    """mlx-lm's log-probabilities [len(tokens), V] of each step of plain decoding forced
    through `tokens` (its sampler hands back the given tokens in order)."""
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm.load(str(target_dir))
    given = iter(list(tokens) + [tokens[-1]])  # (generate_step samples one step ahead)
    out = []
    for _, lp in generate_step(mx.array(prompt), model, max_tokens=len(tokens),
                               sampler=lambda _: mx.array([next(given)])):
        out.append(np.array(lp.astype(mx.float32)))
    return np.stack(out)


def assert_match(scores, tokens, reference, top):
    """Each entry's token, log-probability and top alternatives against the reference rows."""
    assert [s.token for s in scores] == list(tokens)
    for s, row in zip(scores, reference):
        assert abs(s.logprob - row[s.token]) < 1e-4, (s.logprob, row[s.token])
        want = np.argsort(-row, kind="stable")[:top]
        assert [t for t, _ in s.top] == want.tolist()
        np.testing.assert_allclose([v for _, v in s.top], row[want], atol=1e-4)


def check_greedy(model, tok, target_dir, prompt, n, drafts: bool):
    tok.eos_token_ids = set()  # (the whole length is compared)
    rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=n, logprobs=TOP,
                                        speculate=drafts))  # (drafting every pass)
    tokens = [t for r in rs for t in r.tokens]
    scores = [s for r in rs for s in r.logprobs]
    # speculation made several tokens in one target forward (their rows of one verify pass)
    assert drafts == any(len(r.tokens) > 1 for r in rs), [len(r.tokens) for r in rs]
    assert_match(scores, tokens, mlx_lm_logprobs(target_dir, prompt, tokens), TOP)
    # each token's text is the piece of the output text it completed
    assert "".join(s.text for s in scores) == "".join(r.text for r in rs)


@pytest.mark.parametrize("lookup", [False, True])
def test_greedy_logprobs_equal_mlx_lm(pair, lookup):
    target, _ = pair
    model, tok = eagle_mlx.load(str(target), lookup=lookup)
    check_greedy(model, tok, target, PROMPTS[2], 24, drafts=lookup)


@requires_oracle
@pytest.mark.parametrize("head", ["eagle1_head", "eagle3_head"])
def test_greedy_logprobs_of_accepted_drafts_equal_mlx_lm(head):
    """The official tiny pairs, whose heads get many drafts accepted."""
    target = ORACLE / "llama" / "target"
    model, tok = eagle_mlx.load(str(target), eagle=str(ORACLE / "llama" / head))
    prompt = oracle_reference()["llama"]["eagle2_github"][0]["runs"][0]["prompt"]
    check_greedy(model, tok, target, prompt, 32, drafts=True)


def test_batched_logprobs_equal_mlx_lm(pair):
    """Rows of one batch (plain and speculative side by side) report what each would alone."""
    target, heads = pair
    model, tok = eagle_mlx.load(str(target), eagle=heads["eagle1"], lookup=True)
    tok.eos_token_ids = set()
    settings = [GenerationSettings(max_tokens=24, logprobs=TOP, speculate=i != 1)
                for i in range(len(PROMPTS))]
    out = eagle_mlx.batch_generate(model, tok, PROMPTS, settings=settings)
    assert any(a > 0 for a in out.results[2].accept_lengths)  # drafts were accepted
    for prompt, r in zip(PROMPTS, out.results):
        assert_match(r.logprobs, r.tokens, mlx_lm_logprobs(target, prompt, r.tokens), TOP)


@pytest.mark.parametrize("speculate", [False, True])
def test_sampled_tokens_report_the_distribution_they_were_drawn_from(pair, speculate):
    """At temperature > 0 a token's log-probability is under the distribution it was drawn
    from: top-p, min-p and top-k over the target's, then the temperature; the alternatives
    are the likeliest tokens left by the filters (so at most top_k of them)."""
    target, heads = pair
    model, tok = eagle_mlx.load(str(target), eagle=heads["eagle1"], lookup=True)
    tok.eos_token_ids = set()
    temp, top_p, min_p, top_k = 0.8, 0.95, 0.01, 4
    rs = list(eagle_mlx.stream_generate(model, tok, PROMPTS[0], max_tokens=20, temp=temp,
                                        top_p=top_p, min_p=min_p, top_k=top_k, seed=3,
                                        speculate=speculate, logprobs=6))
    tokens = [t for r in rs for t in r.tokens]
    scores = [s for r in rs for s in r.logprobs]
    raw = mlx_lm_logprobs(target, PROMPTS[0], tokens)
    for s, row in zip(scores, raw):
        p = numpy_sampling_distribution(row, temp, top_p, min_p, top_k)
        assert p[s.token] > 0 and abs(s.logprob - np.log(p[s.token])) < 1e-4
        kept = np.flatnonzero(p > 0)
        want = kept[np.argsort(-p[kept], kind="stable")][:6]
        assert len(s.top) == min(6, len(kept)) <= top_k
        assert sorted(t for t, _ in s.top) == sorted(want.tolist())
        np.testing.assert_allclose([v for _, v in s.top], np.log(p[[t for t, _ in s.top]]),
                                   atol=1e-4)


def test_logprobs_off_by_default_and_checked(pair):
    target, heads = pair
    model, tok = eagle_mlx.load(str(target), eagle=heads["eagle1"])
    assert all(r.logprobs is None for r in eagle_mlx.stream_generate(model, tok, [1, 5],
                                                                      max_tokens=4))
    for bad in (-1, 21, 2.5, True, "5"):
        with pytest.raises(eagle_mlx.EagleError, match="logprobs must be None"):
            list(eagle_mlx.stream_generate(model, tok, [1, 5], max_tokens=4, logprobs=bad))


def test_generate_and_chat_write_logprobs_as_the_completions_api_shapes_them(pair):
    """`generate --logprobs 3` (speculating every pass) and `chat --logprobs 2` write, after
    the text, one JSON object per answer as /v1/completions shapes `logprobs`: each token
    decoded alone, its offset where its piece of the printed text begins, each
    log-probability and top alternative is mlx-lm's for that step; a bad count is one
    sentence naming the flag."""
    import json

    from eagle_mlx.cli import chat_prompt
    from tiny import tool

    target, heads = pair
    model, tok = eagle_mlx.load(str(target), eagle=str(heads["eagle1"]))
    messages = [{"role": "user", "content": "t5 t9 t11"}]
    ids = chat_prompt(tok, messages)
    runs = [("generate", ["--prompt", "t5 t9 t11", "--logprobs", 3, "--speculate", "always"], 3),
            ("chat", ["--logprobs", 2], 2)]
    for name, flags, top in runs:
        proc = tool(name, "--model", target, "--eagle", heads["eagle1"], "--max-tokens", 12,
                    *flags, stdin="t5 t9 t11\n" if name == "chat" else None)
        assert proc.returncode == 0, proc.stderr
        lines = [x for x in proc.stderr.splitlines() if x.startswith("logprobs: ")]
        assert len(lines) == 1, proc.stderr
        shaped = json.loads(lines[0][len("logprobs: "):])
        text = (proc.stdout.split("==========\n")[1] if name == "generate"
                else proc.stdout).splitlines()[0]
        tokens = [t for r in eagle_mlx.stream_generate(model, tok, ids, max_tokens=12)
                  for t in r.tokens]
        reference = mlx_lm_logprobs(target, ids, tokens)
        assert shaped["tokens"] == [tok.decode([t]) for t in tokens]
        ends = shaped["text_offset"][1:] + [len(text)]  # (each token's piece of the text)
        assert shaped["text_offset"][0] == 0
        assert [text[a:b].strip() for a, b in zip(shaped["text_offset"], ends)] == \
            [t.strip() for t in shaped["tokens"]]
        np.testing.assert_allclose(shaped["token_logprobs"],
                                   [row[t] for row, t in zip(reference, tokens)], atol=1e-4)
        for alternatives, row in zip(shaped["top_logprobs"], reference):
            want = np.argsort(-row, kind="stable")[:top]
            assert list(alternatives) == [tok.decode([int(t)]) for t in want]
            np.testing.assert_allclose(list(alternatives.values()), row[want], atol=1e-4)
    proc = tool("generate", "--model", target, "--prompt", "t5", "--logprobs", -1)
    assert proc.returncode == 2 and "--logprobs" in proc.stderr and \
        "Traceback" not in proc.stderr, proc.stderr
