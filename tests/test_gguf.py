"""GGUF targets against transformers' own GGUF loader and the `gguf` package's dequantization.

The files are written here with the PyPI `gguf` package the way llama.cpp's converter
writes them (tensor names, permuted Q/K rows, ggml types, vocabulary metadata).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from eagle_mlx import load_target
from gguf_files import (CHATML, CORPUS, SPECIALS, train_gpt2_vocab, train_spm_vocab,
                        write_gguf, write_gpt_oss_gguf)
from tiny import make_hf_model, tool

gguf = pytest.importorskip("gguf", reason="the gguf package (test extra) is not installed")


@pytest.fixture(scope="module")
def gpt2_vocab():
    return train_gpt2_vocab()


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory, gpt2_vocab):
    """Two tiny transformers Llamas sized to the BPE vocabulary: GQA with tied
    embeddings, and MHA with an untied lm_head."""
    v = len(gpt2_vocab[0])
    return {
        "tied": make_hf_model(tmp_path_factory.mktemp("hf_tied"), vocab_size=v, num_hidden_layers=3,
                              num_key_value_heads=2, tie_word_embeddings=True, rope_theta=100000.0),
        "untied": make_hf_model(tmp_path_factory.mktemp("hf_untied"), vocab_size=v,
                                num_hidden_layers=2),
    }


def hf_from_gguf(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def hf_tokenizer_from_gguf(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def ids_of(encoded):
    """Token ids from apply_chat_template (transformers 5 returns a BatchEncoding)."""
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])


def compare_with_transformers(path, atol=1e-4):
    import torch

    target, _ = load_target(str(path))
    ids = np.random.default_rng(0).integers(3, target.vocab_size, 24).tolist()
    ref = hf_from_gguf(path)
    with torch.no_grad():
        out = ref(torch.tensor([ids]), output_hidden_states=True)
    h, tapped = target(mx.array([ids]), taps=tuple(range(target.num_layers)))
    np.testing.assert_allclose(np.array(target.lm_head(h))[0], out.logits[0].numpy(), atol=atol, rtol=0)
    for i, t in enumerate(tapped):
        np.testing.assert_allclose(np.array(t)[0], out.hidden_states[i][0].numpy(), atol=atol, rtol=0)
    return target, ref


@pytest.mark.parametrize("kind,ftype", [("tied", "F32"), ("untied", "F32"), ("tied", "F16"),
                                        ("untied", "BF16")])
def test_float_gguf_matches_transformers(tmp_path, hf_folders, gpt2_vocab, kind, ftype):
    path = write_gguf(tmp_path / f"{kind}-{ftype}.gguf", hf_folders[kind], "gpt2",
                      default=ftype, gpt2_vocab=gpt2_vocab)
    target, _ = compare_with_transformers(path)
    assert target.config["tie_word_embeddings"] == (kind == "tied")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_matches_transformers(tmp_path, gpt2_vocab, arch):
    """Qwen2 (q/k/v bias) and Qwen3 (q/k norms, explicit head_dim, tied) GGUFs, with a
    quantized mix, against transformers' GGUF loader."""
    v = len(gpt2_vocab[0])
    # transformers' GGUF reader leaves Qwen3's head_dim at its default, 128 (ours reads the
    # file's attention.key_length), so the test model has heads of 128
    extra = {"tie_word_embeddings": True, "head_dim": 128} if arch == "qwen3" else {}
    folder = make_hf_model(tmp_path / arch, arch, vocab_size=v, num_hidden_layers=2,
                           num_key_value_heads=2, rope_theta=1e6, **extra)
    path = write_gguf(tmp_path / f"{arch}.gguf", folder, "gpt2", gpt2_vocab=gpt2_vocab,
                      pre="qwen2", arch=arch)
    target, _ = compare_with_transformers(path)
    assert target.model_type == arch
    # the same file with Q8_0 matmul weights stays quantized and close to the float one
    q8 = write_gguf(tmp_path / f"{arch}-q8.gguf", folder, "gpt2", gpt2_vocab=gpt2_vocab,
                    pre="qwen2", arch=arch, default="Q8_0")
    compare_with_transformers(q8, atol=1e-3)


QUANT_MIX = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0",
             "attn_output": "Q4_1", "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0",
             "output.weight": "Q4_0"}


def test_quantized_gguf_keeps_each_tensors_bits_and_dequantizes_exactly(tmp_path, hf_folders, gpt2_vocab):
    path = write_gguf(tmp_path / "mix.gguf", hf_folders["untied"], "gpt2", types=QUANT_MIX,
                      gpt2_vocab=gpt2_vocab)
    stored, _ = load_target(str(path), dtype="stored")
    attn, mlp = stored.layers[0].self_attn, stored.layers[0].mlp
    assert isinstance(stored.embed_tokens, nn.QuantizedEmbedding) and stored.embed_tokens.bits == 8
    assert (attn.q_proj.bits, attn.k_proj.bits, attn.v_proj.bits, attn.o_proj.bits) == (4, 4, 8, 4)
    assert (mlp.gate_proj.bits, mlp.up_proj.bits, mlp.down_proj.bits) == (4, 4, 8)
    assert stored.model.lm_head.bits == 4

    # dequantized (the CPU default) = the gguf package's own dequantization, bit for bit
    target, ref = compare_with_transformers(path)
    assert mx.default_device() == mx.cpu and target.dtype == mx.float32
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for _, m in target.model.named_modules())
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    ours = dict(__import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(target.model.parameters()))
    for gname, mname in [("token_embd.weight", "model.embed_tokens.weight"),
                         ("blk.1.attn_v.weight", "model.layers.1.self_attn.v_proj.weight"),
                         ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"),
                         ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
                         ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                         ("output.weight", "lm_head.weight")]:
        assert np.array_equal(np.array(ours[mname]), raw[gname].reshape(ours[mname].shape)), gname
    # the permuted Q/K rows come back in transformers' order, exactly
    ref_state = ref.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert np.array_equal(np.array(ours[name]), ref_state[name].numpy()), name

    # the stored (quantized) forward stays close to the dequantized one
    ids = mx.array([[5, 17, 42, 99, 7, 150]])
    a = np.array(stored.lm_head(stored(ids)[0]))
    b = np.array(target.lm_head(target(ids)[0]))
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-3


def _k_quant_bytes(qtype, rows, cols, rng):
    """Random blocks of a K-quant type with sane float16 super-block scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.0005, 0.003, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    T = gguf.GGMLQuantizationType
    if qtype in (T.Q6_K, T.Q3_K):  # ..., d last
        data[..., size - 2:] = scales[..., :2]
    else:  # d, dmin: last in Q2_K, first in Q4_K / Q5_K
        at = size - 4 if qtype == T.Q2_K else 0
        data[..., at: at + 4] = scales
    return data.reshape(rows, -1)


def _dequantized(value) -> np.ndarray:
    if isinstance(value, tuple):
        value = mx.dequantize(*value, group_size=32, bits=value[0].shape[-1] * 32 // (
            value[1].shape[-1] * 32))
    return np.array(value)


def test_k_quant_tensors_against_the_gguf_package(tmp_path):
    """Q4_K and Q5_K stay quantized (4- and 5-bit affine, groups of 32) and dequantize to
    exactly the gguf package's values; Q2_K, Q3_K and Q6_K (groups of 16) read as their
    exact values, or quantized to 8 bits within half a step of them."""
    from eagle_mlx.targets.gguf import read_header, read_tensor

    T = gguf.GGMLQuantizationType
    kinds = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for qtype in kinds:
        w.add_tensor(qtype.name, _k_quant_bytes(qtype, 8, 512, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, infos = read_header(tmp_path / "k.gguf")
    assert [t.type_name for t in infos] == [k.name for k in kinds]
    data = np.memmap(tmp_path / "k.gguf", dtype=np.uint8, mode="r")
    for t, ref in zip(infos, gguf.GGUFReader(str(tmp_path / "k.gguf")).tensors):
        expected = gguf.quants.dequantize(ref.data, ref.tensor_type).reshape(8, 512)
        value = read_tensor(data, t)
        assert isinstance(value, tuple), t.name
        bits = value[0].shape[-1] * 32 // 512
        if t.type_name in ("Q4_K", "Q5_K"):
            assert bits == {"Q4_K": 4, "Q5_K": 5}[t.type_name]
            ours = np.array(mx.dequantize(*value, group_size=32, bits=bits))
            np.testing.assert_array_equal(ours, expected, err_msg=t.name)
        else:
            assert bits == 8
            ours = np.array(mx.dequantize(*value, group_size=32, bits=8))
            half_step = np.repeat(np.array(value[1]), 32, axis=-1) / 2
            # half a step, and float32's rounding of the values themselves
            assert np.all(np.abs(ours - expected) <= half_step + np.abs(expected).max() * 1e-6), t.name
            exact = np.array(read_tensor(data, t, requantize=False))
            assert exact.dtype == np.float32
            np.testing.assert_array_equal(exact, expected, err_msg=t.name)


def _gemma3_folder(folder, v, **overrides):
    """A tiny transformers Gemma 3 as llama.cpp's Gemma 3 files describe it: every sixth
    layer global, queries scaled by the head size (256), window 8."""
    return make_hf_model(folder, "gemma3_text", vocab_size=v, num_hidden_layers=6,
                         num_key_value_heads=2, sliding_window=8, head_dim=256,
                         query_pre_attn_scalar=256, **overrides)


def test_gemma3_gguf_matches_transformers(tmp_path, gpt2_vocab):
    """A float Gemma 3 GGUF (norms stored as 1 + w, its own names for the four norms of a
    layer) and the same file in Q8_0/Q5_0: logits and hidden states of 24 tokens (three
    windows) against transformers' GGUF loader."""
    folder = _gemma3_folder(tmp_path / "g3", len(gpt2_vocab[0]))
    path = write_gguf(tmp_path / "g3.gguf", folder, "gpt2", gpt2_vocab=gpt2_vocab, arch="gemma3")
    target, _ = compare_with_transformers(path)
    assert target.model_type == "gemma3_text" and target.windows == [8] * 5 + [None]
    quantized = write_gguf(tmp_path / "g3-q.gguf", folder, "gpt2", gpt2_vocab=gpt2_vocab,
                           arch="gemma3", default="Q8_0", types={"ffn": "Q5_0"})
    compare_with_transformers(quantized, atol=1e-3)


def test_gemma3_k_quant_mix_stays_quantized_and_dequantizes_exactly(tmp_path, gpt2_vocab):
    """A Gemma 3 file mixing every kept type: as stored, each layer keeps its own bits (Q4_K
    4, Q5_K/Q5_0/Q5_1 5, Q8_0 8; Q6_K/Q3_K/Q2_K 8 from their values); in float32 (the CPU
    default) every weight equals the gguf package's dequantization and the logits equal
    transformers' from the same file."""
    from mlx.utils import tree_flatten

    T = gguf.GGMLQuantizationType
    folder = _gemma3_folder(tmp_path / "g3", len(gpt2_vocab[0]), hidden_size=256,
                            intermediate_size=512)
    rng = np.random.default_rng(2)
    shapes = {"blk.0.attn_output.weight": ("Q4_K", 256, 1024), "blk.1.ffn_up.weight": ("Q5_K", 512, 256),
              "blk.2.ffn_down.weight": ("Q6_K", 256, 512), "blk.3.ffn_gate.weight": ("Q3_K", 512, 256),
              "blk.4.attn_q.weight": ("Q2_K", 1024, 256)}
    raw = {n: (q, _k_quant_bytes(T[q], r, c, rng)) for n, (q, r, c) in shapes.items()}
    path = write_gguf(tmp_path / "mix.gguf", folder, "gpt2", gpt2_vocab=gpt2_vocab, arch="gemma3",
                      types={"token_embd": "Q8_0", "attn_v": "Q5_0", "attn_k": "Q5_1"}, raw=raw)
    stored, _ = load_target(str(path), dtype="stored")
    layers = stored.layers
    bits = [layers[0].self_attn.o_proj.bits, layers[1].mlp.up_proj.bits, layers[2].mlp.down_proj.bits,
            layers[3].mlp.gate_proj.bits, layers[4].self_attn.q_proj.bits,
            layers[0].self_attn.v_proj.bits, layers[0].self_attn.k_proj.bits, stored.embed_tokens.bits]
    assert bits == [4, 5, 8, 8, 8, 5, 5, 8]
    dense, ref = compare_with_transformers(path)
    ours = dict(tree_flatten(dense.model.parameters()))
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type in (T.F32, T.F16):
            continue
        name = {"token_embd.weight": "model.embed_tokens.weight"}.get(t.name) or \
            "model.layers.{}.{}.weight".format(t.name.split(".")[1], {
                "attn_output": "self_attn.o_proj", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "ffn_gate": "mlp.gate_proj"}[t.name.split(".")[2]])
        expected = gguf.quants.dequantize(t.data, t.tensor_type)
        np.testing.assert_array_equal(np.array(ours[name]), expected.reshape(ours[name].shape),
                                      err_msg=t.name)


def test_gpt_oss_gguf_with_mxfp4_experts(tmp_path, gpt2_vocab):
    """A gpt-oss file as llama.cpp writes it (MXFP4 experts, sinks, a window of 8 on every
    other layer, YaRN): as stored the experts stay MXFP4; in float32 they equal the `gguf`
    package's dequantization bit for bit, and the logits and hidden states of 24 tokens equal
    transformers' gpt-oss holding the file's values."""
    import torch
    from mlx.utils import tree_flatten
    from transformers import AutoModelForCausalLM

    folder = make_hf_model(tmp_path / "oss", "gpt_oss", vocab_size=len(gpt2_vocab[0]),
                           num_hidden_layers=2, num_key_value_heads=2, sliding_window=8,
                           intermediate_size=64)
    path = tmp_path / "oss.gguf"
    reference = write_gpt_oss_gguf(path, folder, gpt2_vocab)
    stored, _ = load_target(str(path), dtype="stored")
    experts = stored.layers[1].mlp.experts
    assert (experts.gate_proj.mode, experts.down_proj.mode) == ("mxfp4", "mxfp4")
    assert stored.windows == [8, None]
    target, _ = load_target(str(path))
    ours = dict(tree_flatten(target.model.parameters()))
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.MXFP4:
            i, kind = t.name.split(".")[1], t.name.split(".")[2][4:-5]  # ffn_<kind>_exps
            got = np.array(ours[f"model.layers.{i}.mlp.experts.{kind}_proj.weight"])
            expected = gguf.quants.dequantize(t.data, t.tensor_type)
            np.testing.assert_array_equal(got, expected.reshape(got.shape), err_msg=t.name)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in reference.items()})
    ids = np.random.default_rng(0).integers(3, target.vocab_size, 24).tolist()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    h, tapped = target(mx.array([ids]), taps=(0, 1))
    np.testing.assert_allclose(np.array(target.lm_head(h))[0], out.logits[0].numpy(), atol=1e-4, rtol=0)
    for k, t in enumerate(tapped):
        np.testing.assert_allclose(np.array(t[0]), out.hidden_states[k][0].numpy(), atol=1e-4, rtol=0)


def test_convert_writes_a_gguf_target_as_an_mlx_folder(tmp_path, hf_folders, gpt2_vocab):
    """`convert --model FILE.gguf` writes a folder mlx-lm itself loads: same quantized
    layers and bits, same logits, same tokenizer and chat template."""
    import mlx_lm

    path = write_gguf(tmp_path / "mix.gguf", hf_folders["tied"], "gpt2", types=QUANT_MIX,
                      gpt2_vocab=gpt2_vocab)
    out = tmp_path / "mlx"
    proc = tool("convert", "--model", path, "--mlx-path", out)
    assert proc.returncode == 0, proc.stderr
    model, tok = mlx_lm.load(str(out))
    ours, our_tok = load_target(str(path), dtype="stored")
    assert model.model.layers[0].self_attn.q_proj.bits == 4
    assert model.model.layers[0].self_attn.v_proj.bits == 8
    ids = [3, 50, 120, 7, 260, 33]
    np.testing.assert_array_equal(np.array(model(mx.array([ids]))),
                                  np.array(ours.lm_head(ours(mx.array([ids]))[0])))
    for s in sample_strings(40):
        assert tok.encode(s) == our_tok.encode(s), s
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == \
        our_tok.apply_chat_template(msgs, add_generation_prompt=True)


# ------------------------------------------------------------------------- tokenizers

def sample_strings(n=240):
    """Strings a tokenizer gets wrong first: digits, Unicode, code, whitespace runs,
    special tokens in the text, empty and one-character strings."""
    rng = np.random.default_rng(7)
    words = CORPUS.split() + ["", " ", "  ", "\n", "\n\n", "\t", "   x", "x   ", "1", "22", "333",
                              "4444", "55555", "3.14", "1,000", "-7", "10%", "ﬁ", "é", "😀",
                              "🚀🚀", "日本語", "'s", "'ll", "don't", "I'M", "HELLO", "snake_case",
                              "camelCase", "a=b+c", "x**2", "{}", "[]", "()", "//", "#!"] + SPECIALS
    out = ["", " ", "a", "1", "12", "123", "1234", "  leading", "trailing  ", "\n\nnew\n",
           "<|im_start|>user\nHi<|im_end|>", CORPUS]
    while len(out) < n:
        k = int(rng.integers(1, 9))
        seps = rng.choice([" ", "", "\n", "  ", "\t"], k)
        out.append("".join(str(rng.choice(words)) + str(s) for s in seps))
    return out


def test_gpt2_vocabulary_matches_transformers_and_the_trained_tokenizer(tmp_path, hf_folders, gpt2_vocab):
    path = write_gguf(tmp_path / "bpe.gguf", hf_folders["tied"], "gpt2", gpt2_vocab=gpt2_vocab)
    _, ours = load_target(str(path))
    ref = hf_tokenizer_from_gguf(path)
    trained = gpt2_vocab[2]
    strings = sample_strings()
    assert len(strings) >= 200
    for s in strings:
        ids = ours.encode(s, add_special_tokens=True)
        assert ids == ref.encode(s, add_special_tokens=True), s
        if not any(sp in s for sp in SPECIALS):
            assert ids == trained.encode(s).ids, s
        assert ours.decode(ids) == s
        detok = ours.detokenizer
        detok.reset()
        for t in ids:
            detok.add_token(t)
        detok.finalize()
        # mlx-lm's streaming detokenizer drops one leading space of a reply, by design
        assert detok.text == (s[1:] if s.startswith(" ") else s), s
    msgs = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42."},
            {"role": "user", "content": "Thanks!"}]
    for gen in (True, False):
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False) == \
            ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == \
            ids_of(ref.apply_chat_template(msgs, add_generation_prompt=gen))
    assert ours.chat_template == CHATML
    assert 2 in ours.eos_token_ids


def test_llama3_pre_tokenizer_matches_transformers(tmp_path, hf_folders, gpt2_vocab):
    path = write_gguf(tmp_path / "bpe3.gguf", hf_folders["tied"], "gpt2", gpt2_vocab=gpt2_vocab,
                      pre="llama-bpe", add_bos=True)
    _, ours = load_target(str(path))
    ref = hf_tokenizer_from_gguf(path)
    for s in sample_strings():
        ids = ours.encode(s)
        assert ids == ref.encode(s), s
        assert ids[0] == 0  # BOS added, as the file says


# tiktoken's o200k_base split, as tiktoken defines it (gpt-oss files name it "gpt-4o")
O200K = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""",
    r"""\s+"""])


def test_gpt4o_pre_tokenizer_splits_as_o200k(tmp_path, hf_folders, gpt2_vocab):
    """The `gpt-4o` pre-tokenizer of gpt-oss files cuts text where the `regex` module cuts
    it with tiktoken's o200k_base pattern (before the byte-level BPE)."""
    import regex

    path = write_gguf(tmp_path / "o200k.gguf", hf_folders["tied"], "gpt2", gpt2_vocab=gpt2_vocab,
                      pre="gpt-4o")
    _, ours = load_target(str(path))
    pre = ours._tokenizer.backend_tokenizer.pre_tokenizer
    from eagle_mlx.targets.gguf import _bytes_to_unicode

    unspell = {v: k for k, v in _bytes_to_unicode().items()}  # ByteLevel spells the bytes
    for s in sample_strings() + ["I'M HERE and you're THERE", "CamelCase wordsAndMore", "a/b/\n"]:
        pieces = [bytes(unspell[c] for c in p).decode("utf-8") for p, _ in pre.pre_tokenize_str(s)]
        assert pieces == regex.findall(O200K, s), s


def test_digit_splitting_pre_tokenizer(tmp_path, hf_folders, gpt2_vocab):
    """SmolLM2's `smollm` pre-tokenizer splits every digit (its tokenizer.json puts
    Digits(individual_digits) before the byte-level split)."""
    from tokenizers import pre_tokenizers

    path = write_gguf(tmp_path / "smol.gguf", hf_folders["tied"], "gpt2", gpt2_vocab=gpt2_vocab,
                      pre="smollm")
    _, ours = load_target(str(path))
    trained = gpt2_vocab[2]
    trained.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for s in sample_strings():
        if not any(sp in s for sp in SPECIALS):
            assert ours.encode(s) == trained.encode(s).ids, s
    assert all(len(ours.decode([t])) == 1 for t in ours.encode("2024 12345"))


def test_sentencepiece_vocabulary_matches_sentencepiece_and_transformers(tmp_path, hf_folders):
    sp = train_spm_vocab(tmp_path / "spm")
    folder = make_hf_model(tmp_path / "hf_spm", vocab_size=sp.get_piece_size(), num_hidden_layers=2)
    path = write_gguf(tmp_path / "spm.gguf", folder, "llama", spm_processor=sp)
    target, ours = load_target(str(path))
    ref = hf_tokenizer_from_gguf(path)
    for s in sample_strings():
        ids = ours.encode(s)
        assert ids == ref.encode(s), s
        # sentencepiece itself too, but for text that starts with whitespace, where
        # transformers' Metaspace (which this follows) adds no second prefix space
        if not any(sp_tok in s for sp_tok in SPECIALS) and not s[:1].isspace():
            assert ids == [1] + sp.encode(s), s  # BOS: llama vocabularies add it by default
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "Hello there, 2 + 2?"}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True) == \
        ids_of(ref.apply_chat_template(msgs, add_generation_prompt=True))
    compare_with_transformers(path)


# ------------------------------------------------------------------------- bad files

def _run_generate(model, capsys):
    """`python -m eagle_mlx.generate --model FILE`, in this process (its exit code, stderr)."""
    from types import SimpleNamespace

    from eagle_mlx.generate import main

    capsys.readouterr()
    code = main(["--model", str(model), "--prompt", "hi", "--max-tokens", "2"])
    return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)


def test_bad_gguf_files_end_in_one_sentence(tmp_path, hf_folders, gpt2_vocab, capsys):
    good = write_gguf(tmp_path / "good.gguf", hf_folders["untied"], "gpt2", gpt2_vocab=gpt2_vocab)
    data = good.read_bytes()
    cases = {}
    (tmp_path / "trunc").mkdir()
    (tmp_path / "trunc" / "m.gguf").write_bytes(data[: len(data) - 3000])
    cases["trunc/m.gguf"] = "truncated"
    (tmp_path / "header.gguf").write_bytes(data[:200])
    cases["header.gguf"] = "truncated"
    arch = gguf.GGUFWriter(str(tmp_path / "arch.gguf"), "falcon")
    arch.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    arch.write_header_to_file()
    arch.write_kv_data_to_file()
    arch.write_tensors_to_file()
    arch.close()
    cases["arch.gguf"] = "'falcon' model; supported architectures: llama"
    iq4 = (gguf.GGMLQuantizationType.IQ4_NL.name,  # a type MLX has no layout for
           np.random.default_rng(0).integers(0, 256, (128, 2 * 18), dtype=np.uint8))
    write_gguf(tmp_path / "iq4.gguf", hf_folders["untied"], "gpt2",
               raw={"blk.0.ffn_up.weight": iq4}, gpt2_vocab=gpt2_vocab)
    cases["iq4.gguf"] = "tensor blk.0.ffn_up.weight"
    write_gguf(tmp_path / "novocab.gguf", hf_folders["untied"], "none", gpt2_vocab=gpt2_vocab)
    cases["novocab.gguf"] = "no vocabulary"
    (tmp_path / "two").mkdir()
    for n in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / n).write_bytes(data)
    cases["two"] = "holds 2 .gguf files"
    for name, expected in cases.items():
        r = _run_generate(tmp_path / name, capsys)
        assert r.returncode == 1, (name, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert expected in r.stderr, (name, r.stderr)
        if name == "iq4.gguf":
            assert "type IQ4_NL" in r.stderr
