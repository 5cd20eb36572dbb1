"""The MTP module of Qwen3.5 (dense, MoE) and Qwen3-Next checkpoints as a draft head:
against a reference made of transformers' own decoder-layer and norm classes, read from
only the shard that holds it, and lossless as a tree drafter."""

import builtins
import json

import mlx.core as mx
import numpy as np
import pytest

import eagle_mlx
from conftest import HYBRID_TARGETS, make_hybrids
from eagle_mlx.heads.read import load_head
from eagle_mlx.errors import EagleError
from eagle_mlx.targets.load import load_target
from test_windows import chi_square_against_transformers, greedy_against_transformers, hf_model
from tiny import make_hf_model

NAMES = list(HYBRID_TARGETS)
TREES = [dict(total_tokens=8, depth=2, draft_top_k=2), dict(total_tokens=20, depth=5, draft_top_k=3),
         dict(total_tokens=2, depth=1, draft_top_k=1)]


def add_mtp(folder, seed=0, layers=1):
    """Give a saved transformers checkpoint an MTP module as the Qwen checkpoints carry it:
    `mtp.*` tensors (HF names, zero-centred norms, experts one tensor each) shaped like its
    full-attention layer, in a shard of their own, the model's tensors in two more, and a
    safetensors index naming all three."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    full = config["layer_types"].index("full_attention")
    sd = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    H = config["hidden_size"]

    def rand(shape, norm=False):
        return (0.1 if norm else 0.2) * torch.randn(shape, generator=g)

    mtp = {"mtp.fc.weight": rand((H, 2 * H)), "mtp.norm.weight": rand((H,), True),
           "mtp.pre_fc_norm_embedding.weight": rand((H,), True),
           "mtp.pre_fc_norm_hidden.weight": rand((H,), True)}
    prefix = f"model.layers.{full}."
    for i in range(layers):
        for k, v in sd.items():
            if not k.startswith(prefix):
                continue
            rest = k[len(prefix):]
            if rest.endswith("experts.gate_up_proj"):  # one tensor per expert, as on the Hub
                base = rest[: -len("gate_up_proj")]
                inter = v.shape[1] // 2
                for e in range(v.shape[0]):
                    mtp[f"mtp.layers.{i}.{base}{e}.gate_proj.weight"] = rand((inter, v.shape[2]))
                    mtp[f"mtp.layers.{i}.{base}{e}.up_proj.weight"] = rand((inter, v.shape[2]))
            elif rest.endswith("experts.down_proj"):
                base = rest[: -len("down_proj")]
                for e in range(v.shape[0]):
                    mtp[f"mtp.layers.{i}.{base}{e}.down_proj.weight"] = rand(tuple(v.shape[1:]))
            else:
                mtp[f"mtp.layers.{i}.{rest}"] = rand(tuple(v.shape), v.ndim == 1)
    keys = sorted(sd)
    shards = {"model-00001-of-00003.safetensors": {k: sd[k] for k in keys[: len(keys) // 2]},
              "model-00002-of-00003.safetensors": {k: sd[k] for k in keys[len(keys) // 2:]},
              "model-00003-of-00003.safetensors": mtp}
    for name, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name),
                  metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: name for name, t in shards.items() for k in t}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config["mtp_num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def mtp_targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for name, folder in make_hybrids(root, seed=31).items():
        out[name] = add_mtp(folder, seed=5)
    return out


class Reference:
    """The MTP forward from transformers' classes: the model's embedding, its RMSNorm
    (zero-centred) before fc, its full-attention decoder layer, its final norm, its
    rotary embedding and lm_head; weights straight from the checkpoint's `mtp.*`."""

    def __init__(self, folder):
        import importlib

        import torch
        from safetensors.torch import load_file

        self.model = hf_model(folder)
        config = self.model.config
        text = type(self.model).__name__.replace("ForCausalLM", "")  # Qwen3_5, Qwen3Next, ...
        module = importlib.import_module(type(self.model).__module__)
        mtp = {k[4:]: v for k, v in
               load_file(str(folder / "model-00003-of-00003.safetensors")).items()}
        full = config.layer_types.index("full_attention")
        self.layer = getattr(module, f"{text}DecoderLayer")(config, full).eval()
        state = {}
        for k in self.layer.state_dict():
            if k.endswith("experts.gate_up_proj"):
                base = k[: -len("gate_up_proj")]
                E = config.num_experts
                state[k] = torch.stack([torch.cat([mtp[f"layers.0.{base}{e}.gate_proj.weight"],
                                                   mtp[f"layers.0.{base}{e}.up_proj.weight"]])
                                        for e in range(E)])
            elif k.endswith("experts.down_proj"):
                base = k[: -len("down_proj")]
                state[k] = torch.stack([mtp[f"layers.0.{base}{e}.down_proj.weight"]
                                        for e in range(config.num_experts)])
            else:
                state[k] = mtp[f"layers.0.{k}"]
        self.layer.load_state_dict(state)
        norm = getattr(module, f"{text}RMSNorm")
        self.norms = {}
        for k in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
            n = norm(config.hidden_size, eps=config.rms_norm_eps)
            n.load_state_dict({"weight": mtp[f"{k}.weight"]})
            self.norms[k] = n.eval()
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.fc.load_state_dict({"weight": mtp["fc.weight"]})
        self.mrope = type(self.model.model.rotary_emb).__name__.startswith("Qwen3_5")

    def target_hidden(self, ids):
        import torch

        with torch.no_grad():
            return self.model.model(torch.tensor([ids])).last_hidden_state  # post-norm

    def __call__(self, hidden, ids):
        """hidden [1, T, H] paired with tokens ids [T] -> (normed output, logits)."""
        import torch

        T = len(ids)
        with torch.no_grad():
            e = self.model.model.embed_tokens(torch.tensor([ids]))
            x = self.fc(torch.cat([self.norms["pre_fc_norm_embedding"](e),
                                   self.norms["pre_fc_norm_hidden"](hidden)], dim=-1))
            pos = torch.arange(T)[None]
            rope_pos = pos[None].expand(3, 1, T) if self.mrope else pos
            emb = self.model.model.rotary_emb(x, rope_pos)
            mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
            x = self.layer(x, position_embeddings=emb, attention_mask=mask, position_ids=pos)
            out = self.norms["norm"](x)
            return out, self.model.lm_head(out)


@pytest.mark.parametrize("name", NAMES)
def test_mtp_forward_matches_transformers_classes(mtp_targets, name):
    """The first-level logits at every position, and a drafted chain fed the module's own
    output at explicit positions (the tree path), within 1e-4 of the reference."""
    folder = mtp_targets[name]
    target, _ = load_target(str(folder))
    head = load_head(str(folder), target)
    assert head.kind == "mtp" and head.feature_taps(target) == ()
    ref = Reference(folder)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 64, 14).tolist()
    # pairs (hidden at position i, token i+1): the features the target hands the drafter
    hidden = ref.target_hidden(ids)
    h_mine, _ = target(mx.array([ids]))
    np.testing.assert_allclose(np.array(h_mine[0]), hidden[0].numpy(), atol=1e-4, rtol=0)
    m = len(ids) - 1
    out, logits = ref(hidden[:, :m], ids[1:])
    mine = head(h_mine[:, :m], mx.array([ids[1:]]), target.embed_tokens, head.make_cache(),
                fed_back=False)
    np.testing.assert_allclose(np.array(head.logits(mine[0], target)), logits[0].numpy(),
                               atol=1e-4, rtol=0)
    # a chain of three drafted tokens after pair q: each level reads the module's own
    # output and attends to the real positions and its ancestors
    import torch

    q = 8
    chain = rng.integers(3, 64, 3).tolist()
    cache = head.make_cache()
    o = head(h_mine[:, : q + 1], mx.array([ids[1: q + 2]]), target.embed_tokens, cache,
             fed_back=False)[:, -1:]
    feed_h, feed_ids = hidden[:, : q + 1], ids[1: q + 2]
    last = out[:, q: q + 1]
    for d, tok in enumerate(chain):
        n = cache.offset
        o = head(o, mx.array([[tok]]), target.embed_tokens, cache, positions=mx.array([n]),
                 mask=mx.ones((1, n + 1), dtype=mx.bool_), fed_back=True)
        feed_h, feed_ids = torch.cat([feed_h, last], dim=1), feed_ids + [tok]
        r_out, r_logits = ref(feed_h, feed_ids)
        last = r_out[:, -1:]
        np.testing.assert_allclose(np.array(head.logits(o[0], target))[0],
                                   r_logits[0, -1].numpy(), atol=1e-4, rtol=0,
                                   err_msg=(name, d))


def test_only_the_shard_holding_mtp_is_read(mtp_targets, monkeypatch):
    folder = mtp_targets["qwen3_5"]
    target, _ = load_target(str(folder))
    opened = []
    real_open = builtins.open

    def recording_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", recording_open)
    head = load_head(str(folder), target)
    monkeypatch.undo()
    shards = sorted({p.rsplit("/", 1)[-1] for p in opened if p.endswith(".safetensors")})
    assert shards == ["model-00003-of-00003.safetensors"], opened
    assert head.layout == "qwen3_5_text MTP module"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_eagle_with_the_mtp_module_equals_transformers_greedy(mtp_targets, name):
    greedy_against_transformers(mtp_targets[name], mtp_targets[name], TREES,
                                prompt_lengths=(12, 25), n=24)


def test_convert_writes_the_mtp_module_as_a_small_head(mtp_targets, tmp_path, capsys):
    """`convert` writes the module alone; the folder loads as the same drafter."""
    from eagle_mlx.convert import main

    folder = mtp_targets["qwen3_5_moe"]
    assert main(["--eagle", str(folder), "--mlx-path", str(tmp_path / "mtp")]) == 0
    assert "MTP module" in capsys.readouterr().out
    written = sum(p.stat().st_size for p in (tmp_path / "mtp").iterdir())
    assert written < (folder / "model-00003-of-00003.safetensors").stat().st_size * 1.1
    target, _ = load_target(str(folder))
    a, b = load_head(str(folder), target), load_head(str(tmp_path / "mtp"), target)
    h = mx.array(np.random.default_rng(1).standard_normal((1, 7, a.feature_size)), mx.float32)
    ids = mx.array([[4, 9, 17, 30, 5, 6, 7]])
    outs = [np.array(x.logits(x(h, ids, target.embed_tokens, x.make_cache())[0], target))
            for x in (a, b)]
    np.testing.assert_array_equal(outs[0], outs[1])
    greedy_against_transformers(folder, tmp_path / "mtp", TREES[:1], prompt_lengths=(12, 20),
                                n=16)


@pytest.mark.long
def test_sampling_with_the_mtp_module_is_lossless(mtp_targets):
    p = chi_square_against_transformers(mtp_targets["qwen3_5"], mtp_targets["qwen3_5"],
                                        [5, 17, 33, 8, 41, 12], runs=200)
    assert p > 1e-3, p


def test_bad_mtp_requests_are_refused_in_one_sentence(mtp_targets, tmp_path, tiny_dir):
    """A checkpoint without mtp.* (what mlx-lm's conversions leave), and an MTP module for
    another family."""
    plain = make_hf_model(tmp_path / "plain", "qwen3_5", seed=31, vocab_size=64, scale=4.0,
                          **HYBRID_TARGETS["qwen3_5"][1])
    with pytest.raises(EagleError) as e:
        eagle_mlx.load(str(plain), eagle=str(plain))
    assert "has no mtp.* tensors" in str(e.value) and str(plain) in str(e.value)
    with pytest.raises(EagleError) as e:
        eagle_mlx.load(str(mtp_targets["qwen3_5"]), eagle=str(mtp_targets["qwen3_next"]))
    message = str(e.value)
    assert "qwen3_next" in message and "\n" not in message, message


def test_a_hub_repo_downloads_only_the_config_index_and_mtp_shard(mtp_targets, tmp_path,
                                                                    monkeypatch):
    """`eagle="org/repo"`: the Hub is asked for the config and index first, then for the
    shard the index names for mtp.* alone (the fake Hub copies only what the patterns
    allow, as snapshot_download does)."""
    import fnmatch
    import shutil

    import huggingface_hub

    folder = mtp_targets["qwen3_next"]
    target, _ = load_target(str(folder))
    asked = []

    def fake_download(repo, allow_patterns=None):
        asked.append(list(allow_patterns))
        out = tmp_path / "snapshot"
        out.mkdir(exist_ok=True)
        for f in folder.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, out / f.name)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    head = load_head("Qwen/Qwen3-Next-tiny", target)
    assert asked[0] == ["config.json", "model.safetensors.index.json"]
    assert sorted(asked[1]) == sorted(["config.json", "model.safetensors.index.json",
                                       "model-00003-of-00003.safetensors"])
    assert sorted(p.name for p in (tmp_path / "snapshot").iterdir()) == sorted(asked[1])
    assert head.kind == "mtp"
