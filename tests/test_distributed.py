"""The target sharded over 2 local processes (ring backend, launched with MLX's launcher):
the same tokens as one process, ranks that never diverge, a lost rank ends in a sentence."""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import eagle_mlx
from tiny import ROOT, make_eagle_head, make_hf_model, tiny_llama

sys.path.insert(0, str(ROOT / "tests"))
from dist_worker import MAX_TOKENS, PROMPT, cases  # noqa: E402

LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"


def free_port() -> int:
    """A base port with the next one free too (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no free port pair")


def launch(command, timeout=180):
    return subprocess.run([sys.executable, "-c", LAUNCH, "-n", "2", "--backend", "ring",
                           "--starting-port", str(free_port()), "--", sys.executable, *command],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    # (contexts under 256: auto's costs are measured after a short prompt only, not again
    # after a long one, which two ranks on this machine take many seconds to prefill)
    llama = tiny_llama(root / "llama", max_position_embeddings=255)
    qwen3 = make_hf_model(root / "qwen3", "qwen3", seed=6, num_hidden_layers=8,
                          num_key_value_heads=2, vocab_size=64, scale=4.0,
                          max_position_embeddings=255)
    return root, {
        "llama-eagle1": (llama, make_eagle_head(root / "h1", llama, "eagle1", seed=1)),
        "qwen3-eagle3": (qwen3, make_eagle_head(root / "h3", qwen3, "eagle3", seed=2,
                                                draft_vocab_size=40)),
    }


@pytest.mark.long
def test_two_ranks_generate_what_one_process_generates(pairs, tmp_path, capsys, monkeypatch):
    """The API with a group (EAGLE-1 on Llama, EAGLE-3 on Qwen3; greedy, seeded and unseeded
    sampling, plain decoding; on Llama adaptive speculation with its costs measured by the
    ranks together: the same passes on both), then `eagle_mlx.generate`'s command line
    (auto), on 2 ranks."""
    root, named = pairs
    args = [a for name, (t, h) in named.items() for a in (name, str(t), str(h))]
    target, head = named["llama-eagle1"]
    cli = ["--model", str(target), "--eagle", str(head), "--prompt", "t5 t9 t11", "--max-tokens", "12"]
    lines = "t5 t9 t11\n/stats\nt7\n"
    (tmp_path / "chat.txt").write_text(lines)
    two = launch([str(ROOT / "tests" / "dist_worker.py"), str(tmp_path), *args, "--cli", *cli])
    assert two.returncode == 0, two.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # the ranks never diverge (seeded or not; auto's passes)
    for name, (target, head) in named.items():
        model, tok = eagle_mlx.load(str(target), eagle=str(head))
        for i, case, speculate in cases(name):
            one = [t for r in eagle_mlx.stream_generate(
                model, tok, PROMPT, max_tokens=MAX_TOKENS, speculate=speculate, **case)
                for t in r.tokens]
            assert ranks[0][f"{name}/{i}"] == one, (name, case, speculate)
        assert len(ranks[0][f"{name}/unseeded"]) > 0
    # one process: the same tools in this one (their `main`, what the console scripts call)
    from eagle_mlx.chat import main as chat
    from eagle_mlx.generate import main as generate

    capsys.readouterr()
    assert generate(cli) == 0
    one = capsys.readouterr().out
    two_generate, two_chat = two.stdout.split("---- chat\n")
    # rank 0 alone writes: the output once, the same text as one process
    assert two_generate.count("==========") == one.count("==========") and \
        two_generate.count("Prompt:") == 1, two.stdout
    assert two_generate.split("==========")[1] == one.split("==========")[1]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    assert chat([*cli[:4], "--max-tokens", "8"]) == 0
    one_chat = capsys.readouterr().out
    replies = lambda out: [l for l in out.splitlines() if l.startswith("t")]  # noqa: E731
    assert len(replies(one_chat)) == 2 and replies(two_chat) == replies(one_chat)
    assert two_chat.count("session: 1 replies") == 1


@pytest.mark.long
def test_the_server_runs_on_two_ranks(pairs):
    import openai

    root, named = pairs
    target, head = named["llama-eagle1"]  # (auto's costs: the ranks measured them above)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "-n", "2", "--backend", "ring", "--starting-port",
         str(free_port()), "--", sys.executable, "-m", "eagle_mlx.server", "--model", str(target),
         "--eagle", str(head), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line, "the server did not start"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                               timeout=120)
        model, tok = eagle_mlx.load(str(target), eagle=str(head))
        for text, stop in (("t5 t9 t11", None), ("t7", ["t40"]), ("t5 t9 t11 t12", None)):
            r = client.completions.create(model=str(target), prompt=text, max_tokens=16, stop=stop)
            want = eagle_mlx.generate(model, tok, text, max_tokens=16)
            if stop:
                want = want.split(stop[0])[0]
            assert r.choices[0].text == want, (text, r.choices[0].text, want)
    finally:
        # stop the server as its operator does: Ctrl-C (SIGINT) to rank 0, which stops the others
        for pid in subprocess.run(["pgrep", "-f", f"eagle_mlx.server .*--port {port}"],
                                  capture_output=True, text=True).stdout.split():
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"MLX_RANK=0" in environ:
                os.kill(int(pid), signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        finally:  # nothing may outlive the test
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err  # every rank ended by itself
    assert "Traceback" not in err and "server stopped" in err, err


def endless_ranks(named, tmp_path):
    """Two ranks started by hand (no launcher) on a long generation (greedy, this pair goes
    on to the end of its context after "t5" without an end token); returns once rank 0 has
    begun writing."""
    target, head = named["llama-eagle1"]
    port = free_port()
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = []
    for r in (0, 1):
        env = dict(os.environ, MLX_HOSTFILE=str(hosts), MLX_RANK=str(r))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "eagle_mlx.generate", "--model", str(target), "--eagle",
             str(head), "--prompt", "t5", "--max-tokens", "3000", "--ignore-chat-template"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    first = procs[0].stdout.readline()
    if not first.startswith("=========="):
        for p in procs:
            p.kill()
        raise AssertionError(procs[0].stderr.read())
    time.sleep(0.5)
    return procs


def test_a_lost_rank_ends_the_other_in_one_sentence(pairs, tmp_path):
    procs = endless_ranks(pairs[1], tmp_path)
    procs[1].kill()
    start = time.time()
    try:
        out, err = procs[0].communicate(timeout=60)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        out, err = procs[0].communicate()
        raise AssertionError(f"rank 0 still ran 60 s after rank 1 was killed: {err[-500:]}")
    finally:
        for p in procs:
            p.kill()
    assert time.time() - start < 30
    assert procs[0].returncode == 1, (out[-300:], err, procs[1].communicate()[1][-500:])
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert lines[-1].startswith("error: another rank of the distributed run stopped"), err


def test_a_rank_stopped_by_the_launcher_says_why(pairs, tmp_path):
    """mlx.launch ends the other ranks with SIGTERM when one rank ends."""
    procs = endless_ranks(pairs[1], tmp_path)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=60)
        assert p.returncode == 1, err
        assert err.strip().splitlines()[-1] == (
            f"error: rank {r} stopped: another rank of the distributed run ended, or the run "
            "was interrupted."), err


def test_targets_mlx_lm_cannot_shard_are_refused(tiny_dir):
    import mlx.core as mx

    from eagle_mlx.targets.load import shard
    from eagle_mlx.targets.load import load_target, read_config

    class Two:  # a group of two, for the checks that come before any communication
        def size(self):
            return 2

        def rank(self):
            return 0

    path = tiny_dir("mixtral")
    t, _ = load_target(str(path), lazy=True)
    with pytest.raises(eagle_mlx.EagleError, match="mlx-lm cannot shard mixtral models"):
        shard(t.model, read_config(path), Two(), path)
    path = tiny_dir("llama2_mha")
    t, _ = load_target(str(path), lazy=True)
    config = dict(read_config(path), num_attention_heads=3)
    with pytest.raises(eagle_mlx.EagleError, match="3 attention heads, which do not split evenly"):
        shard(t.model, config, Two(), path)
    assert mx.array(np.zeros(1)).size == 1


BLOCKED_IN_EVAL = """
import sys, types
import mlx.core as mx
from eagle_mlx import distributed
distributed.silence_other_ranks(types.SimpleNamespace(rank=lambda: 0, size=lambda: 2))
a = mx.random.normal((1024, 1024)) / 32
b = a
for _ in range(400):  # minutes of one evaluation: the main thread never returns to Python
    b = b @ a
print("evaluating", flush=True)
mx.eval(b)
print("finished", flush=True)
"""


def test_sigterm_ends_a_rank_at_once_even_inside_an_evaluation():
    """mlx.launch stops the other ranks with SIGTERM when one ends; a rank sitting in a long
    native call (the ring retrying a send to the dead rank) ends within seconds, with the
    sentence, not when the call returns."""
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_IN_EVAL], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "evaluating"
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        start = time.time()
        _, err = proc.communicate(timeout=20)
        assert time.time() - start < 5
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert err.strip().splitlines()[-1] == (
        "error: rank 0 stopped: another rank of the distributed run ended, or the run was "
        "interrupted."), err


def test_a_collective_that_one_rank_alone_took_part_in_is_a_lost_peer(monkeypatch):
    """Every cycle of adaptive speculation hands rank 0's timing to every rank in one
    all_sum, which also counts the ranks that took part: two ranks give rank 0's seconds
    on both; a collective that comes back holding this rank's own part alone (as MLX's
    ring left rank 0 once its peer was killed: decoding on with half a model) is a lost
    peer, in the sentence the tools end with."""
    import mlx.core as mx

    from eagle_mlx import distributed
    from eagle_mlx.decoding.adaptive import rank0_seconds

    class Rank:
        def __init__(self, rank):
            self._rank = rank

        def rank(self):
            return self._rank

        def size(self):
            return 2

    parts = {}

    def both_ranks(x, group=None):  # (each rank's part, summed as two live ranks would)
        parts[group.rank()] = x
        other = mx.array([0.25 if group.rank() else 0.0, 1.0])  # (rank 0 timed 0.25 s)
        return x + other

    monkeypatch.setattr(mx.distributed, "all_sum", both_ranks)
    assert rank0_seconds(Rank(0), 0.25) == 0.25 and rank0_seconds(Rank(1), 9.0) == 0.25
    assert parts[1].tolist() == [0.0, 1.0]  # (rank 1's own timing is not in the sum)
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, group=None: x)  # (alone)
    with pytest.raises(RuntimeError) as e:
        rank0_seconds(Rank(0), 0.25)
    monkeypatch.setattr(distributed, "_group", [Rank(0)])
    assert distributed.peer_lost(e.value) == (
        "another rank of the distributed run stopped or became unreachable (rank 1: 1 of 2 "
        "ranks took part in a collective).")
