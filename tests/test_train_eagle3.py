"""Training EAGLE-3 heads: learning, the unroll against the engine's own draft, the draft
vocabulary, export/convert and resume bit-for-bit."""

import json
import random
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

import eagle_mlx
from eagle_mlx import load_head, load_target
from eagle_mlx.convert import main as convert_main
from eagle_mlx.train import main as train_main
from eagle_mlx.decoding.tree import draft_dynamic
from eagle_mlx.training import ttt
from tiny import make_eagle_head, make_hf_model, two_turn_conversations

# the answers draw on a few words far more often than on the rest: the draft vocabulary
# of the data is then plain to see
COMMON = [f"t{i}" for i in range(10, 30)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train3")
    target = make_hf_model(root / "target", "llama", seed=9, vocab_size=64, num_hidden_layers=7,
                           scale=4.0)
    rng = random.Random(1)
    weights = [40 - i for i in range(len(COMMON))]  # distinct frequencies, far above the rest

    def answer(n):
        return " ".join(rng.choices(COMMON, weights)[0] if rng.random() < 0.9
                        else f"t{rng.randint(30, 63)}" for _ in range(n))
    data = two_turn_conversations(
        rng, 160, lambda: " ".join(f"t{rng.randint(6, 63)}" for _ in range(5)), answer,
        lambda: "t7 t8")
    path = root / "data.json"
    path.write_text(json.dumps(data))
    return root, target, path, data


ARGS = ["--kind", "eagle3", "--lr", "3e-3", "--batch-size", "8", "--eval-conversations", "32",
        "--draft-vocab", "21", "--unroll", "3", "--warmup-steps", "0", "--quiet"]


def log_rows(out):
    return [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(setup):
    root, target, data, _ = setup
    out = root / "run"
    assert train_main(["--model", str(target), "--data", str(data), "--out", str(out),
                       "--max-steps", "40", "--eval-every", "1000", "--export",
                       str(root / "exported"), *ARGS]) == 0
    return out


def test_unrolled_training_lowers_the_loss_at_every_step(setup, trained):
    root, target, data, _ = setup
    zero = root / "zero"
    assert train_main(["--model", str(target), "--data", str(data), "--out", str(zero),
                       "--max-steps", "0", *ARGS]) == 0
    before, after = log_rows(zero)[-1], log_rows(trained)[-1]
    assert after["eval_loss"] < 0.8 * before["eval_loss"], (before, after)
    assert len(after["eval_acc_steps"]) == 3
    for b, a in zip(before["eval_acc_steps"], after["eval_acc_steps"]):
        assert a > b + 0.05, (before, after)
    losses = [r["ploss"] for r in log_rows(trained) if "ploss" in r]
    assert all(len(p) == 3 for p in losses)
    # the head folder is what eagle_mlx.load drafts with
    model, tok = eagle_mlx.load(str(target), eagle=str(trained / "head"))
    assert model.head.kind == "eagle3" and model.head.draft_vocab_size == 21


def test_step_k_of_the_unroll_is_the_engines_draft_at_depth_k(setup, tmp_path):
    """A greedy chain drafted by the engine (top-1 at each level) is what the unrolled
    training forward predicts at the last prompt position, step by step."""
    root, target_dir, _, _ = setup
    head_dir = make_eagle_head(tmp_path / "head", target_dir, "eagle3", seed=3, draft_vocab_size=40)
    target, _ = load_target(str(target_dir))
    head = load_head(str(head_dir), target)
    depth = 5
    rng = np.random.default_rng(0)
    for trial in range(3):
        prompt = mx.array(rng.integers(3, 64, 9).tolist())
        hidden, taps = target(prompt[None], taps=target.eagle3_taps)
        root_token = target.lm_head(hidden[0, -1]).argmax()
        feats = mx.concatenate(taps, axis=-1)[0]
        tree = draft_dynamic(head, target, head.make_cache(), feats,
                             mx.concatenate([prompt[1:], root_token[None]]), root_token,
                             total_tokens=depth + 2, depth=depth, top_k=1)
        chain = np.array(tree.tokens).tolist()  # root, then the drafted chain
        assert np.array(tree.parents).tolist() == [0] + list(range(depth + 1))
        seq = mx.array(np.array(prompt).tolist() + chain[:-1])[None]
        _, taps = target(seq, taps=target.eagle3_taps)
        outs = ttt.unroll(head, mx.concatenate(taps, axis=-1)[:, :-1],
                          ttt.step_tokens(seq, depth + 1), target.embed_tokens)
        n = prompt.shape[0] - 1  # the last prompt position
        predicted = [int(head.to_target_ids(head.logits(o[0, n], target).argmax()))
                     for o in outs]
        assert predicted == chain[1:], (trial, predicted, chain)


def test_the_draft_vocabulary_is_the_most_frequent_answer_tokens(setup, trained):
    root, target, _, data = setup
    counts = Counter(w for item in data for turn in item["conversations"] if turn["from"] == "gpt"
                     for w in turn["value"].split())
    counts["</s>"] = 2 * len(data)  # each answer ends its turn
    expected = [w for w, _ in counts.most_common(21)]
    # the top 21 of the whole data, held-out split or not: a clear gap below them
    assert counts.most_common(22)[-1][1] < 0.8 * counts.most_common(21)[-1][1]
    vocab = json.loads((target / "tokenizer.json").read_text())["model"]["vocab"]
    expected_ids = sorted(vocab[w] for w in expected)
    exported = mx.load(str(root / "exported" / "model.safetensors"))
    d2t, t2d = np.array(exported["d2t"]), np.array(exported["t2d"])
    assert exported["d2t"].dtype == mx.int64 and exported["t2d"].dtype == mx.bool_
    assert (d2t + np.arange(21)).tolist() == expected_ids
    assert np.flatnonzero(t2d).tolist() == expected_ids and t2d.shape == (64,)
    head = load_head(str(trained / "head"))
    assert np.array(head.to_target_ids(mx.arange(21))).tolist() == expected_ids
    cfg = json.loads((root / "exported" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 21 and cfg["vocab_size"] == 64 and "eagle" not in cfg
    assert "embed_tokens.weight" not in exported


def test_a_head_with_a_reduced_vocabulary_is_lossless(setup, trained):
    _, target, _, _ = setup
    model, tok = eagle_mlx.load(str(target), eagle=str(trained / "head"))
    plain, _ = eagle_mlx.load(str(target))
    rng = np.random.default_rng(4)
    accepted = 0
    for tree in (dict(total_tokens=12, depth=4, draft_top_k=3), dict(total_tokens=30, depth=6,
                                                                     draft_top_k=6)):
        prompt = rng.integers(3, 64, 8).tolist()
        ref = [t for r in eagle_mlx.stream_generate(plain, tok, prompt, max_tokens=40)
               for t in r.tokens]
        rs = list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=40, **tree))
        assert [t for r in rs for t in r.tokens] == ref, tree
        accepted += sum(len(r.tokens) - 1 for r in rs)
    assert accepted > 0  # the trained head's drafts were taken: the check was not vacuous


def test_export_converts_back_bit_for_bit(setup, trained, tmp_path):
    root, _, _, _ = setup
    back = tmp_path / "back"
    assert convert_main(["--eagle", str(root / "exported"), "--mlx-path", str(back)]) == 0
    a = mx.load(str(trained / "head" / "model.safetensors"))
    b = mx.load(str(back / "model.safetensors"))
    assert a.keys() == b.keys() and "d2t" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.array(a[k]), np.array(b[k])), k


def test_resume_continues_bit_for_bit(setup, tmp_path):
    root, target, data, _ = setup
    full, part = tmp_path / "full", tmp_path / "part"
    args = ["--model", str(target), "--data", str(data), "--eval-every", "1000",
            "--save-every", "3", *ARGS]
    assert train_main([*args, "--out", str(full), "--max-steps", "6"]) == 0
    assert train_main([*args, "--out", str(part), "--max-steps", "3"]) == 0
    assert train_main([*args, "--out", str(part), "--max-steps", "6", "--resume"]) == 0
    rows = lambda out: [(r["loss"], r["ploss"]) for r in log_rows(out) if "ploss" in r]  # noqa: E731
    assert len(rows(full)) == len(rows(part)) == 6
    assert rows(part)[3:] == rows(full)[3:]
    a, b = mx.load(str(full / "head" / "model.safetensors")), mx.load(str(part / "head" / "model.safetensors"))
    assert all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
