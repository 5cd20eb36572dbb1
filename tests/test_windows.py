"""Sliding-window, attention-sink and KV-sharing targets (Qwen2/Qwen3 `use_sliding_window`,
Mistral, Gemma 3, Gemma 4, gpt-oss, Ministral 3) against transformers, with windows of 8
positions: far shorter than the prompts (40 tokens) and the outputs (64 tokens)."""

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest

import eagle_mlx
from conftest import WINDOWED_TARGETS
from eagle_mlx import EagleError, load_target
from eagle_mlx.decoding.drafters import Drafter
from eagle_mlx.decoding.steps import PromptCache, SamplingParams, eagle_steps
from test_target import random_tree, tree_forward
from tiny import continue_greedily, make_eagle_head, make_hf_model

NAMES = list(WINDOWED_TARGETS)


def hf_model(folder):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(model, ids, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_logits_hidden_states_and_windows_match_transformers(tiny_dir, name):
    import torch

    folder = tiny_dir(name)
    target, _ = load_target(str(folder))
    assert any(w is not None for w in target.windows), target.windows
    ids = np.random.default_rng(0).integers(3, target.vocab_size, 40).tolist()
    model = hf_model(folder)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    taps = tuple(range(target.num_layers))
    h, tapped = target(mx.array([ids]), taps=taps)
    np.testing.assert_allclose(np.array(target.lm_head(h)[0]), out.logits[0].numpy(), atol=1e-4,
                               rtol=0)
    np.testing.assert_allclose(np.array(h[0]), out.hidden_states[-1][0].numpy(), atol=1e-4, rtol=0)
    for k, t in zip(taps, tapped):
        np.testing.assert_allclose(np.array(t[0]), out.hidden_states[k][0].numpy(), atol=1e-4,
                                   rtol=0)
    # the same through the caches: a prompt in uneven chunks, then one token at a time,
    # past the window many times over (each window cache drops old positions as it goes)
    cache = target.make_cache()
    logits = []
    for a, b in [(0, 5), (5, 22), (22, 23), (23, 40)]:
        h, _ = target(mx.array([ids[a:b]]), cache)
        logits.append(np.array(target.lm_head(h)[0]))
    np.testing.assert_allclose(np.concatenate(logits), out.logits[0].numpy(), atol=1e-4, rtol=0)
    if any(w is not None for w in target.windows):
        assert max(c.base for c in cache) > 0  # positions were dropped


@pytest.mark.parametrize("name", NAMES)
def test_tree_forward_equals_path_by_path_and_kept_rows_decode_alone(tiny_dir, name):
    """Every tree node's logits equal transformers' forward over prompt + its path, the
    cache after keeping one path decodes as if only that path had been fed (greedy, 12
    tokens, against transformers' greedy continuation)."""
    folder = tiny_dir(name)
    target, _ = load_target(str(folder))
    model = hf_model(folder)
    rng = np.random.default_rng(1)
    for trial in range(2):
        prompt = rng.integers(3, target.vocab_size, 30 + 7 * trial).tolist()
        parents, anc = random_tree(rng, 14)
        tokens = rng.integers(3, target.vocab_size, len(parents)).tolist()
        cache = target.make_cache()
        target(mx.array([prompt[:20]]), cache)
        target(mx.array([prompt[20:]]), cache)
        n = len(prompt)
        logits = np.array(tree_forward(target, cache, tokens, anc))
        for i in range(len(tokens)):
            path = [tokens[j] for j in np.nonzero(anc[i])[0]]
            ref = hf_logits(model, prompt + path)[-1]
            np.testing.assert_allclose(logits[i], ref, atol=1e-4, rtol=0)
        leaf = int(np.argmax(anc.sum(1)))  # the deepest node
        kept = np.nonzero(anc[leaf])[0]
        target.accept(cache, n, mx.array(n + kept))
        seq = prompt + [tokens[j] for j in kept]
        expected = hf_greedy(model, seq, 12)
        out = continue_greedily(target, cache, logits[leaf], 12)
        assert out == expected, (name, trial)


@pytest.fixture(scope="module")
def windowed_pairs(tmp_path_factory):
    """Random heads for the windowed targets: EAGLE-1 for each; EAGLE-3 for a Gemma 3 and
    a gpt-oss of seven layers (three distinct tap layers)."""
    root = tmp_path_factory.mktemp("windowed")
    pairs = {}
    for name, (kind, overrides) in WINDOWED_TARGETS.items():
        t = make_hf_model(root / name, kind, seed=11, vocab_size=64, scale=4.0, **overrides)
        pairs[name + "-eagle1"] = (t, make_eagle_head(root / (name + "-h1"), t, "eagle1", seed=3))
    for name in ("gemma3_swa", "gpt_oss_swa"):
        kind, overrides = WINDOWED_TARGETS[name]
        overrides = dict(overrides, num_hidden_layers=7)
        if name == "gemma3_swa":
            overrides["layer_types"] = (["sliding_attention"] * 2 + ["full_attention"]) * 2 + \
                ["sliding_attention"]
        t = make_hf_model(root / (name + "7"), kind, seed=12, vocab_size=64, scale=4.0, **overrides)
        pairs[name + "-eagle3"] = (t, make_eagle_head(root / (name + "-h3"), t, "eagle3", seed=4,
                                                      draft_vocab_size=40))
    return pairs


TREES = [dict(total_tokens=8, depth=2, draft_top_k=2), dict(total_tokens=30, depth=6, draft_top_k=4),
         dict(total_tokens=2, depth=1, draft_top_k=1)]


@pytest.mark.long
@pytest.mark.parametrize("pair", [n + "-eagle1" for n in NAMES] + ["gemma3_swa-eagle3",
                                                                   "gpt_oss_swa-eagle3"])
def test_greedy_eagle_equals_transformers_greedy(windowed_pairs, pair):
    greedy_against_transformers(*windowed_pairs[pair], TREES, prompt_lengths=(20, 41), n=40)


def greedy_against_transformers(target_dir, head_dir, trees, prompt_lengths, n) -> None:
    """Plain and EAGLE greedy decoding (one random prompt a tree) equal transformers'."""
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(head_dir))
    tok.eos_token_ids = set()
    reference = hf_model(target_dir)
    rng = np.random.default_rng(7)
    for tree in trees:
        prompt = rng.integers(3, 64, int(rng.integers(*prompt_lengths))).tolist()
        expected = hf_greedy(reference, prompt, n)
        plain = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=n,
                                                      speculate=False) for t in r.tokens]
        assert plain == expected, (target_dir, "plain")
        out = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=n, **tree)
               for t in r.tokens]
        assert out == expected, (target_dir, tree)


@pytest.mark.parametrize("speculate", [True, False], ids=["eagle", "plain"])
def test_prompt_cache_second_turn_starts_past_the_window(windowed_pairs, speculate):
    """A second turn reuses the first turn's caches (prompt + answer, past the window) and
    continues exactly as transformers on the whole conversation; a prompt that differs
    before what the window still holds starts over, and is exact too."""
    target_dir, head_dir = windowed_pairs["gemma3_swa-eagle1"]
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(head_dir))
    tok.eos_token_ids = set()
    reference = hf_model(target_dir)
    rng = np.random.default_rng(3)
    first = rng.integers(3, 64, 30).tolist()
    pc = PromptCache()
    answer = [t for r in eagle_mlx.stream_generate(model, tok, first, max_tokens=20,
                                                   prompt_cache=pc, speculate=speculate)
              for t in r.tokens]
    assert answer == hf_greedy(reference, first, 20)
    second = first + answer + rng.integers(3, 64, 6).tolist()
    out = [t for r in eagle_mlx.stream_generate(model, tok, second, max_tokens=20,
                                                prompt_cache=pc, speculate=speculate)
           for t in r.tokens]
    assert pc.reused >= len(first) + len(answer) - 1 > 8
    assert out == hf_greedy(reference, second, 20)
    edited = second[:10] + [3] + second[11:]  # differs where the window no longer reaches
    out = [t for r in eagle_mlx.stream_generate(model, tok, edited, max_tokens=20,
                                                prompt_cache=pc, speculate=speculate)
           for t in r.tokens]
    assert pc.reused == 0
    assert out == hf_greedy(reference, edited, 20)


def chi_square_against_transformers(target_dir, head_dir, prompt, runs=400, n_tokens=3,
                                    steps=eagle_steps):
    """p-value of the first `n_tokens` sampled tokens (EAGLE, temperature 0.7, top-k 5,
    top-p 0.9, tree 10/3/3; `steps` makes the steps from those, `eagle_steps` by default)
    against transformers' logits enumerated exactly."""
    from eagle_mlx.decoding.accept import process_logits

    model, _ = eagle_mlx.load(str(target_dir), eagle=str(head_dir))
    vocab = model.target.vocab_size
    sampling = SamplingParams(temp=0.7, top_k=5, top_p=0.9)
    counts = {}
    for seed in range(runs):
        mx.random.seed(seed)
        out = []
        for step in steps(model.target, model.head, prompt, sampling, total_tokens=10,
                          depth=3, draft_top_k=3):
            out += step.tokens
            if len(out) >= n_tokens:
                break
        counts[tuple(out[:n_tokens])] = counts.get(tuple(out[:n_tokens]), 0) + 1
    import torch

    reference = hf_model(target_dir)
    dist = {}
    prefixes = list(itertools.product(range(vocab), repeat=n_tokens - 1))
    for b in range(0, len(prefixes), 256):  # transformers over 256 continuations at once
        batch = prefixes[b: b + 256]
        with torch.no_grad():
            out = reference(torch.tensor([prompt + list(s) for s in batch])).logits.numpy()
        for s, row in zip(batch, out):
            logits = mx.array(row[len(prompt) - 1:])
            logp = np.array(process_logits(logits, sampling.temp, sampling.top_p, sampling.top_k))
            lp = sum(logp[j, s[j]] for j in range(n_tokens - 1))
            for last in range(vocab):
                dist[s + (last,)] = float(np.exp(lp + logp[n_tokens - 1, last]))
    return chi_square_p(counts, dist, runs)


def chi_square_p(counts: dict, dist: dict, runs: int) -> float:
    """p-value of `runs` draws counted per outcome against the probabilities `dist` (every
    outcome), the outcomes expected fewer than 5 times pooled into one cell."""
    from scipy.stats import chi2

    cells, other_obs, other_exp = [], 0, 0.0
    for key, p in dist.items():
        if p * runs >= 5:
            cells.append((counts.get(key, 0), p * runs))
        else:
            other_obs, other_exp = other_obs + counts.get(key, 0), other_exp + p * runs
    cells.append((other_obs, other_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return chi2.sf(stat, len(cells) - 1)


@pytest.mark.long
def test_sampling_with_a_window_and_sinks_is_lossless(tmp_path):
    """gpt-oss (attention sinks, a window of 2 on every other layer): the first three sampled
    tokens after a 4-token prompt have the distribution transformers' logits give,
    enumerated exactly."""
    target_dir = make_hf_model(tmp_path / "t", "gpt_oss", seed=3, vocab_size=8, hidden_size=32,
                               intermediate_size=64, num_hidden_layers=2, scale=1.0,
                               num_key_value_heads=2, sliding_window=2)
    head_dir = make_eagle_head(tmp_path / "h", target_dir, "eagle1", seed=4)
    assert chi_square_against_transformers(target_dir, head_dir, [1, 4, 6, 2]) > 1e-3


def test_kv_shared_layers_have_no_cache_and_read_their_source(tiny_dir):
    target, _ = load_target(str(tiny_dir("gemma4_swa")))
    sources = [m.source for m in target.mechanisms]
    assert sources[-2:] != [None, None] and all(s is None for s in sources[:-2])
    assert len(target.make_cache()) == target.num_layers - 2
    # each shared layer reads the last unshared layer of its own kind
    for i, s in enumerate(sources):
        if s is not None:
            assert target.windows[s] == target.windows[i] and s < target.num_layers - 2


def _write_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes,words", [
    (dict(model_type="gemma2"), "model type 'gemma2'"),
    (dict(use_sliding_window=True, sliding_window=8), "Llama models do not have"),
    (dict(quantization={"group_size": 32, "bits": 4, "mode": "int3x"}),
     "unknown quantization mode 'int3x'"),
])
def test_bad_configs_are_refused_in_one_sentence(tiny_dir, tmp_path, changes, words):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_dir("llama2_mha"), folder)
    _write_config(folder, **changes)
    with pytest.raises(EagleError) as e:
        load_target(str(folder))
    assert words in str(e.value) and str(folder / "config.json") in str(e.value)
    assert "\n" not in str(e.value)


def test_a_gemma3_pattern_mlx_lm_cannot_build_is_refused(tiny_dir, tmp_path):
    import shutil

    folder = tmp_path / "g"
    shutil.copytree(tiny_dir("gemma3_swa"), folder)
    _write_config(folder, layer_types=["full_attention"] + ["sliding_attention"] * 5)
    with pytest.raises(EagleError, match="Gemma 3 layer_types must repeat"):
        load_target(str(folder))


FP4_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _mxfp4_reference(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The OCP MX format decoded by hand: eight E2M1 values per uint32 (low nibble first),
    one power-of-two scale (E8M0, bias 127) per 32 values."""
    nibbles = (packed[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    values = FP4_E2M1[nibbles].reshape(*packed.shape[:-1], -1)
    scale = np.exp2(scales.astype(np.float32) - 127)
    return values * np.repeat(scale, 32, axis=-1)


def test_mxfp4_experts_load_and_dequantize_exactly(tiny_dir, tmp_path):
    """A gpt-oss with MXFP4 experts, as mlx-community converts them (`mode` in the
    quantization config): it loads as stored, and dtype float32 dequantizes the experts to
    exactly the values the format encodes; both forwards agree."""
    import shutil

    from eagle_mlx import mlxlm

    src = tiny_dir("gpt_oss_swa")
    target, _ = load_target(str(src), dtype="stored")
    model, config = mlxlm.quantize_model(target.model, dict(target.config), 32, 4, mode="mxfp4",
                                         quant_predicate=lambda path, m: ".experts." in path)
    out = tmp_path / "mxfp4"
    out.mkdir()
    mlxlm.save_model(out, model)
    mlxlm.save_config(config, out / "config.json")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    assert json.loads((out / "config.json").read_text())["quantization"]["mode"] == "mxfp4"
    stored, _ = load_target(str(out), dtype="stored")
    dense, _ = load_target(str(out), dtype="float32")
    q = stored.layers[1].mlp.experts.gate_proj
    assert q.mode == "mxfp4" and q.scales.dtype == mx.uint8
    expected = _mxfp4_reference(np.array(q.weight), np.array(q.scales))
    got = dense.layers[1].mlp.experts.gate_proj.weight
    assert got.dtype == mx.float32
    np.testing.assert_array_equal(np.array(got), expected)
    ids = mx.array([np.random.default_rng(0).integers(3, 256, 24).tolist()])
    a = np.array(stored.lm_head(stored(ids)[0]))
    b = np.array(dense.lm_head(dense(ids)[0]))
    np.testing.assert_allclose(a, b, atol=1e-3, rtol=0)


@pytest.mark.parametrize("name,wrapper", [("gemma3_swa", "gemma3"), ("ministral3_swa", "mistral3"),
                                          ("qwen3_5", "qwen3_5")])
def test_a_multimodal_checkpoint_runs_its_language_model(tiny_dir, tmp_path, name, wrapper):
    """A Gemma 3 / Mistral 3 / Qwen3.5 checkpoint (text_config, weights under the language
    model's prefix, a vision tower beside it) is its language model: logits and greedy
    decoding equal transformers' text model."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = tiny_dir(name)
    folder = tmp_path / wrapper
    shutil.copytree(src, folder)
    text = json.loads((src / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "model_type": wrapper, "architectures": ["ForConditionalGeneration"],
        "text_config": text, "vocab_size": text["vocab_size"],
        "vision_config": {"hidden_size": 8}, "eos_token_id": text.get("eos_token_id")}))
    weights = load_file(str(src / "model.safetensors"))
    if wrapper == "gemma3":  # the layout of the Gemma 3 checkpoints on the Hub
        renamed = {"language_model." + k: v for k, v in weights.items()}
    else:  # transformers >= 5
        renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                   for k, v in weights.items()}
    renamed["vision_tower.patch.weight"] = np.zeros((8, 8), np.float32)
    save_file(renamed, str(folder / "model.safetensors"))
    target, tok = load_target(str(folder))
    assert target.model_type == wrapper and target.windows == load_target(str(src))[0].windows
    reference = hf_model(src)
    ids = np.random.default_rng(4).integers(3, target.vocab_size, 30).tolist()
    h, _ = target(mx.array([ids]))
    np.testing.assert_allclose(np.array(target.lm_head(h)[0]), hf_logits(reference, ids), atol=1e-4,
                               rtol=0)
    model = eagle_mlx.EagleModel(target)
    tok.eos_token_ids = set()
    out = [t for r in eagle_mlx.stream_generate(model, tok, ids, max_tokens=12) for t in r.tokens]
    assert out == hf_greedy(reference, ids, 12)


class _ForeknowingDrafter(Drafter):
    """Drafts from a known continuation (transformers' greedy one): a chain whose first
    `right` tokens are correct and then wrong, and a wrong sibling at every depth, so that
    cycles accept long paths (up to depth - 1 tokens) across the windows, and short ones."""

    features = None

    def __init__(self, sequence, depth, vocab, seed):
        self.sequence, self.max_depth, self.vocab = sequence, depth, vocab
        self.rng = np.random.default_rng(seed)

    def new_state(self):
        return {"seen": 0}

    def offset(self, state):
        return state["seen"]

    def truncate(self, state, length):
        state["seen"] = min(state["seen"], length)

    def propose(self, state, features, tokens, root):
        from eagle_mlx.decoding.tree import tree_from_parents

        state["seen"] += tokens.shape[0]
        at = state["seen"]  # the root is sequence[at]
        right = int(self.rng.integers(0, self.max_depth))
        toks, parents, chain = [int(root.item())], [0], 0
        for d in range(1, self.max_depth):
            true = self.sequence[at + d] if at + d < len(self.sequence) else 3
            good = true if d <= right else (true + 1) % self.vocab
            for token in (good, (true + 2) % self.vocab):
                toks.append(token)
                parents.append(chain)
            chain = len(toks) - 2
        n = len(toks)
        return tree_from_parents(mx.array(toks), mx.array(parents), mx.zeros(n), self.max_depth)


@pytest.mark.parametrize("name", NAMES)
def test_long_accepted_paths_cross_the_windows_exactly(tiny_dir, name):
    """Trees whose right branch runs up to 5 tokens deep (windows of 8): every cycle keeps
    its accepted path in every window cache, and the output is transformers' greedy output."""
    foreknown_decoding(tiny_dir(name), prompt_len=21, n=48, seed=1)


def foreknown_decoding(folder, prompt_len: int, n: int, seed: int) -> None:
    """Greedy speculative decoding with `_ForeknowingDrafter` (trees up to 6 levels) equals
    transformers' greedy output, and cycles accepted 5-token paths."""
    from eagle_mlx.decoding.steps import speculative_steps

    target, _ = load_target(str(folder))
    prompt = np.random.default_rng(5).integers(3, target.vocab_size, prompt_len).tolist()
    expected = hf_greedy(hf_model(folder), prompt, n)
    drafter = _ForeknowingDrafter(prompt + expected, 6, target.vocab_size, seed=seed)
    out, accepted = [], []
    for step in speculative_steps(target, drafter, prompt, SamplingParams(temp=0.0)):
        out += step.tokens
        if step.accept_length is not None:
            accepted.append(step.accept_length)
        if len(out) >= n:
            break
    assert out[:n] == expected
    assert max(accepted) == 5 and np.mean(accepted) > 1.5, accepted


def test_gemma3_final_soft_cap_as_transformers_and_attention_soft_cap_refused(tiny_dir, tmp_path):
    import shutil

    folder = tmp_path / "capped"
    shutil.copytree(tiny_dir("gemma3_swa"), folder)
    _write_config(folder, final_logit_softcapping=3.0)
    target, _ = load_target(str(folder))
    ids = np.random.default_rng(6).integers(3, target.vocab_size, 20).tolist()
    reference = hf_logits(hf_model(folder), ids)
    assert np.abs(reference).max() < 3.0
    np.testing.assert_allclose(np.array(target.lm_head(target(mx.array([ids]))[0])[0]), reference,
                               atol=1e-4, rtol=0)
    _write_config(folder, attn_logit_softcapping=50.0)
    with pytest.raises(EagleError, match="attn_logit_softcapping"):
        load_target(str(folder))
