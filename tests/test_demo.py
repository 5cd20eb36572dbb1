"""The demo pair shipped inside the package: offline, lossless, loadable by transformers."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import eagle_mlx
from eagle_mlx.demo import DEMO_DIR

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / "target" / "config.json").is_file(),
    reason=f"the demo pair is not built (python scripts/make_demo.py writes {DEMO_DIR})",
)

PROMPTS = [
    "What are the main benefits of regular exercise?",
    "Write a short email to a colleague asking for a meeting next week.",
    "Explain what a Python list comprehension is.",
]


def test_the_default_generate_command_runs_offline(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "eagle_mlx.generate", "--prompt", PROMPTS[0],
                           "--max-tokens", "40"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Acceptance: tau" in proc.stdout
    assert len(proc.stdout.split("==========\n")[1].strip()) > 0


def test_demo_greedy_eagle_equals_plain_on_mt_bench_style_prompts():
    model, tok = eagle_mlx.load(str(DEMO_DIR / "target"), eagle=str(DEMO_DIR / "head"))
    taus = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        spec = list(eagle_mlx.stream_generate(model, tok, ids, max_tokens=64, speculate=True))
        plain = list(eagle_mlx.stream_generate(model, tok, ids, max_tokens=64, speculate=False))
        assert [t for r in spec for t in r.tokens] == [t for r in plain for t in r.tokens]
        taus.append(spec[-1].mean_accept_length)
    assert np.mean(taus) > 1.3, taus  # the shipped head is really accepted


def test_transformers_loads_the_demo_target():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    target, tok = eagle_mlx.load_target(str(DEMO_DIR / "target"))
    ids = hf_tok("Hello, how are you today?")["input_ids"]
    assert ids == tok.encode("Hello, how are you today?")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    h, _ = target(mx.array([ids]))
    np.testing.assert_allclose(np.array(target.lm_head(h)[0]), ref, atol=1e-3, rtol=0)


def test_the_tokenizer_is_the_sentencepiece_one():
    import sentencepiece as spm

    _, tok = eagle_mlx.load_target(str(DEMO_DIR / "target"))
    sp = spm.SentencePieceProcessor(model_file=str(DEMO_DIR / "target" / "tokenizer.model"))
    for text in PROMPTS + ["Numbers 12345 and symbols: {x: [1, 2]} \u00e9t\u00e9"]:
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text)


def test_the_shipped_files_are_small():
    size = sum(f.stat().st_size for f in DEMO_DIR.rglob("*") if f.is_file())
    assert size <= 25e6, size
    recipe = json.loads((DEMO_DIR / "recipe.json").read_text())
    assert 0 < recipe["head"]["held_out_top1_accuracy"] <= 1
