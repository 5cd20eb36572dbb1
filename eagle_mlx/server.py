"""`python -m eagle_mlx.server`: an OpenAI-compatible HTTP server with EAGLE behind it.

    python -m eagle_mlx.server --model ... --eagle ... [--host 127.0.0.1] [--port 8080]

Endpoints (as `mlx_lm.server` has them): POST /v1/chat/completions, POST /v1/completions,
GET /v1/models, GET /health. Built on the standard library's ThreadingHTTPServer, as
mlx_lm.server is: no framework to install or keep up with, and every connection gets a
thread that only parses, validates and streams. Generation runs on the main thread, one
request at a time in arrival order (the model and its caches are not shared between
threads); it keeps a PromptCache, so a request that extends the previous conversation
prefills only its new messages. A client that disconnects stops its generation at the next
target forward.

Three rooms: this module is HTTP (the handler, connection states, errors on the wire, the
command line); `openai_api.py` the OpenAI protocol (requests checked, responses, streams
and log-probabilities shaped); `serving.py` the job runner, batching and the prompt-cache
pool.
"""

import json
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .cli import ArgumentParser, add_kv_args, add_model_args, add_speculate_arg, run_cli
from .errors import EagleError
from .openai_api import MAX_TEMPERATURE, Protocol, RequestError, error_body
from .serving import Job, JobRunner, follow

MAX_BODY_BYTES = 1 << 20  # default limit on a request body
MAX_BATCH = 64            # --max-batch at most
LISTEN_BACKLOG = 256      # connections the kernel queues before the server accepts them
MAX_CONNECTIONS = 256     # open connections served at once; beyond, a 503 (--max-connections)
CONNECTION_ERRORS = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, TimeoutError)


class Handler(BaseHTTPRequestHandler):
    server_version = "eagle_mlx"
    protocol_version = "HTTP/1.1"

    # ------------------------------------------------------------------ plumbing
    @property
    def engine(self) -> JobRunner:
        return self.server.engine

    def handle_one_request(self):
        """One request; a client that resets or drops the connection (idle between requests,
        or while sending its body) ends it with one log line."""
        # (a request line, then its answer begun, then written)
        self.command, self.answering, self.answered = None, False, False
        try:
            super().handle_one_request()
        except CONNECTION_ERRORS as e:
            self.close_connection = True
            when = ("after its answer" if self.answered else
                    "while it was answered" if self.answering else
                    "while sending its request" if self.command else "while idle")
            self.engine.log(f"client {self.client_address[0]}:{self.client_address[1]} closed "
                            f"the connection {when} ({type(e).__name__})")

    def send_response(self, code, message=None):
        self.answering = True
        super().send_response(code, message)

    def log_message(self, fmt, *args):  # one line per request, on stderr
        if self.server.verbose:
            super().log_message(fmt, *args)

    def _send_json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.answered = True

    def _error(self, e: RequestError) -> None:
        self.engine.log(f"refused {self.command} {self.path}: {e} (HTTP {e.status})")
        self._send_json(e.status, error_body(e))

    def _authorized(self) -> bool:
        key = self.server.api_key
        return key is None or self.headers.get("Authorization", "") == f"Bearer {key}"

    def _body(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError("the request needs a Content-Length header with the body's size.",
                               status=411)
        if int(length) > self.server.max_body:
            self.close_connection = True
            raise RequestError(f"the request body is {length} bytes, more than the server's "
                               f"limit of {self.server.max_body}.", status=413)
        raw = self.rfile.read(int(length))
        if len(raw) != int(length):  # the client closed its side mid-body
            raise ConnectionAbortedError(f"{len(raw)} of {length} body bytes arrived")
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise RequestError("the request body is not valid UTF-8.") from None
        except json.JSONDecodeError as e:
            raise RequestError(f"the request body is not valid JSON ({e.msg} at character "
                               f"{e.pos}).") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object.")
        return body

    # ------------------------------------------------------------------ routes
    def do_GET(self):
        try:
            if self.path == "/health":
                return self._send_json(200, {"status": "ok"})
            if not self._authorized():
                raise RequestError("a valid API key is required (Authorization: Bearer KEY).",
                                   status=401, code="invalid_api_key")
            if self.path == "/v1/models":
                return self._send_json(200, {"object": "list", "data": [{
                    "id": self.engine.model_id, "object": "model", "created": self.server.started,
                    "owned_by": "eagle_mlx"}]})
            raise RequestError(f"no such endpoint: GET {self.path}.", status=404)
        except RequestError as e:
            self._error(e)

    def do_POST(self):
        try:
            if not self._authorized():
                raise RequestError("a valid API key is required (Authorization: Bearer KEY).",
                                   status=401, code="invalid_api_key")
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                raise RequestError(f"no such endpoint: POST {self.path}.", status=404)
            body = self._body()
            chat = self.path == "/v1/chat/completions"
            req = self.server.protocol.parse(body, chat)
        except RequestError as e:
            return self._error(e)
        job = self.engine.submit(Job(req.ids, req.settings, req.stop))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            if req.stream:
                self._stream(job, rid, chat, req.include_usage)
            else:
                self._complete(job, rid, chat)
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled.set()  # the client left: generation stops at its next forward
            self.close_connection = True
            self.engine.log(f"client of {rid} disconnected; its generation was stopped")

    def _events(self, job: Job):
        while True:
            event = job.events.get()
            yield event
            if event[0] in ("done", "error"):
                return

    def _logprobs(self, job: Job, scores, chat: bool):
        """The `logprobs` object of these tokens (None where the request did not ask)."""
        return None if job.scores is None else self.server.protocol.logprobs(scores, chat)

    def _complete(self, job: Job, rid: str, chat: bool):
        text, scores = [], []
        for event in self._events(job):
            if event[0] == "text":
                text.append(event[1])
                scores += event[2]
            elif event[0] == "error":
                return self._error(RequestError(event[1]))
            else:
                _, finish, usage = event
        self._send_json(200, self.server.protocol.completion(
            rid, chat, "".join(text), finish, self._logprobs(job, scores, chat), usage))

    def _stream(self, job: Job, rid: str, chat: bool, include_usage: bool):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        created, api = int(time.time()), self.server.protocol

        def send(choices, **extra):
            chunk = api.chunk(rid, chat, created, choices, **extra)
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        if chat:
            send([api.chunk_choice(chat, content="", role=True)])
        for event in self._events(job):
            if event[0] == "text":
                send([api.chunk_choice(chat, content=event[1],
                                       logprobs=self._logprobs(job, event[2], chat))])
            elif event[0] == "error":
                self.wfile.write(f"data: {json.dumps({'error': {'message': event[1]}})}\n\n".encode())
                break
            else:
                _, finish, usage = event
                send([api.chunk_choice(chat, finish=finish)])
                if include_usage:
                    send([], usage=usage)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.answered = True


BUSY = json.dumps({"error": {"message": "the server has too many open connections; try again.",
                              "type": "server_busy", "param": None, "code": "server_busy"}})


class Server(ThreadingHTTPServer):
    daemon_threads = True  # a connection that will not end cannot hold the exit
    allow_reuse_address = True
    # the standard library's backlog of 5 resets the connections of a burst of clients
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, *args, max_connections: int = MAX_CONNECTIONS, log=None, **kwargs):
        self.open = {}  # handler thread -> its connection
        self.open_lock = threading.Lock()
        self.max_connections = max_connections
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        """A connection beyond --max-connections gets a 503 with a JSON error and is closed;
        the others get a thread."""
        with self.open_lock:
            full = len(self.open) >= self.max_connections
        if not full:
            return super().process_request(request, client_address)
        body = BUSY.encode()
        try:
            request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json"
                            b"\r\nConnection: close\r\nRetry-After: 1\r\nContent-Length: "
                            + str(len(body)).encode() + b"\r\n\r\n" + body)
        except OSError:
            pass
        self.log(f"refused a connection from {client_address[0]}: {self.max_connections} "
                 "connections are open (HTTP 503)")
        self.shutdown_request(request)

    def handle_error(self, request, client_address):
        """One line, never a traceback: a client that left, or what failed."""
        kind, value = sys.exc_info()[:2]
        if kind is not None and issubclass(kind, CONNECTION_ERRORS):
            self.log(f"client {client_address[0]}:{client_address[1]} closed the connection "
                     f"({kind.__name__})")
        else:
            self.log(f"error: a request from {client_address[0]} failed "
                     f"({getattr(kind, '__name__', kind)}: {value})")

    def process_request_thread(self, request, client_address):
        with self.open_lock:
            self.open[threading.current_thread()] = request
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.open_lock:
                self.open.pop(threading.current_thread(), None)

    def end_connections(self, timeout: float = 10.0) -> None:
        """Let every handler thread end before the interpreter does (one still running at
        exit can abort the process from inside native code): connections kept alive between
        requests stop waiting for the next one; answers being written finish first."""
        with self.open_lock:
            open_ = dict(self.open)
        for conn in open_.values():
            try:
                conn.shutdown(socket.SHUT_RD)
            except OSError:
                pass  # already closed by the client
        deadline = time.monotonic() + timeout
        for thread in open_:
            thread.join(max(0.0, deadline - time.monotonic()))


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m eagle_mlx.server",
                       description="An OpenAI-compatible server with EAGLE speculative decoding.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help=f"largest request body accepted (default {MAX_BODY_BYTES})")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="max_tokens of a request that gives none (capped by the context)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature of a request that gives none")
    add_speculate_arg(p)
    add_kv_args(p)
    p.add_argument("--max-batch", type=int, default=1,
                   help="requests decoded at once, continuously batched, each its own tree "
                        "(default 1: one at a time, with a prompt cache kept across turns)")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help=f"connections served at once; beyond, a JSON 503 (default "
                        f"{MAX_CONNECTIONS})")
    p.add_argument("--prompt-cache-file", default=None,
                   help="every request goes on after the prompt a cache file holds (python -m "
                        "eagle_mlx.cache_prompt: a document the requests ask about; inside its "
                        "open user message for chat requests); one request at a time")
    p.add_argument("--model-id", default=None, help="the id /v1/models reports (default: the path)")
    p.add_argument("--verbose", action="store_true", help="log every request")
    return p


def _check_flags(args):
    """Every flag's value, before the model loads: the defaults of requests that give none."""
    from .cli import SPECULATE, UsageError, flag_name, kv_settings
    from .decoding.settings import GenerationSettings

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be from 0 to 65535 (got {args.port}).")
    if args.max_body_bytes < 1024:
        raise UsageError(f"--max-body-bytes must be at least 1024 (got {args.max_body_bytes}).")
    try:
        defaults = GenerationSettings(max_tokens=args.max_tokens, temp=args.temp,
                                      speculate=SPECULATE[args.speculate],
                                      **kv_settings(args)).check(name=flag_name)
    except EagleError as e:
        raise UsageError(str(e)) from None
    if args.temp > MAX_TEMPERATURE:
        raise UsageError(f"--temp must be in [0, {MAX_TEMPERATURE:g}] (got {args.temp}).")
    if args.max_connections < 1:
        raise UsageError(f"--max-connections must be at least 1 (got {args.max_connections}).")
    if not 1 <= args.max_batch <= MAX_BATCH:
        raise UsageError(f"--max-batch must be from 1 to {MAX_BATCH} (got {args.max_batch}).")
    if args.kv_bits is not None and args.max_batch > 1:
        raise UsageError("--kv-bits quantizes one sequence's caches; a batch keeps float caches "
                         "(give --max-batch 1 with --kv-bits).")
    if args.prompt_cache_file is not None and args.max_batch > 1:
        raise UsageError("--prompt-cache-file serves one request at a time (give --max-batch 1 "
                         "with it).")
    if args.max_kv_size is not None and args.max_batch > 1:
        raise UsageError("--max-kv-size bounds one sequence's caches; a batch keeps every "
                         "position (give --max-batch 1 with --max-kv-size).")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty.")
    return defaults


def _prepare(model, args, defaults):
    """Before serving: the prompt cache file read (and the defaults it allows), quantized
    caches checked, and auto's costs measured where this machine has no record yet (with
    the quantized caches served with, and a batch's at every size its rows choose with)."""
    cache = None
    if args.prompt_cache_file is not None:
        from .cache_file import load
        from .generate import plain_for_mlx_lm_files

        cache = load(args.prompt_cache_file, model, defaults.kv, defaults.max_kv_size)
        defaults = plain_for_mlx_lm_files(cache, defaults, args.prompt_cache_file)
    if defaults.kv is not None:
        from .decoding.plan import check_kv

        check_kv(model, defaults.kv)  # (refused before serving, not at every request)
    if defaults.speculate == "auto" and model.group is None:
        model.costs()
        if defaults.kv is not None:
            model.costs(defaults.kv)
        size = 2
        while size <= args.max_batch:
            model.costs(batch=size)
            size *= 2
    return cache, defaults


def _mode(model, defaults, max_batch: int) -> str:
    """What the server decodes with, as its first line says."""
    mode = "plain decoding" if model.head is None else f"{model.head.kind} head"
    if model.lookup is not None:
        mode = "prompt lookup" if model.head is None else mode + " with prompt lookup"
    if defaults.speculate == "auto" and model.group is None:
        mode = "adaptive: plain" + (", prompt lookup" if model.auto_lookup is not None else "") \
            + ("" if model.head is None else f", {model.head.kind} head")
    if max_batch > 1:
        mode += f", up to {max_batch} requests batched"
    return mode


def _main(argv) -> int:
    from .cli import UsageError, load_from_args

    args = build_parser().parse_args(argv)
    defaults = _check_flags(args)
    model, tokenizer = load_from_args(args)
    if model.group is not None and args.max_batch > 1:
        raise UsageError("--max-batch runs on one machine; under mlx.launch serve one request at "
                         "a time (--max-batch 1).")
    if model.group is not None and model.group.rank() != 0:
        follow(model, tokenizer)  # rank 0 serves; this rank runs its share of the work
        return 0
    model_id = args.model_id or args.model or "eagle_mlx-demo"
    cache, defaults = _prepare(model, args, defaults)
    try:
        server = Server((args.host, args.port), Handler, max_connections=args.max_connections)
    except OSError as e:
        raise EagleError(f"cannot listen on {args.host}:{args.port} ({e.strerror}).") from None
    server.engine = JobRunner(model, tokenizer, model_id, max_batch=args.max_batch)
    if cache is not None:
        server.engine.cache = cache
    server.protocol = Protocol(model_id, tokenizer, model.target.max_context, defaults,
                               None if cache is None else list(cache.tokens))
    server.api_key, server.max_body = args.api_key, args.max_body_bytes
    server.verbose, server.started = args.verbose, int(time.time())

    def shut_down():
        server.shutdown()  # no new connections
        server.engine.stop()  # what runs is cancelled, what waits is refused

    def stop(signum, frame):  # Ctrl-C / SIGTERM: stop accepting, finish, exit
        threading.Thread(target=shut_down, daemon=True).start()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    http = threading.Thread(target=server.serve_forever, name="eagle-http", daemon=True)
    http.start()
    host, port = server.server_address[:2]
    print(f"serving {model_id} ({_mode(model, defaults, args.max_batch)}) on "
          f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
    try:
        server.engine.run()  # here, on the main thread, until a signal stops it
    finally:
        server.engine.stop()
        server.shutdown()
        server.end_connections()  # answers being written finish first
        server.server_close()
    print("server stopped", file=sys.stderr, flush=True)
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
