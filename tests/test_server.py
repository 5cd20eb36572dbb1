"""The OpenAI-compatible server, run as a user runs it: a real subprocess on a free port,
driven with the official `openai` client and with raw HTTP."""

import http.client
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import eagle_mlx
from eagle_mlx.cli import chat_prompt
from tiny import ROOT, make_eagle_head, tiny_llama

openai = pytest.importorskip("openai", reason="the openai client (test extra) is not installed")

KEY = "test-key"


class Running:
    def __init__(self, args, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eagle_mlx.server", "--port", "0", *map(str, args)],
            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            env=dict(os.environ, **(env or {})))
        self.lines = []
        line = ""
        deadline = time.time() + 300
        while "serving" not in line:
            line = self.proc.stderr.readline()
            if not line or time.time() > deadline:
                raise RuntimeError("the server did not start: " + "".join(self.lines) + line)
            self.lines.append(line)
        self.port = int(line.rsplit(":", 1)[1].split("/")[0])
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def client(self, key=KEY):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key,
                             max_retries=0, timeout=120)

    def raw(self, method, path, body=None, headers=None, key=KEY):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        h = {"Authorization": f"Bearer {key}"} if key else {}
        h.update(headers or {})
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, data

    def stop(self):
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    target = tiny_llama(root / "target", num_hidden_layers=2, max_position_embeddings=4096)
    # end-of-turn (</s>, id 2) made unlikely, so that answers run long enough to test with
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(target / "model.safetensors"))
    weights["lm_head.weight"][2] = 0.0
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    head = make_eagle_head(root / "head", target, "eagle1", seed=1)
    return target, head


@pytest.fixture(scope="module")
def server(tiny_pair):
    target, head = tiny_pair
    s = Running(["--model", target, "--eagle", head, "--api-key", KEY, "--max-body-bytes", 4096])
    yield s
    code = s.stop()
    assert code == 0, "".join(s.lines[-20:])  # SIGTERM: a clean shutdown


@pytest.fixture(scope="module")
def local(tiny_pair):
    target, head = tiny_pair
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    return model, tok


def greedy(local, messages, n):
    model, tok = local
    ids = chat_prompt(tok, messages)
    rs = list(eagle_mlx.stream_generate(model, tok, ids, max_tokens=n))
    return "".join(r.text for r in rs), len(ids), rs[-1].generation_tokens


def test_chat_streaming_and_not_equal_generate(server, local):
    messages = [{"role": "user", "content": "t5 t9 t11"}]
    want, n_prompt, n_out = greedy(local, messages, 24)
    c = server.client()
    r = c.chat.completions.create(model=server_model(server), messages=messages, max_tokens=24,
                                  temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == n_out
    assert r.usage.total_tokens == n_prompt + n_out
    assert r.usage.model_extra["eagle"]["target_forwards"] >= 1
    assert r.usage.model_extra["eagle"]["tau"] >= 1.0
    chunks = list(c.chat.completions.create(messages=messages, max_tokens=24, stream=True,
                                            model=server_model(server),
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == n_out and chunks[-1].choices == []
    # raw SSE ends with [DONE]
    status, data = server.raw("POST", "/v1/chat/completions",
                              {"messages": messages, "max_tokens": 4, "stream": True})
    assert status == 200 and data.decode().rstrip().endswith("data: [DONE]")


def server_model(server):
    status, data = server.raw("GET", "/v1/models")
    assert status == 200
    return json.loads(data)["data"][0]["id"]


def test_stop_strings_and_completions(server, local):
    for i in range(5, 60):  # a prompt whose answer is long enough to cut
        messages = [{"role": "user", "content": f"t{i} t8"}]
        want, _, _ = greedy(local, messages, 24)
        words = want.split()
        if len(words) >= 6 and words[3] not in words[:3]:
            break
    stop = " " + words[3]  # cut before the fourth word
    r = server.client().chat.completions.create(model=server_model(server), messages=messages,
                                                max_tokens=24, stop=[stop, "never-there"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == want[: want.index(stop)]
    model, tok = local
    text = eagle_mlx.generate(model, tok, "t5 t6 t7", max_tokens=10)
    r = server.client().completions.create(model=server_model(server), prompt="t5 t6 t7",
                                           max_tokens=10)
    assert r.choices[0].text == text


def test_concurrent_clients_each_get_their_own_output(server, local):
    prompts = [[{"role": "user", "content": f"t{5 + i} t{20 + 3 * i} t{40 - i}"}] for i in range(8)]
    wants = [greedy(local, m, 16)[0] for m in prompts]
    got = [None] * 8

    def ask(i):
        got[i] = server.client().chat.completions.create(
            model=server_model(server), messages=prompts[i], max_tokens=16).choices[0].message.content

    in_threads(ask, [(i,) for i in range(8)])
    assert got == wants


def open_stream(server, req):
    """A raw streaming request whose stream has begun (its generation runs): the socket."""
    import socket

    body = json.dumps(dict(req, stream=True)).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    seen = b""
    while b"data: " not in seen:
        seen += sock.recv(4096)
    return sock


def in_threads(fn, args_list, timeout=300):
    """fn(*args) for every args at once, each on its own thread; waits for all."""
    threads = [threading.Thread(target=fn, args=args) for args in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)


def test_a_client_that_leaves_stops_its_generation(server, local):
    sock = open_stream(server, {"messages": [{"role": "user", "content": "t9 t10"}],
                                "max_tokens": 3000})
    sock.close()  # the client leaves
    start = time.time()
    messages = [{"role": "user", "content": "t11 t12"}]
    want, _, _ = greedy(local, messages, 8)
    r = server.client().chat.completions.create(model=server_model(server), messages=messages,
                                                max_tokens=8)
    assert r.choices[0].message.content == want
    assert time.time() - start < 60
    deadline = time.time() + 10
    while time.time() < deadline and not any("disconnected" in l for l in server.lines):
        time.sleep(0.1)
    assert any("disconnected; its generation was stopped" in l for l in server.lines)


def test_second_turn_reuses_the_cache(server, local):
    c = server.client()
    first = [{"role": "user", "content": "t13 t14 t15 t16"}]
    r1 = c.chat.completions.create(model=server_model(server), messages=first, max_tokens=12)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "t17"}]
    r2 = c.chat.completions.create(model=server_model(server), messages=second, max_tokens=12)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens, (cached, r1.usage)
    assert r2.choices[0].message.content == greedy(local, second, 12)[0]


def test_logprobs_chat_and_completions_streamed_and_not(server, local, tiny_pair):
    """OpenAI's logprobs shapes, each token's value mlx-lm's for the same tokens (greedy, with
    the server's speculation); streamed chunks carry the same entries as the whole answer."""
    from test_logprobs import mlx_lm_logprobs

    model, tok = local
    target = tiny_pair[0]
    messages = [{"role": "user", "content": "t7 t9 t13"}]
    ids = chat_prompt(tok, messages)
    tokens = [t for r in eagle_mlx.stream_generate(model, tok, ids, max_tokens=12)
              for t in r.tokens]
    ref = mlx_lm_logprobs(target, ids, tokens)
    decode = lambda t: tok.decode([t])  # noqa: E731

    def check_chat(content):
        assert [c["token"] for c in content] == [decode(t) for t in tokens]
        for c, t, row in zip(content, tokens, ref):
            assert abs(c["logprob"] - row[t]) < 1e-4 and c["bytes"] == list(c["token"].encode())
            best = np.argsort(-row)[:3]
            assert [a["token"] for a in c["top_logprobs"]] == [decode(b) for b in best]
            np.testing.assert_allclose([a["logprob"] for a in c["top_logprobs"]], row[best],
                                       atol=1e-4)

    body = {"messages": messages, "max_tokens": 12, "logprobs": True, "top_logprobs": 3}
    status, data = server.raw("POST", "/v1/chat/completions", body)
    assert status == 200, data
    whole = json.loads(data)["choices"][0]["logprobs"]["content"]
    check_chat(whole)
    status, data = server.raw("POST", "/v1/chat/completions", dict(body, stream=True))
    chunks = [json.loads(line[6:]) for line in data.decode().splitlines()
              if line.startswith("data: {")]
    check_chat([c for ch in chunks for c in (ch["choices"][0]["logprobs"] or {}).get("content", [])])
    # completions: parallel lists, each token's offset in the text
    prompt_ids = tok.encode("t7 t9 t13")
    tokens = [t for r in eagle_mlx.stream_generate(model, tok, "t7 t9 t13", max_tokens=10)
              for t in r.tokens]
    ref = mlx_lm_logprobs(target, prompt_ids, tokens)
    for stream in (False, True):
        status, data = server.raw("POST", "/v1/completions", {
            "prompt": "t7 t9 t13", "max_tokens": 10, "logprobs": 2, "stream": stream})
        assert status == 200, data
        parts = [json.loads(line[6:])["choices"][0] for line in data.decode().splitlines()
                 if line.startswith("data: {")] if stream else [json.loads(data)["choices"][0]]
        text = "".join(p["text"] for p in parts)
        lp = {k: [v for p in parts if p["logprobs"] for v in p["logprobs"][k]]
              for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert lp["tokens"] == [decode(t) for t in tokens]
        np.testing.assert_allclose(lp["token_logprobs"], ref[np.arange(len(tokens)), tokens],
                                   atol=1e-4)
        assert [len(d) for d in lp["top_logprobs"]] == [2] * len(tokens)
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert all(text[o:].lstrip().startswith(t.strip()) for o, t in
                   zip(lp["text_offset"], lp["tokens"]))
    # not asked: null
    status, data = server.raw("POST", "/v1/completions", {"prompt": "t7", "max_tokens": 2})
    assert json.loads(data)["choices"][0]["logprobs"] is None


BAD = [
    ("POST", "/v1/chat/completions", b"{not json", {}, 400),
    ("POST", "/v1/chat/completions", b"\xff\xfe{}", {}, 400),
    ("POST", "/v1/chat/completions", b"[1, 2]", {}, 400),
    ("POST", "/v1/chat/completions", {"messages": []}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": -3}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": 10**12}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": "ten"}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "temperature": "hot"}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "top_p": 0}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "seed": -1}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "stop": [1]}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "stream": "yes"}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "model": "gpt-9"}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "n": 3}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": " ".join(
        ["t5"] * 5000)}]}, {}, 413),
    ("POST", "/v1/completions", {"prompt": ""}, {}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": "yes"}, {}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, {}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": True}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "logprobs": "yes"}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "logprobs": True, "top_logprobs": 21}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "top_logprobs": 2}, {}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
     {"key": "wrong"}, 401),
    ("GET", "/v1/models", None, {"key": None}, 401),
    ("POST", "/v1/nothing", {}, {}, 404),
]


@pytest.mark.parametrize("method,path,body,opts,status", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_a_json_error_and_the_server_goes_on(server, method, path, body, opts,
                                                               status):
    got, data = server.raw(method, path, body, key=opts.get("key", KEY))
    assert got == status, (got, data)
    error = json.loads(data)["error"]
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
    assert server.raw("GET", "/health", key=None) == (200, b'{"status": "ok"}')
    assert server.proc.poll() is None


@pytest.mark.long
def test_the_demo_pair_serves_what_generate_writes(demo_model):
    s = Running([])  # the demo pair, no key
    try:
        messages = [{"role": "user", "content": "Name a colour."}]
        model, tok = demo_model
        ids = chat_prompt(tok, messages)
        want = eagle_mlx.generate(model, tok, ids, max_tokens=4)
        r = s.client(key="unused").chat.completions.create(model="default", messages=messages,
                                                           max_tokens=4)
        assert r.choices[0].message.content == want
        eagle = r.usage.model_extra["eagle"]  # what adaptive speculation chose, pass by pass
        assert sum(eagle["passes"].values()) == eagle["target_forwards"] - 1
    finally:
        assert s.stop() == 0
