"""The server under load and bad clients, run as a user runs it: a burst of 50 clients all
answered (each with its text alone), connections beyond the bound refused with a JSON 503,
clients that reset at any point logged in one line each."""

import http.client
import json
import socket
import struct
import time

import pytest

import eagle_mlx
from eagle_mlx.cli import chat_prompt
from test_server import KEY, Running, in_threads, open_stream, openai, tiny_pair  # noqa: F401

assert openai  # (the test_server module skips without the openai client)

MAX_CONNECTIONS = 60


@pytest.fixture(scope="module")
def loaded(tiny_pair):  # noqa: F811
    target, head = tiny_pair
    s = Running(["--model", target, "--eagle", head, "--api-key", KEY, "--max-batch", 4,
                 "--max-connections", MAX_CONNECTIONS])
    yield s
    assert s.stop() == 0, "".join(s.lines[-20:])


@pytest.fixture(scope="module")
def local(tiny_pair):  # noqa: F811
    target, head = tiny_pair
    return eagle_mlx.load(str(target), eagle=str(head))


def post(port, body, timeout=300):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", "/v1/chat/completions", body=data,
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, json.loads(r.read() or b"{}")
    conn.close()
    return out


def reset(sock):
    """Close with a TCP reset (RST), as a client that crashes does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def wait_for(server, fragments, count, seconds=20):
    """Whether `count` log lines hold one of `fragments` (a string, or a tuple of them)."""
    fragments = (fragments,) if isinstance(fragments, str) else fragments
    deadline = time.time() + seconds
    while time.time() < deadline:
        if sum(any(f in line for f in fragments) for line in server.lines) >= count:
            return True
        time.sleep(0.1)
    return False


def test_fifty_concurrent_clients_are_all_answered(loaded, local):
    """45 well-formed requests and 5 malformed ones, all at once (the standard library's
    listen backlog of 5 reset most of such a burst): every well-formed one gets its greedy
    text as stream_generate writes it alone, every malformed one a 400, none is dropped."""
    model, tok = local
    prompts = [f"t{5 + i} t{30 - i}" for i in range(9)]
    alone = {}
    for p in prompts:
        ids = chat_prompt(tok, [{"role": "user", "content": p}])
        alone[p] = "".join(r.text for r in eagle_mlx.stream_generate(model, tok, ids,
                                                                     max_tokens=6))
    bodies = [{"messages": [{"role": "user", "content": prompts[i % 9]}], "max_tokens": 6,
               "temperature": 0} for i in range(45)]
    bodies += [b"{not json", {"messages": []}, {"messages": [{"role": "user", "content": "t5"}],
                                                "temperature": "hot"},
               {"messages": [{"role": "user", "content": "t5"}], "max_tokens": -1},
               {"messages": "t5"}]
    got = [None] * len(bodies)

    def one(i):
        try:
            got[i] = post(loaded.port, bodies[i])
        except OSError as e:  # a reset or refused connection: what must not happen
            got[i] = (type(e).__name__, str(e))

    in_threads(one, [(i,) for i in range(len(bodies))])
    for i in range(45):
        status, body = got[i]
        assert status == 200, (i, got[i])
        assert body["choices"][0]["message"]["content"] == alone[prompts[i % 9]], i
    assert [g[0] for g in got[45:]] == [400] * 5, got[45:]
    assert all("error" in g[1] for g in got[45:])


def test_connections_beyond_the_bound_get_a_json_503(loaded):
    """With --max-connections connections open (idle), one more is answered 503 with a JSON
    error and closed; once they close, requests are served again."""
    idle = [socket.create_connection(("127.0.0.1", loaded.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)  # (every connection accepted and holding its thread)
        conn = http.client.HTTPConnection("127.0.0.1", loaded.port, timeout=30)
        conn.request("GET", "/health")
        r = conn.getresponse()
        status, body = r.status, json.loads(r.read())
        conn.close()
    finally:
        for s in idle:
            s.close()
    assert status == 503 and body["error"]["code"] == "server_busy", (status, body)
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            status, _ = post(loaded.port, {"messages": [{"role": "user", "content": "t5"}],
                                           "max_tokens": 2})
        except OSError:
            status = None
        if status == 200:
            break
        time.sleep(0.2)
    assert status == 200


def test_clients_that_reset_are_one_log_line_each(loaded):
    """A client resetting while idle (after an answer, keep-alive), mid-body and mid-stream:
    one line each in the server's log, no traceback, and the next request is served."""
    before = len(loaded.lines)
    # idle: an answered request, then a reset on the kept-alive connection
    s = socket.create_connection(("127.0.0.1", loaded.port))
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b"}"):  # the whole answer: headers and the JSON body
        answer += s.recv(4096)
    assert b"200" in answer.split(b"\r\n")[0]
    reset(s)  # (the server may still be finishing its request when the reset arrives)
    assert wait_for(loaded, ("closed the connection while idle",
                             "closed the connection after its answer"), 1), loaded.lines[before:]
    # mid-body: the headers promise 200 bytes, 10 arrive, then a reset
    s = socket.create_connection(("127.0.0.1", loaded.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
              + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: 200"
              b"\r\n\r\n{\"messages")
    time.sleep(0.3)
    reset(s)
    assert wait_for(loaded, "closed the connection while sending its request", 1), \
        loaded.lines[before:]
    # mid-stream
    sock = open_stream(loaded, {"messages": [{"role": "user", "content": "t9 t10"}],
                                "max_tokens": 3000})
    reset(sock)
    assert wait_for(loaded, "disconnected; its generation was stopped", 1), loaded.lines[before:]
    status, body = post(loaded.port, {"messages": [{"role": "user", "content": "t5"}],
                                      "max_tokens": 3})
    assert status == 200 and body["choices"][0]["message"]["content"]
    log = "".join(loaded.lines[before:])
    assert "Traceback" not in log, log
    assert all(line.count("\n") <= 1 for line in loaded.lines[before:])


def test_a_bad_flag_for_connections_is_refused(tiny_pair):  # noqa: F811
    from eagle_mlx.server import main

    target, head = tiny_pair
    assert main(["--model", str(target), "--max-connections", "0"]) == 2
