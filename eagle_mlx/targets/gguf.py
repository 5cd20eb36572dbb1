"""GGUF targets (llama.cpp, Ollama, LM Studio files) as mlx-lm models and tokenizers.

The header is read and checked first (a truncated file or an unsupported tensor type is
refused in one sentence naming the tensor); then each tensor is read from a memory map:
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants with groups of 32 (Q4_K, Q5_K) repacked
exactly as MLX affine quantized triples (weight, scales, biases; group size 32), each
tensor with its own bits; F32, F16 and BF16 as they are; the K-quants with groups of 16
(Q2_K, Q3_K, Q6_K) as 8-bit triples quantized from their values, or those values in
float32 for a target that runs in floats. llama.cpp's tensor names are mapped to
mlx-lm's, the Q/K row permutation its converter applies to llama files is undone (a row
permutation, exact on quantized triples); qwen2, qwen3 and gemma3 files need none (Gemma's
norm weights, stored as 1 + w, come back as w). The model config comes from the
metadata, and the tokenizer is rebuilt from the vocabulary in the metadata and wrapped as
mlx-lm's, so an mlx-lm model and tokenizer come out.
"""

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import mlxlm
from ..errors import EagleError, reason

# ggml tensor types: name, elements per block, bytes per block
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# kept quantized, exactly: MLX affine with groups of 32 (Q4_K / Q5_K with float32 scales)
QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "MXFP4")
FLOAT = ("F32", "F16", "BF16")
# K-quants with groups of 16 (no MLX layout holds them exactly): 8-bit affine, groups of 32,
# quantized from their float32 values (error: at most half a step, 1/510 of a group's range;
# `_requantize8`)
REQUANTIZED = ("Q2_K", "Q3_K", "Q6_K")
SUPPORTED_TYPES = FLOAT + QUANTIZED + REQUANTIZED
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "gpt-oss")
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                     "gpt-oss": "GptOssForCausalLM"}

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}


@dataclass
class TensorInfo:
    name: str
    shape: Tuple[int, ...]  # row-major (numpy/MLX order)
    type_name: str
    offset: int  # absolute offset in the file
    nbytes: int


class _Reader:
    def __init__(self, data, path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise EagleError(f"GGUF file {self.path} is truncated: its header ends early "
                             "(an incomplete download?).")
        value = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self):
        n = self.take("<Q")
        if self.pos + n > len(self.data):
            raise EagleError(f"GGUF file {self.path} is truncated: its header ends early "
                             "(an incomplete download?).")
        s = bytes(self.data[self.pos: self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, n = self.take("<I"), self.take("<Q")
            if etype in _SCALARS and etype != 7:
                fmt = _SCALARS[etype]
                size = struct.calcsize(fmt) * n
                if self.pos + size > len(self.data):
                    raise EagleError(f"GGUF file {self.path} is truncated: its header ends "
                                     "early (an incomplete download?).")
                out = np.frombuffer(self.data, dtype=np.dtype(fmt), count=n, offset=self.pos)
                self.pos += size
                return out.tolist()
            return [self.value(etype) for _ in range(n)]
        raise EagleError(f"GGUF file {self.path} has a metadata value of unknown type {vtype}.")


def read_header(path: Path):
    """(metadata dict, [TensorInfo]) of a GGUF file, checked against the file's size."""
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise EagleError(f"could not read GGUF file {path} ({reason(e)}).") from None
    r = _Reader(data, path)
    if len(data) < 4 or bytes(data[:4]) != b"GGUF":
        raise EagleError(f"{path} is not a GGUF file (it does not start with 'GGUF').")
    r.pos = 4
    version = r.take("<I")
    if version not in (2, 3):
        raise EagleError(f"GGUF file {path} has version {version}; versions 2 and 3 are supported.")
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise EagleError(f"GGUF file {path} has a corrupt header (counts {n_tensors}, {n_kv}).")
    meta = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.take("<I")
        if n_dims > 8:
            raise EagleError(f"GGUF file {path} has a corrupt header (tensor {name}).")
        dims = [r.take("<Q") for _ in range(n_dims)]
        ttype, offset = r.take("<I"), r.take("<Q")
        tname, block, block_bytes = GGML_TYPES.get(ttype, (f"type {ttype}", 1, 0))
        count = int(np.prod(dims)) if dims else 1
        infos.append(TensorInfo(name, tuple(reversed(dims)), tname, offset,
                                count // block * block_bytes))
    alignment = int(meta.get("general.alignment", 32))
    start = (r.pos + alignment - 1) // alignment * alignment
    for t in infos:
        t.offset += start
        if t.nbytes and t.offset + t.nbytes > len(data):
            raise EagleError(
                f"GGUF file {path} is truncated: tensor {t.name} ends at byte "
                f"{t.offset + t.nbytes} but the file has {len(data)} bytes (an incomplete download?)."
            )
    return meta, infos


def find_gguf(path: Path) -> Optional[Path]:
    """The GGUF file `path` names: the file itself, or the one .gguf file in a folder."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise EagleError(f"model folder {path} holds {len(files)} .gguf files; name the one "
                             f"to load ({', '.join(f.name for f in files[:4])}).")
        if files:
            return files[0]
    return None


# ---------------------------------------------------------------------------- config

def model_config(meta: dict, infos: List[TensorInfo], path: Path) -> dict:
    """An mlx-lm (Hugging Face style) config from the GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise EagleError(f"GGUF file {path} holds a '{arch}' model; supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}.")

    def get(key, default=None, required=False):
        value = meta.get(f"{arch}.{key}", default)
        if required and value is None:
            raise EagleError(f"GGUF file {path} lacks the metadata key {arch}.{key}.")
        if isinstance(value, list):
            raise EagleError(f"GGUF file {path} has a per-layer {arch}.{key}, which is not "
                             "supported.")
        return value

    if get("expert_count", 0) and arch != "gpt-oss":
        raise EagleError(f"GGUF file {path} holds a mixture-of-experts {arch} model; GGUF "
                         "targets support dense llama, qwen2, qwen3 and gemma3 models, and "
                         "gpt-oss.")
    names = {t.name for t in infos}
    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise EagleError(f"GGUF file {path} rotates {rope_dims} of {head_dim} head dimensions; "
                         "partial rotary embeddings are not supported.")
    tokens = meta.get("tokenizer.ggml.tokens")
    embed = next((t for t in infos if t.name == "token_embd.weight"), None)
    vocab = get("vocab_size") or (len(tokens) if tokens else None) or (embed.shape[0] if embed else None)
    config = {
        "model_type": arch,
        "architectures": [_HF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count", required=True)),
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }
    if arch == "gemma3":
        config.update(_gemma3_config(config, get, path))
    if arch == "gpt-oss":
        config.update(_gpt_oss_config(config, get, path))
        return config
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise EagleError(f"GGUF file {path} uses RoPE scaling '{scaling}'; supported: "
                             "linear, and llama3-style frequency factors (rope_freqs).")
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    return config


def _gemma3_config(config: dict, get, path: Path) -> dict:
    """Gemma 3 as llama.cpp reads it: every sixth layer global, the local layers' RoPE base
    10,000, queries scaled by 1/sqrt(head size) (1/sqrt(hidden/heads) for the 27B model)."""
    hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], \
        config["num_hidden_layers"]
    window = get("attention.sliding_window", required=True)
    big = layers == 62 and hidden == 5376  # llama.cpp's LLM_TYPE_27B
    return {"model_type": "gemma3_text", "sliding_window": int(window),
            "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": hidden // heads if big else config["head_dim"],
            "final_logit_softcapping": get("final_logit_softcapping"),
            "attention_bias": False, "mlp_bias": False}


def _gpt_oss_config(config: dict, get, path: Path) -> dict:
    """gpt-oss as llama.cpp writes it: experts, a window on every other layer (the first
    one sliding), YaRN. The model's YaRN is the untruncated one (its config says
    `truncate: false`), which transformers computes."""
    scaling = get("rope.scaling.type")
    out = {"model_type": "gpt_oss", "num_local_experts": int(get("expert_count", required=True)),
           "num_experts_per_tok": int(get("expert_used_count", required=True)),
           "intermediate_size": int(get("expert_feed_forward_length",
                                        config["intermediate_size"])),
           "sliding_window": int(get("attention.sliding_window", required=True)),
           "attention_bias": True, "mlp_bias": False}
    if scaling not in (None, "none"):
        if scaling != "yarn":
            raise EagleError(f"GGUF file {path} uses RoPE scaling '{scaling}'; gpt-oss uses yarn.")
        out["rope_scaling"] = {
            "rope_type": "yarn", "factor": float(get("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length",
                                                        4096)),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    return out


# ---------------------------------------------------------------------------- weights

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_PART = re.compile(r"^(.*)\.(weight|bias|scales|biases)$")


# Gemma 3's four norms a layer (its "ffn_norm" is the pre-feedforward one)
_GEMMA3_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                 "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
# gpt-oss: its router, the experts' stacked projections, the attention sinks
_GPT_OSS_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                  "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_proj",
                  "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
                  "attn_sinks": "self_attn.sinks"}
_ARCH_NAMES = {"gemma3": _GEMMA3_NAMES, "gpt-oss": _GPT_OSS_NAMES}
_BARE = ("attn_sinks",)  # tensors that are parameters of their own, not a layer's weight


def mlx_name(name: str, arch: str = "llama") -> Optional[str]:
    """mlx-lm's name for a llama.cpp tensor name (None: not a model parameter)."""
    m = _PART.match(name)
    if not m:
        return None
    base, part = m.groups()
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{part}"
    names = _ARCH_NAMES.get(arch, _LAYER_NAMES)
    m = re.match(r"^blk\.(\d+)\.(\w+)$", base)
    if m and m.group(2) in names:
        name = f"model.layers.{m.group(1)}.{names[m.group(2)]}"
        return name if m.group(2) in _BARE else f"{name}.{part}"
    return None


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's reordering of Q/K rows (HF rotate-half -> interleaved pairs)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _blocks(data: np.ndarray, t: TensorInfo, size: int) -> np.ndarray:
    return data[t.offset: t.offset + t.nbytes].reshape(-1, size)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at: at + 2].copy().view(np.float16)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing: each row's values as one little-endian stream of `bits`-bit fields
    (the first value in the lowest bits), read as uint32 words."""
    q = q.astype(np.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    elif bits != 8:
        flat = q.reshape(-1, q.shape[-1])
        out = np.empty((flat.shape[0], flat.shape[1] * bits // 8), np.uint8)
        for a in range(0, flat.shape[0], 1024):  # in slices: the bit planes take 8x the bytes
            planes = np.unpackbits(flat[a: a + 1024, :, None], axis=-1, bitorder="little")
            out[a: a + 1024] = np.packbits(planes[..., :bits].reshape(len(planes), -1), axis=-1,
                                           bitorder="little")
        q = out.reshape(*q.shape[:-1], -1)
    return np.ascontiguousarray(q).view(np.uint32)


def _quantized(data: np.ndarray, t: TensorInfo):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K as MLX affine triples (group size
    32), exactly: Q8_0 d*q (q int8) = d*(q+128) - 128d; Q4_0 d*(q-8) = d*q - 8d; Q4_1
    d*q + m; Q5_0 d*(q-16) = d*q - 16d; Q5_1 d*q + m; Q4_K / Q5_K (d*sc)*q - dmin*m per
    group of 32, with the products in float32 (as ggml computes them)."""
    rows = t.shape[:-1]
    if t.type_name == "MXFP4":  # e (E8M0) then qs[16]: values j and j+16 in qs[j]'s nibbles
        b = _blocks(data, t, 17)
        qs = b[:, 1:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1)  # E2M1 codes, as MLX's mxfp4 holds them
        return (mx.array(_pack(q.reshape(*rows, -1), 4)),
                mx.array(np.ascontiguousarray(b[:, 0]).reshape(*rows, -1)), None)
    if t.type_name in ("Q4_K", "Q5_K"):
        q, scales, biases = _k_groups(data, t)
        bits = 4 if t.type_name == "Q4_K" else 5
        scales, biases = scales.reshape(*rows, -1), biases.reshape(*rows, -1)
        return (mx.array(_pack(q.reshape(*rows, -1), bits)), mx.array(scales), mx.array(biases))
    if t.type_name in ("Q5_0", "Q5_1"):
        size = 22 if t.type_name == "Q5_0" else 24
        b = _blocks(data, t, size)
        d = _f16(b, 0)
        qh = b[:, size - 20: size - 16].copy().view(np.uint32)  # [n, 1]
        qs = b[:, size - 16:]
        high = (qh >> np.arange(32, dtype=np.uint32)) & 1       # the fifth bit of value j
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1) | (high.astype(np.uint8) << 4)
        biases = d * np.float16(-16) if t.type_name == "Q5_0" else _f16(b, 2)
        w = _pack(q.reshape(*rows, -1), 5)
        return (mx.array(w), mx.array(d.reshape(*rows, -1)), mx.array(biases.reshape(*rows, -1)))
    if t.type_name == "Q8_0":
        b = _blocks(data, t, 34)
        d = _f16(b, 0)
        q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bits, scales, biases = 8, d, d * np.float16(-128)
    else:
        size = 18 if t.type_name == "Q4_0" else 20
        b = _blocks(data, t, size)
        d = _f16(b, 0)
        qs = b[:, size - 16:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1)  # values 0-15, then 16-31
        bits = 4
        scales, biases = (d, d * np.float16(-8)) if t.type_name == "Q4_0" else (d, _f16(b, 2))
    w = _pack(q.reshape(*rows, -1), bits)
    return (mx.array(w), mx.array(scales.reshape(*rows, -1)), mx.array(biases.reshape(*rows, -1)))


def _k_scales(q: np.ndarray):
    """The 8 six-bit (scale, min) pairs packed in 12 bytes of a Q4_K/Q5_K super-block."""
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_quant(data: np.ndarray, t: TensorInfo) -> np.ndarray:
    """K-quant super-blocks of 256 values, dequantized in float32 (ggml's formulas)."""
    if t.type_name == "Q6_K":  # ql[128] qh[64] scales int8[16] d: 16 groups of 16 values
        b = _blocks(data, t, 210)
        d = _f16(b, 208).astype(np.float32)
        ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        low = np.concatenate([ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4,
                              ql[..., 32:] >> 4], axis=2)
        high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        q = (low | (high << 4)).astype(np.float32) - 32  # [n, 2 halves, 128]
        sc = b[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 2, 8, 1)
        return (d[:, :, None, None] * sc * q.reshape(-1, 2, 8, 16)).reshape(t.shape)
    if t.type_name == "Q2_K":  # scales[16] qs[64] d dmin: 16 groups of 16 values, 2 bits
        b = _blocks(data, t, 84)
        d, dmin = _f16(b, 80).astype(np.float32), _f16(b, 82).astype(np.float32)
        qs = b[:, 16:80].reshape(-1, 2, 32)
        q = np.concatenate([(qs >> s) & 3 for s in (0, 2, 4, 6)], axis=2).astype(np.float32)
        sc = b[:, :16]
        scale = d * (sc & 0xF).astype(np.float32)
        minimum = dmin * (sc >> 4).astype(np.float32)
        return (scale.reshape(-1, 2, 8, 1) * q.reshape(-1, 2, 8, 16)
                - minimum.reshape(-1, 2, 8, 1)).reshape(t.shape)
    if t.type_name == "Q3_K":  # hmask[32] qs[64] scales[12] d: 16 groups of 16, 3 bits
        b = _blocks(data, t, 110)
        d = _f16(b, 108).astype(np.float32)
        hmask, qs, packed = b[:, :32], b[:, 32:96].reshape(-1, 2, 32), b[:, 96:108]
        low = np.concatenate([(qs >> s) & 3 for s in (0, 2, 4, 6)], axis=2).reshape(-1, 256)
        high = np.concatenate([(hmask >> j) & 1 for j in range(8)], axis=1)  # value 32j+l
        q = low.astype(np.float32) - 4 * (1 - high.astype(np.float32))
        a, c = packed[:, 0:4], packed[:, 4:8]
        hi = packed[:, 8:12]
        sc = np.concatenate([(a & 0xF) | ((hi & 3) << 4), (c & 0xF) | (((hi >> 2) & 3) << 4),
                             (a >> 4) | (((hi >> 4) & 3) << 4), (c >> 4) | (((hi >> 6) & 3) << 4)],
                            axis=1).astype(np.float32) - 32
        return (d[:, :, None] * sc[:, :, None] * q.reshape(-1, 16, 16)).reshape(t.shape)
    q, scales, biases = _k_groups(data, t)
    return (scales[:, :, None] * q.astype(np.float32) + biases[:, :, None]).reshape(t.shape)


def _k_groups(data: np.ndarray, t: TensorInfo):
    """Q4_K / Q5_K super-blocks (d dmin scales[12] (qh[32]) qs[128]) as 8 groups of 32:
    quantized values [n, 8, 32] and each group's scale d*sc and bias -dmin*m (float32)."""
    size = 144 if t.type_name == "Q4_K" else 176
    b = _blocks(data, t, size)
    d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, size - 128:].reshape(-1, 4, 32)  # 4 chunks of 64 values, two nibbles a byte
    q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32)
    if t.type_name == "Q5_K":  # bit j of qh[l]: the fifth bit of value l of group j
        bits = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        q = q | (bits << 4)
    return q, d * sc, -(dmin * mn)


def _requantize8(values: np.ndarray):
    """8-bit affine triples (groups of 32, float32 scale and bias) of float32 values: each
    value rounded to the nearest of 256 levels from its group's minimum to its maximum,
    so within half a step ((max - min) / 510) of the value."""
    groups = values.reshape(*values.shape[:-1], -1, 32)
    low, high = groups.min(-1), groups.max(-1)
    scale = (high - low) / 255
    q = np.rint((groups - low[..., None]) / np.where(scale > 0, scale, 1)[..., None])
    q = np.clip(q, 0, 255).reshape(values.shape)
    return (mx.array(_pack(q, 8)), mx.array(scale.astype(np.float32)),
            mx.array(low.astype(np.float32)))


def read_tensor(data: np.ndarray, t: TensorInfo, requantize: bool = True):
    """One tensor: an mx.array, or an MLX affine (weight, scales, biases) triple.
    requantize: the K-quants no MLX layout holds exactly become 8-bit triples (False:
    their exact float32 values, for a target that runs in floats anyway)."""
    if t.type_name in QUANTIZED:
        return _quantized(data, t)
    if t.type_name in REQUANTIZED:
        values = _k_quant(data, t)
        if not requantize or t.shape[-1] % 32 or len(t.shape) < 2:  # (1-D: as values)
            return mx.array(values)
        return _requantize8(values)
    dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[t.type_name]
    value = mx.array(data[t.offset: t.offset + t.nbytes].view(dtype).reshape(t.shape))
    return value.view(mx.bfloat16) if t.type_name == "BF16" else value


def load_weights(path: Path, infos: List[TensorInfo], config: dict, arch: str,
                 requantize: bool = True):
    """mlx-lm named weights (quantized triples for the types kept quantized), and
    llama.cpp's RoPE frequency factors where the file has them (else None). arch: the
    file's `general.architecture` (its tensor names)."""
    for t in infos:
        if t.type_name not in SUPPORTED_TYPES and (mlx_name(t.name, arch) or
                                                   t.name == "rope_freqs.weight"):
            raise EagleError(
                f"tensor {t.name} in GGUF file {path} has type {t.type_name}, which is not "
                f"supported; supported types: {', '.join(SUPPORTED_TYPES)}.")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    weights, rope_factors = {}, None
    for t in infos:
        name = mlx_name(t.name, arch)
        if t.name == "rope_freqs.weight":
            rope_factors = read_tensor(data, t)
        if name is None:
            continue
        value = read_tensor(data, t, requantize)
        if isinstance(value, tuple):
            base = name.rsplit(".", 1)[0]
            weights.update((k, v) for k, v in zip((name, f"{base}.scales", f"{base}.biases"), value)
                           if v is not None)
        else:
            weights[name] = value
    if arch == "gemma3":  # llama.cpp stores Gemma's norm weights w as 1 + w
        for key, value in list(weights.items()):
            if key.endswith("norm.weight"):
                weights[key] = value.astype(mx.float32) - 1
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    # llama.cpp's converter permutes Q/K rows for the llama architecture only (Qwen files
    # keep the rotate-half layout, which ggml's NEOX RoPE reads)
    for key, value in list(weights.items()) if arch == "llama" else []:
        if ".self_attn.q_proj." in key:
            weights[key] = _unpermute(value, n_heads)
        elif ".self_attn.k_proj." in key:
            weights[key] = _unpermute(value, n_kv)
    missing = [f"blk.{i}" for i in range(config["num_hidden_layers"])
               if f"model.layers.{i}.self_attn.q_proj.weight" not in weights]
    if "model.embed_tokens.weight" not in weights or missing:
        what = "token_embd.weight" if "model.embed_tokens.weight" not in weights else missing[0]
        raise EagleError(f"GGUF file {path} lacks the tensors of {what}.")
    return weights, rope_factors


class FreqsRoPE(nn.Module):
    """RoPE with explicit per-frequency factors (llama.cpp's `rope_freqs` tensor, which
    Llama-3.1-style GGUFs carry instead of `rope_scaling` settings)."""

    def __init__(self, dims: int, base: float, factors: mx.array):
        super().__init__()
        self.dims = dims
        self._freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors.astype(mx.float32)

    def __call__(self, x, offset=0):
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset,
                            freqs=self._freqs)


def _packed_as(path: str, module: nn.Module, weights: Dict[str, mx.array]) -> dict:
    """The group size, bits and mode a layer's weights were packed with here, read off
    the shapes of its packed weight and scales (no biases: MXFP4)."""
    in_dims = module.weight.shape[-1]
    return {"group_size": in_dims // weights[f"{path}.scales"].shape[-1],
            "bits": weights[f"{path}.weight"].shape[-1] * 32 // in_dims,
            "mode": "affine" if f"{path}.biases" in weights else "mxfp4"}


def build_model(config: dict, weights: Dict[str, mx.array], rope_factors=None) -> nn.Module:
    """An mlx-lm model from a config and its weights, quantizing exactly the layers whose
    weights come with scales (each with its own bits)."""
    arch = mlxlm.model_module(config["model_type"])
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = model.sanitize(dict(weights))
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda p, m: (hasattr(m, "to_quantized") and f"{p}.scales" in weights
                                              and _packed_as(p, m, weights)))
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    if rope_factors is not None:
        for layer in model.layers:
            layer.self_attn.rope = FreqsRoPE(config["head_dim"], config["rope_theta"], rope_factors)
    return model


def quantization_config(model: nn.Module) -> Optional[dict]:
    """mlx-lm's `quantization` config block for a model with per-layer bits."""
    layers = {name: {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
              for name, m in model.named_modules()
              if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    if not layers:
        return None
    first = next(iter(layers.values()))
    return {"group_size": first["group_size"], "bits": first["bits"], "mode": first["mode"], **layers}


# ---------------------------------------------------------------------------- tokenizer

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tiktoken's o200k_base (gpt-oss, GPT-4o): case-aware letter runs with their contraction
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's pre-tokenizer names -> the split its vocabulary was trained with
PRE_TOKENIZER_SPLITS = {
    "gpt-4o": _O200K_SPLIT,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# pre-tokenizers that split every digit on its own before GPT-2's byte-level split
DIGIT_PRE_TOKENIZERS = ("smollm", "starcoder", "refact")
GPT2_PRE_TOKENIZERS = ("default", "gpt2", "gpt-2")
CONTROL, USER_DEFINED = 3, 4


def _bytes_to_unicode() -> Dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merges_from_scores(tokens: List[str], scores: List[float]) -> List[Tuple[str, str]]:
    """SentencePiece BPE merges recovered from the vocabulary: every split of a token into
    two tokens, the higher the merged token's score the earlier the merge."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _byte_level_pre_tokenizer(pre: str, path: Path):
    """The pre-tokenizer llama.cpp names `pre` for a byte-level BPE vocabulary."""
    from tokenizers import Regex, pre_tokenizers

    if pre in PRE_TOKENIZER_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in DIGIT_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in GPT2_PRE_TOKENIZERS:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    known = sorted(set(PRE_TOKENIZER_SPLITS) | set(DIGIT_PRE_TOKENIZERS) | set(GPT2_PRE_TOKENIZERS))
    raise EagleError(f"GGUF file {path} uses the pre-tokenizer '{pre}', which is not "
                     f"supported; supported: {', '.join(known)}.")


def build_tokenizer(meta: dict, path: Path):
    """mlx-lm's TokenizerWrapper for the vocabulary in the GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise EagleError(f"GGUF file {path} has no vocabulary (tokenizer.ggml.tokens); it "
                         "cannot be used without a tokenizer.")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre", "default")

    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
                   for t in tokens]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges,
                                   fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(pre, path)
        tok.decoder = decoders.ByteLevel()
        detokenizer = mlxlm.BPEStreamingDetokenizer
        control = [t for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet]
        add_bos_default = False
    elif kind == "llama":
        merges = meta.get("tokenizer.ggml.merges")
        merges = ([tuple(m.split(" ", 1)) for m in merges] if merges else
                  _merges_from_scores(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   unk_token=tokens[unk] if unk is not None else None,
                                   fuse_unk=True, byte_fallback=True))
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        detokenizer = mlxlm.SPMStreamingDetokenizer if prefix else \
            (lambda t: mlxlm.SPMStreamingDetokenizer(t, trim_space=False))
        control = [t for t, k in zip(tokens, types) if k == CONTROL]
        add_bos_default = True
    else:
        raise EagleError(f"GGUF file {path} has a '{kind}' vocabulary; supported: gpt2 (byte-level "
                         "BPE) and llama (SentencePiece).")
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])

    def special(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = special("bos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tokens.index(bos))])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=special("eos"), unk_token=special("unknown"),
        pad_token=special("padding"), clean_up_tokenization_spaces=False)
    template = meta.get("tokenizer.chat_template")
    if template:
        hf.chat_template = template
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if isinstance(meta.get(k), int)]
    return mlxlm.TokenizerWrapper(hf, detokenizer, eos_token_ids=sorted(set(eos_ids)))


# ---------------------------------------------------------------------------- entry point

def load_gguf(path: Path, requantize: bool = True):
    """(mlx-lm model, config, TokenizerWrapper) for a GGUF file (requantize: see
    `read_tensor`)."""
    meta, infos = read_header(path)
    config = model_config(meta, infos, path)
    tokenizer = build_tokenizer(meta, path)
    weights, rope_factors = load_weights(path, infos, config, meta["general.architecture"],
                                         requantize)
    try:
        model = build_model(config, weights, rope_factors)
    except Exception as e:
        raise EagleError(f"the tensors of GGUF file {path} do not fit its metadata ({reason(e)}).") from None
    return model, config, tokenizer
