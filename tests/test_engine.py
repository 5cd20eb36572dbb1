"""The speculative loop: official parity, losslessness (greedy and sampling), edge cases."""

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest

import eagle_mlx
from eagle_mlx import EagleError
from eagle_mlx.decoding import engine
from eagle_mlx.decoding.steps import SamplingParams, eagle_steps
from eagle_mlx.decoding.tree import MC_SIM_7B_63, StaticTree, Tree, retrieve_indices
from tiny import (ORACLE, make_eagle_head, make_hf_model, numpy_sampling_distribution,
                  oracle_reference, requires_oracle)


def _oracle_cases():
    if not (ORACLE / "reference.json").is_file():
        return [pytest.param(None, marks=requires_oracle)]
    ref = oracle_reference()
    cases = []
    for family in ("llama", "mixtral"):
        for group in ("eagle1_pip", "eagle2_github", "eagle3_github"):
            if group not in ref[family]:
                continue
            settings = ref[family][group]
            for s, setting in enumerate([settings] if group == "eagle1_pip" else settings):
                for i in range(len(setting["runs"])):
                    cases.append(pytest.param((family, group, s, i), id=f"{family}-{group}-{s}-{i}"))
    return cases


_loaded = {}


def oracle_model(family, head):
    key = (family, head)
    if key not in _loaded:
        _loaded[key] = eagle_mlx.load(str(ORACLE / family / "target"), eagle=str(ORACLE / family / head))
    return _loaded[key]


@requires_oracle
@pytest.mark.parametrize("case", _oracle_cases())
def test_official_parity(case):
    family, group, s, i = case
    ref = oracle_reference()[family][group]
    setting = ref if group == "eagle1_pip" else ref[s]
    run = setting["runs"][i]
    head = "eagle3_head" if group == "eagle3_github" else "eagle1_head"
    model, tokenizer = oracle_model(family, head)
    if group == "eagle1_pip":
        kw = dict(tree_choices=setting["tree_choices"], draft_top_k=setting["draft_top_k"])
    else:
        st = setting["settings"]
        kw = dict(total_tokens=st["total_token"], depth=st["depth"], draft_top_k=st["top_k"])
    n = len(run["output_tokens"])
    responses = list(eagle_mlx.stream_generate(model, tokenizer, run["prompt"], max_tokens=n, **kw))
    out = [t for r in responses for t in r.tokens]
    # the official loop overshoots max_new_tokens; we stop exactly
    assert out == run["output_tokens"][: len(out)] and len(out) == n
    accepted = [r.accept_length for r in responses if r.accept_length is not None]
    assert accepted == run["accept_lengths"][: len(accepted)]
    assert responses[0].accept_length is None and responses[-1].finish_reason == "length"

    steps = eagle_steps(model.target, model.head, run["prompt"], SamplingParams(),
                        kw.get("total_tokens", 0), kw.get("depth", 0), kw["draft_top_k"],
                        kw.get("tree_choices"), trace=True)
    next(steps)
    for expected in run["steps"]:
        tree = next(steps).tree
        if group == "eagle1_pip":
            assert tree["tokens"] == expected["tree_tokens"]
        else:
            assert tree["tokens"] == expected["draft_tokens"]
            assert tree["parents"][1:] == expected["tree_parents"][1:]
            assert tree["depth"] == expected["tree_position_ids"]
            assert retrieve_indices(tree["parents"]) == expected["retrieve_indices"]


@requires_oracle
@pytest.mark.parametrize("group", ["eagle1_pip", "eagle2_github", "eagle3_github"])
def test_official_parity_uncompiled(group, monkeypatch):
    """The same operations run one kernel each (EAGLE_MLX_COMPILE=0): the official output
    still, tree for tree (the first run of each kind; the compiled path is checked above)."""
    from eagle_mlx.decoding import compiled

    monkeypatch.setattr(compiled, "ENABLED", False)
    test_official_parity(("llama", group, 0, 0))


@requires_oracle
def test_static_tree_buffers_match_the_official_ones():
    ref = oracle_reference()["llama"]["eagle1_pip"]
    assert MC_SIM_7B_63 == ref["tree_choices"]
    tree = StaticTree(ref["tree_choices"], ref["draft_top_k"])
    verify = ref["tree_buffers"]["verify"]
    assert np.array(tree.anc).astype(int).tolist() == verify["tree_attn_mask"]
    assert np.array(tree.depth).tolist() == verify["tree_position_ids"]
    assert retrieve_indices(np.array(tree.parents).tolist(), "sorted") == verify["retrieve_indices"]
    draft = ref["tree_buffers"]["draft"]
    assert [np.array(m).astype(int).tolist() for m in tree.step_masks] == draft["attn_mask"][: len(tree.step_masks)]


# ------------------------------------------------------------ greedy is exactly plain greedy

@pytest.fixture(scope="module")
def random_pairs(tmp_path_factory):
    """Random targets with random heads: few drafts are accepted, so every branch of the
    acceptance code (reject at root, partial paths, bonus tokens) runs."""
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("pairs")
    pairs = {}
    llama = make_hf_model(root / "llama", "llama", seed=5, num_hidden_layers=8,
                          num_key_value_heads=2, vocab_size=64, scale=4.0)
    mixtral = make_hf_model(root / "mixtral", "mixtral", seed=6, num_hidden_layers=2,
                            num_key_value_heads=2, vocab_size=64, intermediate_size=96, scale=4.0)
    q4 = root / "llama-q4"
    convert(str(llama), mlx_path=str(q4), quantize=True, q_bits=4, q_group_size=32)
    pairs["llama-eagle1"] = (llama, make_eagle_head(root / "h1", llama, "eagle1", seed=1))
    pairs["llama-eagle3"] = (llama, make_eagle_head(root / "h3", llama, "eagle3", seed=2,
                                                    draft_vocab_size=40))
    pairs["mixtral-eagle1"] = (mixtral, make_eagle_head(root / "hm", mixtral, "eagle1", seed=3))
    pairs["llama4bit-eagle1"] = (q4, pairs["llama-eagle1"][1])
    qwen2 = make_hf_model(root / "qwen2", "qwen2", seed=7, num_hidden_layers=3,
                          num_key_value_heads=2, vocab_size=64, scale=4.0)
    qwen3 = make_hf_model(root / "qwen3", "qwen3", seed=8, num_hidden_layers=8,
                          num_key_value_heads=2, vocab_size=64, scale=4.0, tie_word_embeddings=True)
    qwen3_moe = make_hf_model(root / "qwen3_moe", "qwen3_moe", seed=9, num_hidden_layers=8,
                              num_key_value_heads=2, vocab_size=64, scale=4.0)
    pairs["qwen2-eagle1-qkv-bias"] = (qwen2, make_eagle_head(root / "hq2", qwen2, "eagle1", seed=4,
                                                             qkv_bias=True))
    pairs["qwen3-eagle3-narrow"] = (qwen3, make_eagle_head(root / "hq3", qwen3, "eagle3", seed=5,
                                                           draft_vocab_size=40, hidden_size=48))
    pairs["qwen3moe-eagle3-narrow"] = (qwen3_moe, make_eagle_head(root / "hqm", qwen3_moe, "eagle3",
                                                                  seed=6, draft_vocab_size=40,
                                                                  hidden_size=48))
    return pairs


def plain_greedy(model_dir, prompt, n, eos=True):
    model, tok = eagle_mlx.load(str(model_dir))
    if not eos:
        tok.eos_token_ids = set()
    return [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=n) for t in r.tokens]


TREES = [dict(total_tokens=8, depth=2, draft_top_k=2), dict(total_tokens=40, depth=6, draft_top_k=5),
         dict(total_tokens=80, depth=8, draft_top_k=8), dict(total_tokens=2, depth=1, draft_top_k=1),
         dict(tree_choices=MC_SIM_7B_63, draft_top_k=4)]


@pytest.mark.parametrize("pair", ["llama-eagle1", "llama-eagle3", "mixtral-eagle1", "llama4bit-eagle1",
                                  "qwen2-eagle1-qkv-bias", "qwen3-eagle3-narrow",
                                  "qwen3moe-eagle3-narrow"])
def test_greedy_output_equals_plain_decoding(random_pairs, pair):
    target_dir, head_dir = random_pairs[pair]
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(head_dir))
    rng = np.random.default_rng(7)
    for trial, tree in enumerate(TREES):
        prompt = rng.integers(3, 64, int(rng.integers(1, 12))).tolist()
        ref = plain_greedy(target_dir, prompt, 40)
        rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=40, **tree))
        assert [t for r in rs for t in r.tokens] == ref, (pair, tree)


@requires_oracle
@pytest.mark.parametrize("tree", TREES[:3], ids=["small", "wide", "deep"])
def test_greedy_equals_plain_on_the_oracle_pair_with_many_prompts(tree):
    model, tok = oracle_model("llama", "eagle1_head")
    rng = np.random.default_rng(11)
    taus = []
    for _ in range(4):
        prompt = [1] + rng.integers(3, 1024, int(rng.integers(2, 20))).tolist()
        ref = plain_greedy(ORACLE / "llama" / "target", prompt, 48)
        rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=48, **tree))
        assert [t for r in rs for t in r.tokens] == ref
        taus.append(rs[-1].mean_accept_length)
    assert np.mean(taus) > 1.5  # the trained head really is accepted


# ------------------------------------------------------------ sampling preserves the target

def _wrong_residual(tree, logprobs):
    """A broken rule for the negative control: the next token after a rejection is drawn
    from p itself instead of p with the rejected children zeroed."""
    best, _ = eagle_mlx.decoding.accept.accept_sampling(tree, logprobs)
    return best, mx.random.categorical(logprobs[best])


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def small_vocab_pair(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("small")
    target = make_hf_model(root / "t", request.param, seed=3, vocab_size=8, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=2, scale=1.0,
                           **({"head_dim": 16} if request.param == "qwen3" else {}))
    head = make_eagle_head(root / "h", target, "eagle1", seed=4)
    return target, head


def _sample_counts(model, prompt, runs, n_tokens, sampling, tree):
    counts = {}
    for seed in range(runs):
        mx.random.seed(seed)
        out = []
        for step in eagle_steps(model.target, model.head, prompt, sampling, **tree):
            out += step.tokens
            if len(out) >= n_tokens:
                break
        key = tuple(out[:n_tokens])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _exact_distribution(model, prompt, n_tokens, sampling):
    """P(x1..xn) enumerated with mlx-lm's own forward and the same temperature/top-k/top-p."""
    from eagle_mlx.decoding.accept import process_logits

    V = model.target.vocab_size
    seqs = list(itertools.product(range(V), repeat=n_tokens - 1))
    batch = mx.array([list(prompt) + list(s) for s in seqs])
    logits = model.target.model(batch)[:, len(prompt) - 1:]           # [S, n, V]
    logp = np.array(process_logits(logits, sampling.temp, sampling.top_p, sampling.top_k))
    dist = {}
    for i, s in enumerate(seqs):
        lp = sum(logp[i, j, s[j]] for j in range(n_tokens - 1))
        for last in range(V):
            dist[s + (last,)] = float(np.exp(lp + logp[i, n_tokens - 1, last]))
    return dist


def _chi_square_p(counts, dist, runs):
    from scipy.stats import chi2

    cells, other_obs, other_exp = [], 0, 0.0
    for key, p in dist.items():
        if p * runs >= 5:
            cells.append((counts.get(key, 0), p * runs))
        else:
            other_obs += counts.get(key, 0)
            other_exp += p * runs
    cells.append((other_obs, other_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return float(chi2.sf(stat, len(cells) - 1)), stat


SAMPLING_CASES = [(SamplingParams(temp=1.0), "temp1"),
                  (SamplingParams(temp=0.7, top_k=5, top_p=0.9), "temp0.7-topk5-topp0.9")]

# a fixed tree over a vocabulary of 6: root -> 3 children, two of which have children
TREE_TOKENS = [0, 2, 0, 5, 1, 3, 4]
TREE_PARENTS = [0, 0, 0, 0, 1, 1, 2]


def _fixed_tree():
    from eagle_mlx.decoding.tree import Tree, ancestors

    parents = mx.array(TREE_PARENTS)
    anc = ancestors(parents, 3)
    return Tree(mx.array(TREE_TOKENS), parents, anc, anc.sum(axis=1) - 1)


def _emitted_distribution(logprobs):
    """P(emitted tokens) of a lossless sampler, by exact enumeration: the target samples
    token after token from the distribution at the current node and goes on while the
    tokens so far are a path of the tree; the first token off the tree ends the pass."""
    probs = np.exp(np.array(logprobs, dtype=np.float64))
    children = {}
    for i in range(1, len(TREE_PARENTS)):
        children.setdefault(TREE_PARENTS[i], {})[TREE_TOKENS[i]] = i
    dist = {}

    def walk(node, prefix, p):
        for x in range(probs.shape[1]):
            q = p * probs[node, x]
            if q == 0:
                continue
            if x in children.get(node, {}):
                walk(children[node][x], prefix + (x,), q)
            else:
                dist[prefix + (x,)] = dist.get(prefix + (x,), 0.0) + q
    walk(0, (), 1.0)
    return dist


def _draw(rule, tree, logprobs, runs):
    counts = {}
    for seed in range(runs):
        mx.random.seed(seed)
        best, nxt = rule(tree, logprobs)
        best, nxt = int(best), int(nxt)
        path = [TREE_TOKENS[i] for i in range(1, len(TREE_TOKENS)) if bool(tree.anc[best, i])]
        key = tuple(path) + (nxt,)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _fixed_logprobs(sampling):
    from eagle_mlx.decoding.accept import process_logits

    logits = mx.array(np.random.default_rng(11).normal(0, 1.5, (len(TREE_TOKENS), 6)),
                      dtype=mx.float32)
    return process_logits(logits, sampling.temp, sampling.top_p, sampling.top_k)


@pytest.mark.long
@pytest.mark.parametrize("sampling,name", SAMPLING_CASES, ids=[c[1] for c in SAMPLING_CASES])
def test_acceptance_sampling_is_lossless_on_a_fixed_tree(sampling, name):
    """accept_sampling's output (accepted path + next token) has exactly the distribution
    of sampling the target token by token (chi-square against exact enumeration)."""
    from eagle_mlx.decoding.accept import accept_sampling

    logprobs = _fixed_logprobs(sampling)
    runs = 6000
    counts = _draw(accept_sampling, _fixed_tree(), logprobs, runs)
    dist = _emitted_distribution(logprobs)
    assert set(counts) <= set(dist)  # never a sequence the target cannot produce
    p_value, stat = _chi_square_p(counts, dist, runs)
    assert p_value > 1e-3, (p_value, stat)  # a correct sampler fails this 1 time in 1000


@pytest.mark.long
def test_a_wrong_residual_fails_the_same_test():
    logprobs = _fixed_logprobs(SamplingParams(temp=1.0))
    runs = 6000
    counts = _draw(_wrong_residual, _fixed_tree(), logprobs, runs)
    p_value, _ = _chi_square_p(counts, _emitted_distribution(logprobs), runs)
    assert p_value < 1e-3, p_value


@pytest.mark.parametrize("small_vocab_pair,draft", [("llama", 4), ("qwen3", None)],
                         indirect=["small_vocab_pair"], ids=["llama-draft-vocab-4", "qwen3"])
@pytest.mark.long
def test_sampling_through_the_engine_is_lossless(small_vocab_pair, draft):
    """End to end (head, tree, caches, the settings' filters): the first three tokens of
    a sampled generation have the target's exactly enumerated distribution. The Llama head
    drafts over a reduced vocabulary (4 of the 8 tokens, ranked out of id order), so drafted
    tokens outside it can only come from the target, and must still come at their rate."""
    from eagle_mlx.heads.draft_vocab import draft_vocab

    target_dir, head_dir = small_vocab_pair
    model, _ = eagle_mlx.load(str(target_dir), eagle=str(head_dir))
    if draft:
        model.head.use_draft_vocab(draft_vocab(model.target, np.array([5, 2, 7, 0, 3, 1, 4, 6]), draft))
    sampling = SAMPLING_CASES[1][0]
    prompt, n_tokens, runs = [1, 4, 6], 3, 500
    tree = dict(total_tokens=10, depth=3, draft_top_k=3)
    counts = _sample_counts(model, prompt, runs, n_tokens, sampling, tree)
    dist = _exact_distribution(model, prompt, n_tokens, sampling)
    p_value, stat = _chi_square_p(counts, dist, runs)
    assert p_value > 1e-3, (p_value, stat)


def _exact_match_rule(tree, logprobs, key=None):
    """mlx-lm's rule: sample y ~ p at every node, accept a child iff it is y."""
    y = mx.random.categorical(logprobs, key=key)
    is_root = mx.arange(tree.tokens.shape[0]) == 0
    ok = is_root | (tree.tokens == y[tree.parents])
    accepted = ~(tree.anc & ~ok[None, :]).any(axis=1)
    best = mx.argmax(mx.where(accepted, tree.depth, -1))
    return best, y[best]


def _sampled_chain_draft(self, head, target, cache, features, tokens, root):
    """mlx-lm's drafting: a chain whose tokens are sampled from the draft at temperature 1."""
    embed = target.embed_tokens
    out = head(features[None], tokens[None], embed, cache)
    stable = cache.offset
    h, chain = out[:, -1:], [root.reshape(1).astype(mx.int32)]
    for d in range(self.max_depth):
        t = head.to_target_ids(mx.random.categorical(head.logits(h[0], target))).astype(mx.int32)
        chain.append(t)
        h = head(h, t[None], embed, cache, positions=mx.array([stable + d]))
    cache.truncate(stable)
    return Tree(mx.concatenate(chain), self.parents, self.anc, self.depth)


@pytest.mark.long
@requires_oracle
def test_temperature_one_accepts_more_than_exact_match(monkeypatch):
    """At temperature 1, EAGLE's rule (deterministic top-k drafts, recursive rejection
    sampling) accepts more than mlx-lm's (drafts sampled from the head, accepted when the
    target's own sample equals them), with the same 4-token chain and on a full tree."""
    model, tok = oracle_model("llama", "eagle1_head")
    prompts = [p["prompt"] for p in oracle_reference()["llama"]["prompts"]]
    chain = [[0] * d for d in range(1, 5)]

    def mean_tau(**tree):
        taus = []
        for seed, prompt in enumerate(prompts * 3):
            rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=32, temp=1.0,
                                                seed=seed, **tree))
            taus.append(rs[-1].mean_accept_length)
        return float(np.mean(taus))

    eagle_chain = mean_tau(tree_choices=chain, draft_top_k=1)
    eagle_tree = mean_tau(total_tokens=16, depth=4, draft_top_k=4)
    monkeypatch.setattr(engine, "accept_sampling", _exact_match_rule)
    monkeypatch.setattr(StaticTree, "draft", _sampled_chain_draft)
    exact_match = mean_tau(tree_choices=chain, draft_top_k=1)
    print(f"tau at temp 1: exact match {exact_match:.2f}, EAGLE chain {eagle_chain:.2f}, "
          f"EAGLE tree {eagle_tree:.2f}")
    assert eagle_chain > exact_match + 0.2
    assert eagle_tree > eagle_chain


# ------------------------------------------------------------------------------ edge cases

@pytest.fixture(scope="module")
def pair(random_pairs):
    """A random pair whose tokenizer never stops: these tests run to their limits."""
    target_dir, head_dir = random_pairs["llama-eagle1"]
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(head_dir))
    tok.eos_token_ids = set()
    return target_dir, model, tok


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_max_tokens(pair, n):
    target_dir, model, tok = pair
    rs = list(eagle_mlx.stream_generate(model, tok, [5, 9, 11], max_tokens=n))
    assert [t for r in rs for t in r.tokens] == plain_greedy(target_dir, [5, 9, 11], n, eos=False)
    assert rs[-1].finish_reason == "length" and rs[-1].generation_tokens == n


@requires_oracle
def test_eos_inside_an_accepted_branch_stops_there():
    model, tok = oracle_model("llama", "eagle1_head")
    run = oracle_reference()["llama"]["eagle2_github"][1]["runs"][0]
    out = run["output_tokens"]
    # a token the official run accepted as a draft in the middle of a branch
    pos = 1
    for step in run["steps"]:
        if step["accept_length"] >= 3:
            mid = pos + 1
            if out.index(out[mid]) == mid:
                break
        pos += step["accept_length"] + 1
    stop = out[mid]
    saved = tok.eos_token_ids
    tok.eos_token_ids = {stop}
    try:
        rs = list(eagle_mlx.stream_generate(model, tok, run["prompt"], max_tokens=64,
                                            total_tokens=16, depth=4, draft_top_k=4))
    finally:
        tok.eos_token_ids = saved
    assert [t for r in rs for t in r.tokens] == out[: mid + 1]
    assert rs[-1].finish_reason == "stop" and rs[-1].accept_length >= 2


def test_context_limit(pair):
    target_dir, model, tok = pair
    prompt = [5, 9, 11, 13]
    # room for 10 more positions: trees stop fitting and plain steps finish the context
    rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=100, max_context=14,
                                        total_tokens=8, depth=3, draft_top_k=2))
    out = [t for r in rs for t in r.tokens]
    assert out == plain_greedy(target_dir, prompt, 11, eos=False)
    assert rs[-1].finish_reason == "length"
    # a prompt that fills the context gives its one token and stops
    rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=100, max_context=4))
    assert [t for r in rs for t in r.tokens] == plain_greedy(target_dir, prompt, 1, eos=False)
    assert rs[-1].finish_reason == "length"
    with pytest.raises(EagleError, match="prompt has 4 tokens but the model's context is 3"):
        list(eagle_mlx.stream_generate(model, tok, prompt, max_context=3))


def test_empty_prompt_and_bad_settings(pair):
    _, model, tok = pair
    with pytest.raises(EagleError, match="prompt is empty"):
        list(eagle_mlx.stream_generate(model, tok, []))
    with pytest.raises(EagleError, match="max_tokens"):
        list(eagle_mlx.stream_generate(model, tok, [4], max_tokens=0))
    with pytest.raises(EagleError, match="top_p"):
        list(eagle_mlx.stream_generate(model, tok, [4], top_p=2.0))
    with pytest.raises(EagleError, match="total_tokens must be at most 7 for depth 1"):
        list(eagle_mlx.stream_generate(model, tok, [4], total_tokens=9, depth=1, draft_top_k=2))


def test_streamed_text_is_the_decoded_output(pair):
    _, model, tok = pair
    rs = list(eagle_mlx.stream_generate(model, tok, "t5 t9 t11", max_tokens=30))
    tokens = [t for r in rs for t in r.tokens]
    assert "".join(r.text for r in rs) == tok.decode(tokens)
    assert eagle_mlx.generate(model, tok, "t5 t9 t11", max_tokens=30) == tok.decode(tokens)


@pytest.mark.parametrize("temp,top_p,min_p,top_k", [
    (1.0, 1.0, 0.0, 0), (0.7, 0.9, 0.0, 0), (1.3, 1.0, 0.05, 0), (0.5, 1.0, 0.0, 7),
    (2.0, 0.8, 0.02, 12), (0.9, 0.95, 0.1, 5),
])
def test_sampling_follows_mlx_lm_order(temp, top_p, min_p, top_k):
    from mlx_lm.sample_utils import make_sampler

    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2.0, 50).astype(np.float32)
    sampling = SamplingParams(temp, top_p, top_k, min_p)
    ours = np.exp(np.array(sampling.logprobs(mx.array(logits))))
    np.testing.assert_allclose(ours, numpy_sampling_distribution(logits, temp, top_p, min_p, top_k),
                               atol=1e-6)
    # with the same random state, plain decoding draws exactly what mlx-lm's sampler draws
    sampler = make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
    x = mx.array(logits)
    logprobs = x - mx.logsumexp(x)
    same = 0
    for seed in range(300):
        mx.random.seed(seed)
        a = sampler(logprobs[None]).item()
        mx.random.seed(seed)
        same += a == sampling.pick(x[None]).item()  # [1, V], as generate_step passes it
    assert same >= 297, same


@pytest.mark.parametrize("speculate", [True, False], ids=["eagle", "plain"])
def test_prompt_cache_prefills_only_what_changed(pair, monkeypatch, speculate):
    """A conversation's next turn through a PromptCache: the output equals a fresh run on
    the whole prompt, and the target runs only the tokens after the shared prefix."""
    from eagle_mlx.targets.target import Target

    _, model, tok = pair
    fed = []  # tokens per target forward (the tree forward, or mlx-lm's for plain decoding)
    for cls in (Target, type(model.target.model)):
        def counting(self, tokens, *a, _call=cls.__call__, **k):
            fed.append(tokens.shape[1])
            return _call(self, tokens, *a, **k)
        monkeypatch.setattr(cls, "__call__", counting)

    def prefilled():  # mlx-lm's generate_step runs the last prompt token on its own
        return fed[0] if speculate else fed[0] + 1

    def run(prompt, cache=None, n=12):
        fed.clear()
        return [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=n,
                                                     speculate=speculate, prompt_cache=cache)
                for t in r.tokens]

    cache = eagle_mlx.PromptCache()
    first_prompt = [5, 9, 11, 3, 7]
    first = run(first_prompt, cache)
    second_prompt = first_prompt + first + [13, 17, 19]
    second = run(second_prompt, cache)
    prefill = prefilled()
    assert second == run(second_prompt)
    # the caches held the first prompt and the output but its last token (or more)
    assert prefill <= 4, (prefill, len(second_prompt))
    # a prompt that leaves the conversation early reuses only the common start (with a head:
    # one token less, as the head's entry at the last common position was made with the old
    # next token; a fresh run drafts from the new one)
    third_prompt = first_prompt[:3] + [21, 23]
    third = run(third_prompt, cache)
    assert prefilled() == (3 if speculate else 2) and third == run(third_prompt)
    # a generation abandoned mid-stream leaves a cache the next call can still use
    stream = eagle_mlx.stream_generate(model, tok, first_prompt, max_tokens=30,
                                       speculate=speculate, prompt_cache=cache)
    partial = next(stream).tokens + next(stream).tokens
    stream.close()
    fourth = first_prompt + partial + [29]
    reused = run(fourth, cache)
    assert prefilled() < len(fourth) and reused == run(fourth)


def test_a_reused_prompt_cache_drafts_what_a_fresh_run_drafts(pair):
    """Sampling with a seed after a prompt cache made for another prompt that shares a
    prefix: the trees (so the draws) are a fresh run's, so the tokens are identical — the
    head keeps no entry made with the other prompt's next token."""
    _, model, tok = pair
    for seed in range(5):
        kw = dict(max_tokens=20, temp=0.7, seed=seed, total_tokens=8, depth=3, draft_top_k=2)
        first, second = [5, 6, 7, 8, 9, 10, 11] + [20 + seed], [5, 6, 7, 8, 9, 10, 11, 40, 3]
        fresh = [t for r in eagle_mlx.stream_generate(model, tok, second, **kw) for t in r.tokens]
        pc = eagle_mlx.PromptCache()
        list(eagle_mlx.stream_generate(model, tok, first, prompt_cache=pc, **kw))
        reused = [t for r in eagle_mlx.stream_generate(model, tok, second, prompt_cache=pc, **kw)
                  for t in r.tokens]
        assert pc.reused == 6 and reused == fresh, seed


# ---------------------------------------------------------- a reduced draft vocabulary

def test_draft_vocab_ranks_answer_tokens_by_frequency(tmp_path, small_vocab_pair):
    """The kept ids are the most frequent target ids of the answers (counted here
    independently with collections.Counter), mapped both ways."""
    from collections import Counter

    from eagle_mlx.training.data import load_conversations
    from eagle_mlx.heads.draft_vocab import count_tokens, draft_vocab, ranking

    target_dir, _ = small_vocab_pair
    model, tok = eagle_mlx.load(str(target_dir))
    rng = np.random.default_rng(4)
    data = [{"id": str(i), "conversations": [
        {"from": "human", "value": "t3 t4"},
        {"from": "gpt", "value": " ".join(f"t{int(x)}" for x in rng.choice(
            [3, 4, 5, 6, 7], size=12, p=[0.05, 0.1, 0.2, 0.25, 0.4]))}]} for i in range(30)]
    (tmp_path / "d.json").write_text(json.dumps(data))
    convs = load_conversations(str(tmp_path / "d.json"))
    counts = count_tokens(tok, convs, model.target.vocab_size)
    expected = Counter()
    for c in convs:
        for m in c:
            if m["role"] == "assistant":
                expected.update(tok.encode(m["content"], add_special_tokens=False))
                expected.update(tok.eos_token_ids)
    assert counts.tolist() == [expected.get(i, 0) for i in range(model.target.vocab_size)]
    top3 = sorted(expected, key=lambda i: (-expected[i], i))[:3]
    dv = draft_vocab(model.target, ranking(counts), 3)
    assert np.array(dv.ids).tolist() == sorted(top3)
    rows = np.array(model.target.lm_head(mx.eye(model.target.hidden_size)).T)[sorted(top3)]
    np.testing.assert_allclose(np.array(dv.rows), rows, atol=1e-5)


@pytest.mark.parametrize("pair", ["llama-eagle1", "llama4bit-eagle1", "qwen2-eagle1-qkv-bias"])
def test_greedy_with_a_reduced_draft_vocab_equals_plain(random_pairs, tmp_path, pair):
    from eagle_mlx.heads.draft_vocab import draft_vocab

    target_dir, head_dir = random_pairs[pair]
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(head_dir))
    rng = np.random.default_rng(9)
    model.head.use_draft_vocab(draft_vocab(model.target, rng.permutation(64), 20))
    for tree in (TREES[0], TREES[1], TREES[4]):
        prompt = rng.integers(3, 64, 6).tolist()
        rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=40, **tree))
        drafted = [t for r in rs for t in r.tokens]
        assert drafted == plain_greedy(target_dir, prompt, 40), tree
    with pytest.raises(EagleError, match="draft_top_k 21 exceeds the head's draft vocabulary of 20"):
        list(eagle_mlx.stream_generate(model, tok, [4, 5], draft_top_k=21, depth=1,
                                       total_tokens=4))


def test_draft_vocab_refusals(random_pairs):
    target_dir, head_dir = random_pairs["llama-eagle3"]
    with pytest.raises(EagleError, match="EAGLE-1 heads"):
        eagle_mlx.load(str(target_dir), eagle=str(head_dir), draft_vocab=10)
    target_dir, head_dir = random_pairs["llama-eagle1"]
    with pytest.raises(EagleError, match="draft_vocab must be from 1 to the vocabulary size 64"):
        eagle_mlx.load(str(target_dir), eagle=str(head_dir), draft_vocab=65)


def test_eagle3_mapping_keeps_the_most_frequent_ids_both_ways():
    """d2t/t2d from counts (the published EAGLE-3 layout) against an exact enumeration."""
    from eagle_mlx.heads.draft_vocab import eagle3_mapping

    rng = np.random.default_rng(5)
    counts = rng.integers(0, 50, 300)
    counts[[7, 99, 200]] = 1000  # surely kept
    d2t, t2d = eagle3_mapping(counts, 40)
    kept = sorted(sorted(range(300), key=lambda i: (-counts[i], i))[:40])
    assert (np.arange(40) + d2t).tolist() == kept           # draft id -> target id
    assert np.flatnonzero(t2d).tolist() == kept             # target id -> in the draft
    assert {7, 99, 200} <= set(kept)
    assert min(counts[kept]) >= max(np.delete(counts, kept))
    with pytest.raises(EagleError, match="from 1 to the target's vocabulary size 300"):
        eagle3_mapping(counts, 301)
