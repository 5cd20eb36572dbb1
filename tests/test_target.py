"""Tree-capable targets against transformers, mlx-lm's own forward and the official oracle."""

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from eagle_mlx import EagleError, load_target
from tiny import ORACLE, ROOT, oracle_reference, requires_oracle

FAMILIES = ["llama2_mha", "llama3_gqa", "llama_bias_linear", "llama_dynamic", "mixtral", "qwen2",
            "qwen3", "qwen3_moe"]


def hf_forward(folder, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    hidden = [h[0].numpy() for h in out.hidden_states]
    return out.logits[0].numpy(), hidden


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_hidden_states_match_transformers(tiny_dir, name):
    folder = tiny_dir(name)
    target, _ = load_target(str(folder))
    rng = np.random.default_rng(0)
    # the dynamic-NTK model is run past its max_position_embeddings so its base grows
    n = 48 if name == "llama_dynamic" else 20
    ids = rng.integers(3, target.vocab_size, n).tolist()
    ref_logits, ref_hidden = hf_forward(folder, ids)
    taps = tuple(range(target.num_layers))
    h, tapped = target(mx.array([ids]), taps=taps)
    logits = np.array(target.lm_head(h)[0])
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=0)
    # transformers: hidden_states[k] is the input of decoder layer k, the last one is post-norm
    np.testing.assert_allclose(np.array(h[0]), ref_hidden[-1], atol=1e-4, rtol=0)
    for k, t in zip(taps, tapped):
        np.testing.assert_allclose(np.array(t[0]), ref_hidden[k], atol=1e-4, rtol=0)


def test_eagle3_taps_are_low_mid_high(tiny_dir):
    target, _ = load_target(str(tiny_dir("llama3_gqa")))
    assert target.eagle3_taps == (2, 4, 5)


@requires_oracle
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_oracle_reference_vectors_and_greedy(family):
    ref = oracle_reference()[family]
    target, _ = load_target(str(ORACLE / family / "target"))
    rv = ref["target"]["reference_vectors"]
    h, _ = target(mx.array([rv["input_ids"]]))
    logits = target.lm_head(h)[0]
    np.testing.assert_allclose(np.array(h[0]), rv["last_hidden_state_post_norm"], atol=1e-4)
    np.testing.assert_allclose(np.array(logits[-1]), rv["logits_last_position"], atol=1e-4)
    assert np.array(logits.argmax(-1)).tolist() == rv["logits_argmax"]
    for p in ref["prompts"]:
        cache = target.make_cache()
        h, _ = target(mx.array([p["prompt"]]), cache)
        out = []
        for _ in range(len(p["target_greedy_new_tokens"])):
            tok = target.lm_head(h[:, -1]).argmax(-1)
            out.append(tok.item())
            h, _ = target(tok[None], cache)
        assert out == p["target_greedy_new_tokens"]


def random_tree(rng, n_nodes, max_children=3):
    """parents[i] < i (node 0 is the root); returns parents and ancestor-or-self mask."""
    parents = [-1]
    for i in range(1, n_nodes):
        while True:
            p = int(rng.integers(0, i))
            if parents.count(p) < max_children:
                break
        parents.append(p)
    anc = np.eye(n_nodes, dtype=bool)
    for i in range(1, n_nodes):
        anc[i] |= anc[parents[i]]
    return parents, anc


def tree_forward(target, cache, tokens, anc, max_depth=None):
    """The target's logits for a tree (ancestor-or-self mask `anc`) after what `cache` holds."""
    n = cache[0].offset
    positions = mx.array(n + anc.sum(1) - 1)
    mask = mx.array(np.concatenate([np.ones((len(tokens), n), bool), anc], axis=1))
    h, _ = target(mx.array([tokens]), cache, positions=positions, mask=mask, max_depth=max_depth)
    return target.lm_head(h)[0]


@pytest.mark.parametrize("name", ["llama3_gqa", "mixtral", "llama_bias_linear", "qwen2", "qwen3",
                                  "qwen3_moe"])
def test_tree_forward_equals_path_by_path_forward(tiny_dir, name):
    target, _ = load_target(str(tiny_dir(name)))
    rng = np.random.default_rng(1)
    for trial in range(3):
        prompt = rng.integers(3, target.vocab_size, 9).tolist()
        parents, anc = random_tree(rng, 14)
        tokens = rng.integers(3, target.vocab_size, len(parents)).tolist()
        cache = target.make_cache()
        target(mx.array([prompt]), cache)
        logits = np.array(tree_forward(target, cache, tokens, anc))
        for i in range(len(tokens)):
            path = [tokens[j] for j in np.nonzero(anc[i])[0]]
            # mlx-lm's own, unmodified forward over prompt + root-to-node path
            ref = np.array(target.model(mx.array([prompt + path]))[0, -1])
            np.testing.assert_allclose(logits[i], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama3_gqa", "mixtral", "qwen2", "qwen3", "qwen3_moe"])
def test_cache_keeps_only_accepted_rows(tiny_dir, name):
    target, _ = load_target(str(tiny_dir(name)))
    rng = np.random.default_rng(2)
    for trial in range(3):
        prompt = rng.integers(3, target.vocab_size, 11).tolist()
        parents, anc = random_tree(rng, 12)
        tokens = rng.integers(3, target.vocab_size, len(parents)).tolist()
        cache = target.make_cache()
        target(mx.array([prompt]), cache)
        tree_forward(target, cache, tokens, anc)
        leaf = int(rng.integers(0, len(tokens)))
        kept = np.nonzero(anc[leaf])[0]
        for c in cache:
            c.keep(len(prompt), mx.array(len(prompt) + kept))
        accepted = [tokens[j] for j in kept]
        # continue greedily from the compacted cache ...
        seq = prompt + accepted
        out, ref_logits = [], []
        tok = int(np.argmax(np.array(target.model(mx.array([seq]))[0, -1])))
        for _ in range(6):
            h, _ = target(mx.array([[tok]]), cache)
            out.append(np.array(target.lm_head(h)[0, -1]))
            seq = seq + [tok]
            # ... and compare with mlx-lm run on the accepted tokens alone
            ref_logits.append(np.array(target.model(mx.array([seq]))[0, -1]))
            tok = int(np.argmax(ref_logits[-1]))
        np.testing.assert_allclose(np.array(out), np.array(ref_logits), atol=1e-4, rtol=0)
        assert cache[0].offset == len(seq)


@pytest.mark.parametrize("bits,tolerance", [(8, 0.02), (4, 0.15)])
def test_quantized_target_loads_and_runs_trees(tiny_dir, tmp_path, bits, tolerance):
    from mlx_lm import convert

    src = tiny_dir("llama3_gqa")
    qdir = tmp_path / f"q{bits}"
    convert(str(src), mlx_path=str(qdir), quantize=True, q_bits=bits, q_group_size=32)
    assert json.loads((qdir / "config.json").read_text())["quantization"]["bits"] == bits
    qtarget, _ = load_target(str(qdir), dtype="stored")
    ftarget, _ = load_target(str(src))
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 256, 10).tolist()
    parents, anc = random_tree(rng, 10)
    tokens = rng.integers(3, 256, len(parents)).tolist()
    results = []
    for t in (qtarget, ftarget):
        cache = t.make_cache()
        t(mx.array([prompt]), cache)
        results.append(np.array(tree_forward(t, cache, tokens, anc)))
    q, f = results
    # the quantized tree forward is exact against mlx-lm's forward of the same weights
    for i in range(len(tokens)):
        path = [tokens[j] for j in np.nonzero(anc[i])[0]]
        ref = np.array(qtarget.model(mx.array([prompt + path]))[0, -1])
        np.testing.assert_allclose(q[i], ref, atol=1e-4, rtol=0)
    # and close to the float model: relative L2 error of the logits
    rel = np.linalg.norm(q - f) / np.linalg.norm(f)
    print(f"{bits}-bit tree logits vs float: relative L2 error {rel:.4f}")
    assert rel < tolerance, rel


def test_folder_without_config(tmp_path):
    with pytest.raises(EagleError, match="has no config.json"):
        load_target(str(tmp_path))


def test_missing_folder(tmp_path):
    with pytest.raises(EagleError, match="does not exist"):
        load_target(str(tmp_path / "nope" / "deeper"))


def test_unsupported_model_type(tiny_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_dir("llama2_mha"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EagleError, match="'gpt2'.*supported model types: llama, mistral, mixtral"):
        load_target(str(folder))


def test_missing_weight_files(tiny_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_dir("llama2_mha"), folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(EagleError, match="no model\\*.safetensors"):
        load_target(str(folder))
    # a sharded checkpoint whose index names a shard that is not there
    shutil.copy(tiny_dir("llama2_mha") / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EagleError, match="model-00002-of-00002.safetensors .* is missing"):
        load_target(str(folder))


def test_repo_id_while_offline(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    code = "from eagle_mlx import load_target; load_target('someone/not-downloaded-model')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "HF_HUB_OFFLINE=1" in proc.stderr and "someone/not-downloaded-model" in proc.stderr


def test_eos_ids_include_generation_config(tiny_dir, tmp_path, monkeypatch):
    """EOS ids come from generation_config.json too (as mlx-lm merges them), and a Hub
    download asks only for the files a model needs (mlx-lm's allow patterns)."""
    import huggingface_hub

    folder = tmp_path / "m"
    shutil.copytree(tiny_dir("llama2_mha"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    _, tok = load_target(str(folder))
    assert {2, 7} <= set(tok.eos_token_ids)
    seen = {}

    def fake_download(repo, allow_patterns=None):
        seen["patterns"] = allow_patterns
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    load_target("some-org/some-model")
    assert "model*.safetensors" in seen["patterns"]
    assert not any("original" in p or p in ("*", "*.pth", "*.bin") for p in seen["patterns"])


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_auto_dtype_dequantizes_a_quantized_moe_to_float32_exactly(tiny_dir, tmp_path, name):
    """dtype="auto" on the CPU leaves no quantized module, the experts' included, and the
    float32 model gives the logits mlx-lm's own forward gives on the quantized weights."""
    import mlx.nn as nn
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    from eagle_mlx.targets.load import _config_overrides, read_config

    # mlx-lm quantizes and saves (its convert reads the config keys transformers 5 renamed
    # only through the translation the loader applies)
    src, qdir = tiny_dir(name), tmp_path / "q4"
    model, config = load_model(src, model_config=_config_overrides(read_config(src), src))
    model, config = quantize_model(model, config, group_size=32, bits=4)
    save_model(qdir, model)
    save_config(config, qdir / "config.json")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, qdir / f.name)
    target, _ = load_target(str(qdir), dtype="auto")
    left = [n for n, m in target.model.named_modules() if "Quantized" in type(m).__name__]
    assert not left, left
    switch = [n for n, m in target.model.named_modules() if type(m).__name__ == "SwitchLinear"]
    assert switch  # the experts came back as mlx-lm's float SwitchLinear
    from mlx.utils import tree_flatten

    assert all(v.dtype == mx.float32 for _, v in tree_flatten(target.model.parameters())
               if mx.issubdtype(v.dtype, mx.floating))
    # mlx-lm, quantized as stored (the config keys transformers 5 renamed, translated back)
    reference, _ = load_model(qdir, model_config=_config_overrides(read_config(qdir), qdir))
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in reference.named_modules())
    tokens = mx.array([np.random.default_rng(1).integers(3, 200, 12).tolist()])
    want = np.array(reference(tokens).astype(mx.float32))
    got = np.array(target.model(tokens))
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)
