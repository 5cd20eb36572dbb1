"""Draft heads and the converter: oracle unit vectors, every published layout against a
float64 NumPy reference, and refusal of unsafe or broken checkpoints."""

import json
import os
import pickle
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from eagle_mlx import EagleError, load_target
from eagle_mlx.heads.read import load_head
from eagle_mlx.convert import main as convert_main
from tiny import ORACLE, oracle_reference, requires_oracle, tool

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------- the official fixture

@requires_oracle
@pytest.mark.parametrize("vectors", ["real", "random"])
def test_oracle_eagle1_unit_vectors(vectors):
    u = oracle_reference()["llama"]["eagle1_head"]["unit_vectors"][vectors]
    target, _ = load_target(str(ORACLE / "llama" / "target"))
    head = load_head(str(ORACLE / "llama" / "eagle1_head"), target)
    out = head(mx.array([u["hidden_states"]]), mx.array([u["input_ids"]]), target.embed_tokens)
    np.testing.assert_allclose(np.array(out[0]), u["out_hidden"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.array(head.logits(out, target)[0]), u["logits"], atol=1e-4, rtol=0)


@requires_oracle
def test_oracle_eagle3_unit_vectors():
    ref = oracle_reference()["llama"]["eagle3_head"]
    target, _ = load_target(str(ORACLE / "llama" / "target"))
    head = load_head(str(ORACLE / "llama" / "eagle3_head"), target)
    assert np.array(head.d2t).tolist() == ref["d2t"]
    feats = mx.array([ref["unit_vectors"]["pass1"]["hidden_states"]])
    for name in ["pass1", "pass2"]:
        u = ref["unit_vectors"][name]
        # pass 2 feeds pass 1's output back: width H, so fc is skipped
        out = head(feats, mx.array([u["input_ids"]]), target.embed_tokens)
        logits = head.logits(out, target)[0]
        np.testing.assert_allclose(np.array(out[0]), u["out_hidden"], atol=1e-4, rtol=0)
        np.testing.assert_allclose(np.array(logits), u["draft_logits"], atol=1e-4, rtol=0)
        assert np.array(logits.argmax(-1)).tolist() == u["draft_argmax"]
        assert np.array(head.to_target_ids(logits.argmax(-1))).tolist() == u["target_ids"]
        feats = out


@requires_oracle
def test_eagle3_taps_of_the_oracle_target_are_the_fixture_ones():
    ref = oracle_reference()["llama"]["eagle3_head"]
    target, _ = load_target(str(ORACLE / "llama" / "target"))
    assert list(target.eagle3_taps) == ref["tap_layers_hf_hidden_states_index"]


# ------------------------------------------------------- published layouts, at small sizes

H, NH, NKV, I, V, VD = 32, 4, 2, 64, 50, 20


def head_config(kind, **extra):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV,
           "vocab_size": V, "rms_norm_eps": 1e-6, "num_hidden_layers": 1,
           "max_position_embeddings": 256}
    cfg.update(extra)
    return cfg


def eagle1_state(bias=True, embed=True, qkv_bias=False):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    sd = {"fc.weight": r(H, 2 * H)}
    if bias:
        sd["fc.bias"] = r(H)
    if embed:
        sd["embed_tokens.weight"] = r(V, H)
    p = "layers.0."
    sd.update({p + "self_attn.q_proj.weight": r(H, H), p + "self_attn.k_proj.weight": r(NKV * 8, H),
               p + "self_attn.v_proj.weight": r(NKV * 8, H), p + "self_attn.o_proj.weight": r(H, H),
               p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
               p + "mlp.down_proj.weight": r(H, I),
               p + "post_attention_layernorm.weight": 1 + r(H)})
    if qkv_bias:  # the Qwen2 heads (config "qkv_bias": true)
        sd.update({p + "self_attn.q_proj.bias": r(H), p + "self_attn.k_proj.bias": r(NKV * 8),
                   p + "self_attn.v_proj.bias": r(NKV * 8)})
    return sd


TW = 48  # the target width of an EAGLE-3 head narrower than its target


def eagle3_state(d2t=True, target_width=H):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    p = "midlayer."
    vd = VD if d2t else V
    sd = {"fc.weight": r(H, 3 * target_width), "norm.weight": 1 + r(H), "lm_head.weight": r(vd, H),
          p + "hidden_norm.weight": 1 + r(H), p + "input_layernorm.weight": 1 + r(H),
          p + "post_attention_layernorm.weight": 1 + r(H),
          p + "self_attn.q_proj.weight": r(H, 2 * H), p + "self_attn.k_proj.weight": r(NKV * 8, 2 * H),
          p + "self_attn.v_proj.weight": r(NKV * 8, 2 * H), p + "self_attn.o_proj.weight": r(H, H),
          p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
          p + "mlp.down_proj.weight": r(H, I)}
    if target_width != H:  # its own embedding, of its own width
        sd["embed_tokens.weight"] = r(V, H)
    if d2t:
        chosen = torch.sort(torch.randperm(V, generator=g)[:VD]).values
        sd["d2t"] = (chosen - torch.arange(VD)).long()
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[chosen] = True
        sd["t2d"] = t2d
    return sd


def write_head(folder: Path, sd, config, fmt="bin", dtype=torch.float32):
    folder.mkdir(parents=True)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    if fmt == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# float64 NumPy reference of the heads, written from the math in docs/eagle.md

def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = np.concatenate([pos[:, None] * inv] * 2, axis=-1)
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def _attention(x, w, prefix, theta):
    n = x.shape[0]
    D = H // NH
    def proj(name, heads):
        y = x @ w[prefix + name + ".weight"].T + w.get(prefix + name + ".bias", 0)
        return y.reshape(n, heads, D).transpose(1, 0, 2)

    q, k, v = proj("q_proj", NH), proj("k_proj", NKV), proj("v_proj", NKV)
    pos = np.arange(n, dtype=np.float64)
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    k, v = np.repeat(k, NH // NKV, 0), np.repeat(v, NH // NKV, 0)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(D)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ v).transpose(1, 0, 2).reshape(n, H)
    return o @ w[prefix + "o_proj.weight"].T


def _mlp(x, w, prefix):
    g = x @ w[prefix + "gate_proj.weight"].T
    return (g / (1 + np.exp(-g)) * (x @ w[prefix + "up_proj.weight"].T)) @ w[prefix + "down_proj.weight"].T


def eagle1_reference(w, embed, feats, ids, theta):
    x = np.concatenate([embed[ids], feats], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
    h = x + _attention(x, w, "layers.0.self_attn.", theta)
    return h + _mlp(_rms(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.mlp.")


def eagle3_reference(w, embed, feats, ids, theta):
    p = "midlayer."
    h = feats @ w["fc.weight"].T
    a = np.concatenate([_rms(embed[ids], w[p + "input_layernorm.weight"]),
                        _rms(h, w[p + "hidden_norm.weight"])], -1)
    h = h + _attention(a, w, p + "self_attn.", theta)
    out = h + _mlp(_rms(h, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
    return out, _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


LAYOUTS = {
    # name: (kind, state, config extras, file format, saved dtype)
    "eagle1_f32_bias": ("eagle1", lambda: eagle1_state(bias=True), {"bias": True}, "bin", torch.float32),
    "eagle1_f16_nobias_theta5e5": ("eagle1", lambda: eagle1_state(bias=False),
                                   {"bias": False, "rope_theta": 500000.0}, "bin", torch.float16),
    "eagle1_bf16": ("eagle1", lambda: eagle1_state(bias=True), {}, "bin", torch.bfloat16),
    "eagle3_d2t": ("eagle3", lambda: eagle3_state(d2t=True), {"draft_vocab_size": VD}, "bin", torch.float16),
    "eagle3_full_vocab": ("eagle3", lambda: eagle3_state(d2t=False), {"draft_vocab_size": V}, "bin", torch.float16),
    "eagle1_safetensors": ("eagle1", lambda: eagle1_state(bias=True), {"bias": True}, "safetensors", torch.float32),
    "eagle1_qkv_bias_qwen2": ("eagle1", lambda: eagle1_state(bias=True, qkv_bias=True),
                              {"bias": True, "qkv_bias": True, "rope_theta": 1e6}, "bin", torch.float32),
    "eagle3_narrow_qwen3": ("eagle3", lambda: eagle3_state(d2t=True, target_width=TW),
                            {"draft_vocab_size": VD, "target_hidden_size": TW}, "safetensors",
                            torch.float32),
}


class FakeTarget:
    """The target-side pieces a head uses: its embedding and lm_head."""

    def __init__(self, embed, layers=8):
        import mlx.nn as nn

        self.embed_tokens = nn.Embedding(*embed.shape)
        self.embed_tokens.weight = mx.array(embed.astype(np.float32))
        self.hidden_size, self.vocab_size, self.num_layers, self.path = embed.shape[1], V, layers, "target"
        self.model_type = "llama"

    def lm_head(self, h):
        return self.embed_tokens.as_linear(h)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_published_layouts_convert_and_match_numpy(tmp_path, layout):
    kind, make, extra, fmt, dtype = LAYOUTS[layout]
    sd = make()
    src = write_head(tmp_path / "src", sd, head_config(kind, **extra), fmt, dtype)
    # what the file holds, in float64 (so the reference sees the same rounded weights)
    w = {k: v.to(dtype).double().numpy() if v.is_floating_point() else v.numpy() for k, v in sd.items()}
    rng = np.random.default_rng(0)
    embed = w.get("embed_tokens.weight", rng.normal(size=(V, H)))
    theta = extra.get("rope_theta", 10000.0)
    width = extra.get("target_hidden_size", H)  # the target's hidden size
    target_embed = embed if width == H else rng.normal(size=(V, width))

    # default conversion keeps the saved dtype; float32 conversion is checked numerically
    assert convert_main(["--eagle", str(src), "--mlx-path", str(tmp_path / "kept")]) == 0
    saved = mx.load(str(tmp_path / "kept" / "model.safetensors"))
    want = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}[dtype]
    assert saved["fc.weight"].dtype == want
    # the target's embedding is not kept (a narrower EAGLE-3 head's own one is)
    assert ("embed_tokens.weight" in saved) == (width != H) and "t2d" not in saved
    assert convert_main(["--eagle", str(src), "--mlx-path", str(tmp_path / "f32"),
                         "--dtype", "float32"]) == 0
    target = FakeTarget(target_embed)
    head = load_head(str(tmp_path / "f32"), target)
    assert head.kind == kind
    cfg = json.loads((tmp_path / "f32" / "config.json").read_text())
    assert cfg["eagle"]["kind"] == kind

    n = 9
    ids = rng.integers(0, V, n)
    if kind == "eagle1":
        feats = rng.normal(size=(n, H))
        out = head(mx.array(feats[None], dtype=mx.float32), mx.array(ids[None]), target.embed_tokens)
        ref = eagle1_reference(w, embed, feats, ids, theta)
        np.testing.assert_allclose(np.array(out[0]), ref, atol=1e-4, rtol=0)
    else:
        feats = rng.normal(size=(n, 3 * width))
        out = head(mx.array(feats[None], dtype=mx.float32), mx.array(ids[None]), target.embed_tokens)
        ref_out, ref_logits = eagle3_reference(w, embed, feats, ids, theta)
        np.testing.assert_allclose(np.array(out[0]), ref_out, atol=1e-4, rtol=0)
        logits = head.logits(out, target)[0]
        np.testing.assert_allclose(np.array(logits), ref_logits, atol=1e-4, rtol=0)
        d = logits.argmax(-1)
        expect = np.array(d) + (w["d2t"][np.array(d)] if "d2t" in w else 0)
        assert np.array(head.to_target_ids(d)).tolist() == expect.tolist()
    # the in-memory conversion of the unconverted folder gives the same head
    direct = load_head(str(src), target)
    if dtype == torch.float32:
        out2 = direct(mx.array(feats[None], dtype=mx.float32), mx.array(ids[None]), target.embed_tokens)
        np.testing.assert_allclose(np.array(out2), np.array(out), atol=1e-6)


def test_quantized_head_converts_and_stays_close(tmp_path):
    sd = eagle1_state()
    src = write_head(tmp_path / "src", sd, head_config("eagle1", bias=True))
    assert convert_main(["--eagle", str(src), "--mlx-path", str(tmp_path / "q"), "-q",
                         "--q-bits", "8", "--q-group-size", "32"]) == 0
    target = FakeTarget(sd["embed_tokens.weight"].numpy())
    q, f = load_head(str(tmp_path / "q"), target), load_head(str(src), target)
    feats = mx.random.normal((1, 7, H))
    ids = mx.array([[3, 4, 5, 6, 7, 8, 9]])
    a, b = q(feats, ids, target.embed_tokens), f(feats, ids, target.embed_tokens)
    rel = float(mx.linalg.norm(a - b) / mx.linalg.norm(b))
    assert rel < 0.02, rel


# ------------------------------------------------------------------- refusals and errors

def _no_output(tmp_path, out):
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_pickle_that_calls_a_function_is_refused(tmp_path):
    src = write_head(tmp_path / "src", eagle1_state(), head_config("eagle1"))
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bin_path = src / "pytorch_model.bin"
    with zipfile.ZipFile(bin_path) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in entries if n.endswith("data.pkl"))
    entries[pkl] = pickle.dumps({"fc.weight": Payload()}, protocol=2)
    with zipfile.ZipFile(bin_path, "w") as z:
        for n, data in entries.items():
            z.writestr(n, data)
    out = tmp_path / "out"
    with pytest.raises(EagleError, match=r"refers to the Python global '(posix|os|nt)\.system'"):
        _raise_from_main(src, out)
    assert not marker.exists()
    _no_output(tmp_path, out)


def _raise_from_main(src, out):
    from eagle_mlx.convert import _main

    _main(["--eagle", str(src), "--mlx-path", str(out)])


def test_truncated_checkpoint_is_one_sentence(tmp_path):
    src = write_head(tmp_path / "src", eagle1_state(), head_config("eagle1"))
    data = (src / "pytorch_model.bin").read_bytes()
    (src / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    proc = tool("convert", "--eagle", src, "--mlx-path", out)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "truncated" in proc.stderr
    _no_output(tmp_path, out)


def test_wrong_shaped_tensor(tmp_path):
    sd = eagle1_state()
    sd["layers.0.mlp.up_proj.weight"] = torch.zeros(I + 1, H)
    src = write_head(tmp_path / "src", sd, head_config("eagle1"))
    out = tmp_path / "out"
    with pytest.raises(EagleError, match=r"layers.0.mlp.up_proj.weight .* shape \(65, 32\).* \(64, 32\)"):
        _raise_from_main(src, out)
    _no_output(tmp_path, out)


def test_missing_and_unexpected_keys_are_named(tmp_path):
    sd = eagle1_state()
    del sd["layers.0.self_attn.o_proj.weight"]
    sd["layers.0.input_layernorm.weight"] = torch.ones(H)
    src = write_head(tmp_path / "src", sd, head_config("eagle1"))
    with pytest.raises(EagleError, match=r"missing keys layers.0.self_attn.o_proj.weight; "
                                         r"unexpected keys layers.0.input_layernorm.weight"):
        load_head(str(src))


def test_head_that_does_not_fit_the_target(tmp_path, tiny_dir):
    target, _ = load_target(str(tiny_dir("llama2_mha")))  # hidden 64, vocab 256, 4 layers
    src = write_head(tmp_path / "e1", eagle1_state(), head_config("eagle1"))
    with pytest.raises(EagleError, match=r"hidden size 32, but target .* hidden size 64"):
        load_head(str(src), target)
    sd = eagle3_state()
    src3 = write_head(tmp_path / "e3", sd, head_config("eagle3", draft_vocab_size=VD))
    small = FakeTarget(np.zeros((V, H)), layers=6)
    with pytest.raises(EagleError, match=r"at least 7 layers, but target .* has 6"):
        load_head(str(src3), small)
    src_v = write_head(tmp_path / "e1v", eagle1_state(), head_config("eagle1", vocab_size=V + 1))
    with pytest.raises(EagleError, match=r"embed_tokens.weight .* shape \(50, 32\).* vocab 51"):
        load_head(str(src_v))


def test_convert_with_model_validates_and_converts_the_target(tmp_path, tiny_dir):
    target_dir = tiny_dir("llama2_mha")
    # an EAGLE-1 head sized for the target: hidden 64, vocab 256, 4 heads of 16 (kv 4)
    cfg = head_config("eagle1", hidden_size=64, vocab_size=256, num_key_value_heads=4)
    sd = {"fc.weight": torch.randn(64, 128) * 0.1, "fc.bias": torch.zeros(64),
          "embed_tokens.weight": torch.randn(256, 64),
          **{f"layers.0.self_attn.{n}_proj.weight": torch.randn(64, 64) * 0.1 for n in "qkvo"},
          "layers.0.mlp.gate_proj.weight": torch.randn(I, 64) * 0.1,
          "layers.0.mlp.up_proj.weight": torch.randn(I, 64) * 0.1,
          "layers.0.mlp.down_proj.weight": torch.randn(64, I) * 0.1,
          "layers.0.post_attention_layernorm.weight": torch.ones(64)}
    src = write_head(tmp_path / "src", sd, cfg)
    out = tmp_path / "head"
    assert convert_main(["--eagle", str(src), "--mlx-path", str(out), "--model", str(target_dir),
                         "-q", "--q-bits", "8", "--q-group-size", "32"]) == 0
    converted = tmp_path / "head-target"
    assert json.loads((converted / "config.json").read_text())["quantization"]["bits"] == 8
    target, _ = load_target(str(converted))
    head = load_head(str(out), target)
    assert head.kind == "eagle1"


def test_qwen_heads_and_llama_targets_do_not_mix(tmp_path, tiny_dir):
    """A Qwen2 EAGLE-1 head (qkv_bias, a Qwen config) on a Llama target and a Llama head on a
    Qwen target are refused, naming both sides."""
    llama, _ = load_target(str(tiny_dir("llama2_mha")))   # hidden 64, vocab 256
    qwen, _ = load_target(str(tiny_dir("qwen2")))         # hidden 64, vocab 256
    cfg = head_config("eagle1", hidden_size=64, vocab_size=256, num_key_value_heads=4,
                      model_type="qwen2", architectures=["Qwen2ForCausalLM"], qkv_bias=True)
    g = torch.Generator().manual_seed(3)
    sd = {"fc.weight": torch.randn(64, 128, generator=g) * 0.1, "fc.bias": torch.zeros(64),
          **{f"layers.0.self_attn.{n}_proj.weight": torch.randn(64, 64, generator=g) * 0.1
             for n in "qkvo"},
          **{f"layers.0.self_attn.{n}_proj.bias": torch.zeros(64) for n in "qkv"},
          "layers.0.mlp.gate_proj.weight": torch.randn(I, 64, generator=g) * 0.1,
          "layers.0.mlp.up_proj.weight": torch.randn(I, 64, generator=g) * 0.1,
          "layers.0.mlp.down_proj.weight": torch.randn(64, I, generator=g) * 0.1,
          "layers.0.post_attention_layernorm.weight": torch.ones(64)}
    src = write_head(tmp_path / "qwen_head", sd, cfg)
    assert load_head(str(src), qwen).args.qkv_bias  # fits its own target
    with pytest.raises(EagleError, match=r"made for a qwen2 target .* but target .* is llama"):
        load_head(str(src), llama)
    # a Llama head on a Qwen target whose vocabulary differs (as real Qwen and Llama ones do)
    llama_head = write_head(tmp_path / "llama_head", eagle1_state(), head_config("eagle1"))
    small_qwen = FakeTarget(np.zeros((V + 14, H)))
    small_qwen.vocab_size, small_qwen.model_type = V + 14, "qwen2"
    with pytest.raises(EagleError, match=r"\(eagle1\) has vocab size 50, but target .* \(qwen2\) "
                                         r"has vocab size 64"):
        load_head(str(llama_head), small_qwen)
