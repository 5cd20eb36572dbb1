"""The server with continuous batching (`--max-batch`), run as a user runs it: concurrent
clients each get exactly what the model writes for them alone."""

import json
import time

import pytest

import eagle_mlx
from eagle_mlx.cli import chat_prompt
from test_server import (KEY, Running, in_threads, open_stream, openai,  # noqa: F401
                         server_model, tiny_pair)

assert openai  # (the test_server module skips without the openai client)


@pytest.fixture(scope="module")
def batched(tiny_pair):  # noqa: F811
    target, head = tiny_pair
    s = Running(["--model", target, "--eagle", head, "--lookup", "--api-key", KEY,
                 "--max-batch", 4])
    yield s
    assert s.stop() == 0, "".join(s.lines[-20:])


@pytest.fixture(scope="module")
def local_lookup(tiny_pair):  # noqa: F811
    target, head = tiny_pair
    return eagle_mlx.load(str(target), eagle=str(head), lookup=True)


# six requests: prompts, lengths, temperatures (sampling with seeds) and stop strings differ
REQUESTS = [dict(messages=[{"role": "user", "content": f"t{5 + i} t{20 + 3 * i} t{40 - i}"}],
                 max_tokens=12 + 5 * i, temperature=[0, 0.8, 0, 1.0, 0.5, 0][i],
                 seed=100 + i) for i in range(6)]


def alone(local_lookup, req, stop=None):  # noqa: F811
    """What the model writes for the request alone (stream_generate), cut at a stop string."""
    model, tok = local_lookup
    ids = chat_prompt(tok, req["messages"])
    rs = list(eagle_mlx.stream_generate(model, tok, ids, max_tokens=req["max_tokens"],
                                        temp=req["temperature"], seed=req["seed"]))
    text = "".join(r.text for r in rs)
    if stop and stop in text:
        return text[: text.index(stop)], "stop"
    return text, rs[-1].finish_reason


def ask(server, req, out, i, stream=False):
    c = server.client()
    if stream:
        chunks = list(c.chat.completions.create(model=server_model(server), stream=True, **req))
        out[i] = ("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices),
                  [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1])
    else:
        r = c.chat.completions.create(model=server_model(server), **req)
        out[i] = (r.choices[0].message.content, r.choices[0].finish_reason)


def test_concurrent_requests_each_equal_their_run_alone(batched, local_lookup):
    """Six concurrent clients (4 decode at once, the others join as they finish), streamed
    and not, greedy and seeded sampling, two with stop strings: each gets its own text and
    finish reason as stream_generate writes it alone."""
    reqs = [dict(r) for r in REQUESTS]
    wants = []
    for i, r in enumerate(reqs):
        text, _ = alone(local_lookup, r)
        if i in (1, 2) and len(text) > 10:
            r["stop"] = [text[5:8]]
        wants.append(alone(local_lookup, r, (r.get("stop") or [None])[0]))
    got = [None] * 6
    in_threads(ask, [(batched, r, got, i, i % 2 == 0) for i, r in enumerate(reqs)])
    assert got == wants


def test_arrivals_disconnects_and_bad_requests_while_a_batch_runs(batched, local_lookup):
    """A long stream runs; a second client arrives and leaves mid-answer; a bad request gets
    its JSON error; two more arrive while the first streams: all that stayed get their own
    text, and the log says the leaver's generation stopped."""
    long_req = dict(messages=[{"role": "user", "content": "t9 t10"}], max_tokens=3000)
    first = open_stream(batched, long_req)
    leaver = open_stream(batched, dict(long_req, messages=[{"role": "user", "content": "t3"}]))
    leaver.close()
    status, data = batched.raw("POST", "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "x"}],
                                "temperature": -1})
    assert status == 400 and "temperature" in json.loads(data)["error"]["message"]
    got = [None] * 2
    # (prompts no earlier request had: a kept prompt cache changes a sampled run's trees)
    reqs = [dict(REQUESTS[i], messages=[{"role": "user", "content": f"t{50 + i} t{2 + i}"}])
            for i in (3, 4)]
    in_threads(ask, [(batched, r, got, j) for j, r in enumerate(reqs)])
    assert got == [alone(local_lookup, r) for r in reqs]
    first.close()
    deadline = time.time() + 20
    while time.time() < deadline and sum("disconnected" in line for line in batched.lines) < 2:
        time.sleep(0.1)
    assert sum("disconnected; its generation was stopped" in line for line in batched.lines) >= 2


def test_sigterm_with_a_batch_in_flight(tiny_pair):  # noqa: F811
    """SIGTERM while three streams decode together: every client's stream is ended properly
    (its last chunk, then [DONE]), and the server exits cleanly."""
    target, head = tiny_pair
    s = Running(["--model", target, "--eagle", head, "--api-key", KEY, "--max-batch", 3])
    try:
        socks = [open_stream(s, dict(messages=[{"role": "user", "content": f"t{i}"}],
                                      max_tokens=3000)) for i in (4, 7, 9)]
        s.proc.terminate()
        assert s.proc.wait(timeout=60) == 0, "".join(s.lines[-20:])
        for sock in socks:
            sock.settimeout(30)
            rest = b""
            while True:
                part = sock.recv(65536)
                if not part:
                    break
                rest += part
            assert b"[DONE]" in rest  # the stream was ended, not cut
            sock.close()
        assert any("server stopped" in line for line in s.lines)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def test_next_turns_reuse_their_conversation_cache(batched, local_lookup):
    """Two conversations, turn by turn, concurrently: each second turn finds its first turn
    cached (usage.prompt_tokens_details.cached_tokens) and answers as alone."""
    firsts = [[{"role": "user", "content": c}] for c in ("t13 t14 t15 t16", "t30 t31 t32")]
    got = [None] * 2
    in_threads(ask, [(batched, dict(messages=m, max_tokens=10, temperature=0, seed=0), got, i)
                     for i, m in enumerate(firsts)])
    c = batched.client()
    for m, (answer, _) in zip(firsts, got):
        second = m + [{"role": "assistant", "content": answer}, {"role": "user", "content": "t17"}]
        r = c.chat.completions.create(model=server_model(batched), messages=second, max_tokens=8,
                                      temperature=0)
        want, _ = alone(local_lookup, dict(messages=second, max_tokens=8, temperature=0, seed=0))
        assert r.choices[0].message.content == want
        model, tok = local_lookup
        assert r.usage.prompt_tokens_details.cached_tokens >= len(chat_prompt(tok, m))


def test_concurrent_logprobs_each_equal_mlx_lm(batched, local_lookup, tiny_pair):  # noqa: F811
    """Rows decoding side by side report each token's log-probability as mlx-lm computes it
    for the same tokens."""
    import numpy as np

    from test_logprobs import mlx_lm_logprobs

    model, tok = local_lookup
    reqs = [dict(messages=[{"role": "user", "content": f"t{9 + i} t{30 - i}"}], max_tokens=14,
                 logprobs=True, top_logprobs=2) for i in range(4)]
    got = [None] * 4

    def call(i):
        got[i] = batched.client().chat.completions.create(model=server_model(batched), **reqs[i])

    in_threads(call, [(i,) for i in range(4)])
    for req, r in zip(reqs, got):
        ids = chat_prompt(tok, req["messages"])
        tokens = [t for x in eagle_mlx.stream_generate(model, tok, ids, max_tokens=14)
                  for t in x.tokens]
        ref = mlx_lm_logprobs(tiny_pair[0], ids, tokens)
        content = r.choices[0].logprobs.content
        assert [c.token for c in content] == [tok.decode([t]) for t in tokens]
        np.testing.assert_allclose([c.logprob for c in content],
                                   ref[np.arange(len(tokens)), tokens], atol=1e-4)
        assert all(len(c.top_logprobs) == 2 for c in content)


@pytest.mark.parametrize("max_batch", [1, 3])
def test_a_stop_answers_every_job_still_queued(local_lookup, max_batch):
    """Jobs queued when the runner stops (a burst that arrived with the signal) each get an
    answer, the shutdown's error, and none waits for ever: one at a time and batched."""
    from eagle_mlx.decoding.settings import GenerationSettings
    from eagle_mlx.serving import SHUTTING_DOWN, Job, JobRunner

    model, tok = local_lookup
    runner = JobRunner(model, tok, "m", log=lambda msg: None, max_batch=max_batch)
    jobs = [runner.submit(Job([5 + i, 9], GenerationSettings(max_tokens=4), []))
            for i in range(3)]
    runner.stop()
    runner.run()
    for job in jobs:
        assert job.events.get(timeout=10) == ("error", SHUTTING_DOWN)
    late = runner.submit(Job([5, 9], GenerationSettings(max_tokens=4), []))
    assert late.events.get(timeout=10) == ("error", SHUTTING_DOWN)
