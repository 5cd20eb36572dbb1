"""EAGLE-3 heads in every published layout: vLLM speculators (built, saved and run by
speculators itself), SpecForge and NVIDIA Model-Optimizer (written as those tools write
them), against the official layout and plain decoding."""

import json

import mlx.core as mx
import numpy as np
import pytest

import eagle_mlx
from eagle_mlx.heads.read import load_head
from eagle_mlx.errors import EagleError
from eagle_mlx.targets.load import load_target
from eagle_mlx.decoding.tree import draft_dynamic
from test_windows import greedy_against_transformers
from tiny import make_eagle_head, make_hf_model

TREES = [dict(total_tokens=8, depth=2, draft_top_k=2), dict(total_tokens=20, depth=5, draft_top_k=3),
         dict(total_tokens=2, depth=1, draft_top_k=1)]


def speculators_or_skip():
    try:
        from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
    except Exception as e:  # not installed, or its pinned dependencies missing
        pytest.skip(f"vLLM speculators cannot be imported here ({type(e).__name__}: {e}); "
                    "README's test command installs it")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A Llama target of 8 layers (distinct taps; vocabulary 64 so draft vocabularies are
    a real subset)."""
    return make_hf_model(tmp_path_factory.mktemp("layouts") / "target", "llama", seed=21,
                         vocab_size=64, scale=4.0, num_hidden_layers=8, num_key_value_heads=2)


# flag sets of speculators' Eagle3SpeculatorConfig; "layers" is transformer_layer_config's
SPECULATORS_VARIANTS = {
    "plain": {},
    "norm_before_residual": dict(norm_before_residual=True),
    "norm_before_fc": dict(norm_before_fc=True),
    "fc_norm+norm_output": dict(fc_norm=True, norm_output=True),
    "two_layers_qwen3": dict(layers=dict(num_hidden_layers=2), layer_type="qwen3"),
    "draft_vocab+aux_ids": dict(draft_vocab_size=40, eagle_aux_hidden_state_layer_ids=[0, 5, 8]),
    "sliding_layers": dict(layers=dict(num_hidden_layers=2, sliding_window=4,
                                       layer_types=["sliding_attention", "full_attention"])),
}


def make_speculators_head(folder, target_dir, variant: dict, seed: int = 0):
    """A random speculators Eagle3 head for the target, saved by speculators."""
    import torch
    from safetensors.numpy import load_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, Qwen3Config

    tcfg = json.loads((target_dir / "config.json").read_text())
    H, V = tcfg["hidden_size"], tcfg["vocab_size"]
    variant = dict(variant)
    layer_cls = Qwen3Config if variant.pop("layer_type", "llama") == "qwen3" else LlamaConfig
    layers = dict(hidden_size=H, intermediate_size=2 * H, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=H // 4, vocab_size=V, num_hidden_layers=1,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0)
    layers.update(variant.pop("layers", {}))
    tl = layer_cls(**layers)
    tl._attn_implementation = "eager"
    draft_vocab = variant.pop("draft_vocab_size", V)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=draft_vocab,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])),
        **variant)
    model = Eagle3DraftModel(config)
    g = torch.Generator().manual_seed(seed)
    embed = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "embed_tokens.weight":
                p.copy_(torch.from_numpy(embed))  # the target's, which drafting reads
            elif p.ndim == 1:  # norms
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
        if draft_vocab < V:
            chosen = torch.sort(torch.randperm(V - 3, generator=g)[:draft_vocab] + 3).values
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[chosen] = True
            model.load_vocab_mappings(t2d, (chosen - torch.arange(draft_vocab)).long())
    model.eval()
    model.save_pretrained(str(folder))
    return model


def speculators_logits(model, feats, ids, steps=3):
    """speculators' own forward (teacher-forced TTT steps), in float64 (so that the
    comparison measures our float32 rounding alone); the lm_head logits of each step
    [steps, N, draft vocab] and its per-step draft tokens."""
    import copy

    import torch

    model = copy.deepcopy(model).double()
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o[0].clone()))
    with torch.no_grad():
        drafts = model(torch.tensor(feats, dtype=torch.float64)[None], torch.tensor(ids)[None],
                       torch.zeros(1, len(ids), dtype=torch.long), ttt_steps=steps)
    return np.stack([s.numpy() for s in seen]), [d[0].numpy() for d in drafts]


def chain_logits(head, target, feats, ids, q, steps=3):
    """Our head at the context ids[:q+1] and a chain fed speculators' teacher-forced tokens:
    each level one drafted node at the next position (the drafting path: explicit positions
    and an ancestor mask)."""
    embed, cache = target.embed_tokens, head.make_cache()
    out = head(mx.array(feats[None, : q + 1]), mx.array([ids[: q + 1]]), embed, cache,
               fed_back=False)
    logits, h = [head.logits(out[0, -1:], target)[0]], out[:, -1:]
    for s in range(1, steps):
        n = cache.offset
        h = head(h, mx.array([[ids[q + s]]]), embed, cache, positions=mx.array([n]),
                 mask=mx.ones((1, n + 1), dtype=mx.bool_), fed_back=True)
        logits.append(head.logits(h[0], target)[0])
    return [np.array(x) for x in logits]


@pytest.mark.parametrize("name", list(SPECULATORS_VARIANTS))
def test_speculators_heads_match_speculators_forward(tmp_path, target_dir, name):
    """Logits within 1e-4 of speculators' own forward at every position (first step) and on
    drafted chains (deeper steps); the greedy chain drafts identical."""
    speculators_or_skip()
    variant = SPECULATORS_VARIANTS[name]
    model = make_speculators_head(tmp_path / "head", target_dir, variant, seed=1)
    target, _ = load_target(str(target_dir))
    head = load_head(str(tmp_path / "head"), target)
    assert head.layout == "vLLM speculators eagle3"
    rng = np.random.default_rng(2)
    N = 12
    feats = rng.standard_normal((N, head.feature_size)).astype(np.float32)
    ids = rng.integers(3, target.vocab_size, N).tolist()
    ref, _ = speculators_logits(model, feats, ids)
    out = head(mx.array(feats[None]), mx.array([ids]), target.embed_tokens, head.make_cache(),
               fed_back=False)
    np.testing.assert_allclose(np.array(head.logits(out[0], target)), ref[0], atol=1e-4, rtol=0)
    # deeper steps: speculators' TTT step s at index q is a chain of s drafted nodes after
    # ids[:q+1]; its sliding layers count the window from the index (not the position) of
    # the query, so with windows only chains the window does not cut are compared
    window = variant.get("layers", {}).get("sliding_window")
    for q in ([0, 1] if window else [3, 6, N - 3]):
        mine = chain_logits(head, target, feats, ids, q)
        for s in range(1, 3):
            np.testing.assert_allclose(mine[s], ref[s][q], atol=1e-4, rtol=0, err_msg=(name, q, s))
    # the greedy chain: speculators fed its own argmax (the token it drafted at q goes in
    # at q + 1, run again), ours drafted by the tree code with one child per level
    q = N - 4
    d2t = np.array(head.d2t) if "d2t" in head else np.zeros(head.draft_vocab_size, np.int64)
    theirs, fed = [], list(ids)
    for s in range(3):
        _, drafts = speculators_logits(model, feats, fed)
        d = int(drafts[s][q])
        theirs.append(d + int(d2t[d]))
        fed[q + 1 + s] = theirs[-1]
    tree = draft_dynamic(head, target, head.make_cache(), mx.array(feats[: q + 1]),
                         mx.array(ids[: q + 1]), mx.array(ids[q]), total_tokens=4, depth=2,
                         top_k=1)
    assert np.array(tree.tokens)[1:].tolist() == theirs


def test_speculators_heads_decode_as_plain(tmp_path, target_dir):
    """Greedy EAGLE with speculators heads (several flags, Qwen3 layers, a draft
    vocabulary, its own tap ids) = transformers' greedy, over three trees."""
    speculators_or_skip()
    for name in ("two_layers_qwen3", "draft_vocab+aux_ids"):
        make_speculators_head(tmp_path / name, target_dir, SPECULATORS_VARIANTS[name], seed=3)
        greedy_against_transformers(target_dir, tmp_path / name, TREES, prompt_lengths=(12, 25),
                                    n=24)


def _first_step_logits(head, target, feats, ids):
    out = head(mx.array(feats[None]), mx.array([ids]), target.embed_tokens, head.make_cache(),
               fed_back=False)
    return np.array(head.logits(out[0], target))


def _probe(head, target, seed=2, n=12):
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((n, head.feature_size)).astype(np.float32)
    return feats, rng.integers(3, target.vocab_size, n).tolist()


def test_speculators_head_of_its_targets_width_without_embedding_borrows_the_targets(
        tmp_path, target_dir):
    """A speculators head that names target_hidden_size equal to its own width and ships
    no embed_tokens (it drafts with the target's) loads, and its logits are speculators'."""
    speculators_or_skip()
    from safetensors.numpy import load_file, save_file

    tcfg = json.loads((target_dir / "config.json").read_text())
    folder = tmp_path / "head"
    model = make_speculators_head(folder, target_dir, dict(target_hidden_size=tcfg["hidden_size"]),
                                  seed=4)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["embed_tokens.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    assert config["target_hidden_size"] == tcfg["hidden_size"]
    target, _ = load_target(str(target_dir))
    head = load_head(str(folder), target)
    feats, ids = _probe(head, target)
    ref, _ = speculators_logits(model, feats, ids)  # (its embedding: a copy of the target's)
    np.testing.assert_allclose(_first_step_logits(head, target, feats, ids), ref[0], atol=1e-4,
                               rtol=0)


@pytest.mark.parametrize("name", ["two_layers_qwen3", "draft_vocab+aux_ids", "sliding_layers"])
def test_heads_written_in_the_speculators_layout_are_read_by_speculators(tmp_path, target_dir,
                                                                        name):
    """convert --layout speculators: speculators' own config class reads the config, its
    model takes every tensor (only the verifier's own weights are not in a head), and its
    forward gives the logits of the head it was written from; read back here, the same."""
    speculators_or_skip()
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    model = make_speculators_head(tmp_path / "head", target_dir, SPECULATORS_VARIANTS[name],
                                  seed=5)
    out = tmp_path / "written"
    from eagle_mlx.convert import main as convert

    assert convert(["--eagle", str(tmp_path / "head"), "--layout", "speculators",
                    "--model", str(target_dir), "--mlx-path", str(out)]) == 0
    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = Eagle3DraftModel(config)
    missing, unexpected = theirs.load_state_dict(load_file(str(out / "model.safetensors")),
                                                 strict=False)
    assert not unexpected and all(k.startswith("verifier_") for k in missing), missing
    theirs.eval()
    target, _ = load_target(str(target_dir))
    head = load_head(str(out), target)
    feats, ids = _probe(head, target)
    ref, _ = speculators_logits(model, feats, ids)
    written, _ = speculators_logits(theirs, feats, ids)
    np.testing.assert_allclose(written, ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(_first_step_logits(head, target, feats, ids), ref[0], atol=1e-4,
                               rtol=0)
    with torch.no_grad():
        assert torch.equal(theirs.embed_tokens.weight, model.embed_tokens.weight)


def test_the_speculators_layout_refuses_what_it_cannot_hold(tmp_path, target_dir, capsys):
    """An EAGLE-1 head, and -q (MLX's quantization), are refused in one sentence, nothing
    written."""
    from eagle_mlx.convert import main as convert

    head = make_eagle_head(tmp_path / "e1", target_dir, seed=6)
    for extra in ([], ["-q"]):
        out = tmp_path / f"out{len(extra)}"
        code = convert(["--eagle", str(head), "--layout", "speculators",
                        "--model", str(target_dir), "--mlx-path", str(out), *extra])
        err = capsys.readouterr().err.strip()
        assert code != 0 and "speculators" in err and "\n" not in err and not out.exists(), err


def write_specforge(official, out, aux_ids):
    """The same head as SpecForge writes it: flat config, eagle_config's aux ids (a layer's
    output), target_model_type; the official tensors."""
    out.mkdir()
    config = json.loads((official / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLMEagle3"], target_model_type="llama",
                  eagle_config={"eagle_aux_hidden_state_layer_ids": aux_ids})
    (out / "config.json").write_text(json.dumps(config))
    (out / "pytorch_model.bin").write_bytes((official / "pytorch_model.bin").read_bytes())
    return out


def write_modelopt(official, out, aux_ids, layers_config=None):
    """The same head as Model-Optimizer exports it: layers.0.*, d2t without t2d, no
    embedding, a nested eagle_config of its keys, safetensors."""
    import torch
    from safetensors.torch import save_file

    out.mkdir()
    sd = torch.load(official / "pytorch_model.bin")
    sd = {k.replace("midlayer.", "layers.0."): v.contiguous() for k, v in sd.items()
          if k not in ("t2d", "embed_tokens.weight")}
    save_file(sd, str(out / "model.safetensors"))
    src = json.loads((official / "config.json").read_text())
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_act": "silu", "tie_word_embeddings": False, "use_cache": True,
              "attention_bias": False, "mlp_bias": False, "head_dim": src["hidden_size"] // 4,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids,
                               "use_aux_hidden_state": True,
                               "use_input_layernorm_in_first_layer": True,
                               "use_last_layernorm": True, "use_mtp_layernorm": False,
                               "next_layer_regular": True, "parallel_draft_step": 1,
                               "parallel_draft_heads_num_layers": 1}}
    config.update({k: src[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads", "num_hidden_layers", "vocab_size",
                                       "draft_vocab_size", "rms_norm_eps", "rope_theta",
                                       "max_position_embeddings")})
    config.update(layers_config or {})
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_specforge_and_modelopt_layouts_equal_the_official_head(tmp_path, target_dir):
    """Both layouts of one head run exactly the official head's forward; their aux ids name
    a layer's output (id + 1 is the layer input this project taps), and greedy EAGLE with
    each = transformers' greedy."""
    official = make_eagle_head(tmp_path / "official", target_dir, "eagle3", seed=5,
                               draft_vocab_size=40)
    target, _ = load_target(str(target_dir))
    L = target.num_layers
    default = [t - 1 for t in target.eagle3_taps]  # the official taps, as output ids
    heads = {"official": load_head(str(official), target),
             "specforge": load_head(str(write_specforge(official, tmp_path / "sf", default)),
                                    target),
             "modelopt": load_head(str(write_modelopt(official, tmp_path / "mo", default)),
                                   target)}
    assert {k: h.layout for k, h in heads.items()} == {
        "official": "official EAGLE-3", "specforge": "SpecForge EAGLE-3",
        "modelopt": "NVIDIA Model-Optimizer EAGLE-3"}
    rng = np.random.default_rng(4)
    feats = mx.array(rng.standard_normal((1, 10, heads["official"].feature_size)), mx.float32)
    ids = mx.array(rng.integers(3, 64, (1, 10)))
    ref = None
    for name, head in heads.items():
        assert head.feature_taps(target) == target.eagle3_taps, name
        out = head(feats, ids, target.embed_tokens, head.make_cache(), fed_back=False)
        logits = np.array(head.to_target_ids(head.logits(out[0], target).argmax(-1)))
        full = np.array(head.logits(out[0], target))
        if ref is None:
            ref = (full, logits)
        else:
            np.testing.assert_array_equal(full, ref[0], err_msg=name)
            np.testing.assert_array_equal(logits, ref[1], err_msg=name)
    other = load_head(str(write_specforge(official, tmp_path / "sf2", [0, 3, L - 1])), target)
    assert other.feature_taps(target) == (1, 4, L)
    for name, folder in (("specforge", tmp_path / "sf2"), ("modelopt", tmp_path / "mo")):
        greedy_against_transformers(target_dir, folder, TREES, prompt_lengths=(12, 25), n=24)


def test_convert_reads_each_layout_and_says_which(tmp_path, target_dir, capsys):
    """`convert` names the layout, and the MLX folder it writes loads as the same head."""
    official = make_eagle_head(tmp_path / "official", target_dir, "eagle3", seed=6,
                               draft_vocab_size=40)
    src = write_modelopt(official, tmp_path / "mo", [1, 4, 7])
    from eagle_mlx.convert import main

    assert main(["--eagle", str(src), "--mlx-path", str(tmp_path / "mlx"),
                 "--model", str(target_dir), "--model-mlx-path", str(tmp_path / "t")]) == 0
    assert "NVIDIA Model-Optimizer EAGLE-3" in capsys.readouterr().out
    target, _ = load_target(str(target_dir))
    a, b = load_head(str(src), target), load_head(str(tmp_path / "mlx"), target)
    assert b.layout == a.layout and b.feature_taps(target) == a.feature_taps(target) == (2, 5, 8)
    feats = mx.array(np.random.default_rng(0).standard_normal((1, 6, a.feature_size)), mx.float32)
    ids = mx.array([[5, 9, 11, 3, 7, 8]])
    outs = [np.array(h.logits(h(feats, ids, target.embed_tokens, h.make_cache())[0], target))
            for h in (a, b)]
    np.testing.assert_array_equal(outs[0], outs[1])


def _edit(folder, out, change):
    import shutil

    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    change(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_bad_layouts_are_refused_in_one_sentence(tmp_path, target_dir):
    """An unknown speculators flag, a head made for another target family, Model-Optimizer
    settings this head does not run: one sentence naming the file and what is wrong."""
    official = make_eagle_head(tmp_path / "official", target_dir, "eagle3", seed=7)
    target, _ = load_target(str(target_dir))
    mo = write_modelopt(official, tmp_path / "mo", [1, 4, 7])
    cases = [
        (_edit(mo, tmp_path / "mo_par", lambda c: c["eagle_config"].update(parallel_draft_step=3)),
         "parallel_draft_step 3"),
        (_edit(mo, tmp_path / "mo_key", lambda c: c["eagle_config"].update(use_dflash=True)),
         '"use_dflash"'),
        (_edit(mo, tmp_path / "mo_aux", lambda c: c["eagle_config"].update(
            eagle_aux_hidden_state_layer_ids=[1, 4, 30])), "reads target layer 31"),
        (_edit(write_specforge(official, tmp_path / "sf", [1, 3, 4]), tmp_path / "sf_qwen",
               lambda c: c.update(target_model_type="qwen3")), "made for a qwen3 target"),
    ]
    try:
        speculators_or_skip()
        make_speculators_head(tmp_path / "spec", target_dir, {}, seed=2)
        cases += [
            (_edit(tmp_path / "spec", tmp_path / "spec_flag", lambda c: c.update(norm_before_attn=True)),
             '"norm_before_attn"'),
            (_edit(tmp_path / "spec", tmp_path / "spec_gemma", lambda c: c["speculators_config"][
                "verifier"].update(architectures=["Gemma3ForCausalLM"])),
             "made for a Gemma3ForCausalLM target"),
        ]
    except pytest.skip.Exception:
        pass
    for folder, words in cases:
        with pytest.raises(EagleError) as e:
            eagle_mlx.load(str(target_dir), eagle=str(folder))
        message = str(e.value)
        assert words in message and "\n" not in message, (folder.name, message)
        assert str(folder) in message or folder.name in message, message
