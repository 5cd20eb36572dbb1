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
"""

import json
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional

from .cli import ArgumentParser, add_kv_args, add_model_args, add_speculate_arg, run_cli
from .errors import EagleError, is_int

MAX_BODY_BYTES = 1 << 20  # default limit on a request body
MAX_STOP_STRINGS = 4      # as OpenAI's API
MAX_BATCH = 64            # --max-batch at most
LISTEN_BACKLOG = 256      # connections the kernel queues before the server accepts them
MAX_CONNECTIONS = 256     # open connections served at once; beyond, a 503 (--max-connections)
CONNECTION_ERRORS = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, TimeoutError)
SHUTTING_DOWN = "the server is shutting down."


class RequestError(Exception):
    """A bad request: HTTP status and one sentence for the OpenAI-style error object."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _int(body, key, default, low, high=None):
    value = body.get(key, default)
    if value is None:
        return default
    if not is_int(value) or value < low or \
            (high is not None and value > high):
        bound = f" from {low} to {high}" if high is not None else f" of at least {low}"
        raise RequestError(f"'{key}' must be a whole number{bound} (got {value!r}).", param=key)
    return value


# the API's bounds beyond the package's own checks (OpenAI's: temperature at most 2)
MAX_TEMPERATURE = 2.0
MAX_REQUEST_TOKENS = 10**9


def request_settings(body: dict, defaults, max_tokens_key: str):
    """The request's GenerationSettings: OpenAI's field names translated, every value
    checked where every other caller's is (`GenerationSettings.check`), then the API's own
    bounds; a bad value is a RequestError naming the field."""
    fields = {"max_tokens": max_tokens_key, "temp": "temperature", "top_p": "top_p",
              "min_p": "min_p", "top_k": "top_k", "seed": "seed"}
    given = {f: body[k] for f, k in fields.items() if body.get(k) is not None}
    settings = defaults.replace(**given)
    try:
        settings.check(name=lambda f: f"'{fields.get(f, f)}'")
    except EagleError as e:
        raise RequestError(str(e), param=fields.get(e.param, e.param)) from None
    if settings.temp > MAX_TEMPERATURE:
        raise RequestError(f"'temperature' must be a number in [0, {MAX_TEMPERATURE:g}] (got "
                           f"{settings.temp!r}).", param="temperature")
    if settings.max_tokens > MAX_REQUEST_TOKENS:
        raise RequestError(f"'{max_tokens_key}' must be a whole number from 1 to "
                           f"{MAX_REQUEST_TOKENS} (got {settings.max_tokens!r}).",
                           param=max_tokens_key)
    return settings


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """The alternatives a request asks for with each token's log-probability (None: no
    log-probabilities). Chat: `logprobs` true and `top_logprobs`; completions: `logprobs`,
    the number of alternatives."""
    from .decoding.settings import MAX_TOP_LOGPROBS

    asked = body.get("logprobs")
    if not chat:
        if asked is not None and not (is_int(asked) and 0 <= asked <= MAX_TOP_LOGPROBS):
            raise RequestError(f"'logprobs' must be null or the number of top alternatives to "
                               f"return with each token, from 0 to {MAX_TOP_LOGPROBS} (got "
                               f"{asked!r}).", param="logprobs")
        return asked
    if asked is not None and not isinstance(asked, bool):
        raise RequestError(f"'logprobs' must be true or false (got {asked!r}).", param="logprobs")
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not asked:
        raise RequestError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return (top or 0) if asked else None


def _text_content(content, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"{where} must be a string or a list of text parts.", param="messages")


class Job:
    """One request on its way through the job runner: settings in, events out. The events
    are ("text", str, scores) ... ("done", finish, usage) | ("error", message); scores: the
    log-probabilities of the tokens that made the text (where the request asked for them)."""

    def __init__(self, ids: List[int], settings, stop: List[str]):
        from .decoding.responses import ScoreRelease, StopFilter

        self.ids, self.settings, self.stop = ids, settings, stop
        self.events = queue.Queue()
        self.cancelled = threading.Event()
        self.stops = StopFilter(stop)
        self.scores = None if settings.logprobs is None else ScoreRelease()

    def feed(self, r) -> Optional[str]:
        """A GenerationResponse's text (and scores) through the stop strings to the events;
        returns the finish reason (a stop string finishes it too)."""
        emit, finish = self.stops.feed(r.text, r.finish_reason)
        scores = [] if self.scores is None else self.scores.feed(r.logprobs, emit, finish)
        if emit or scores:
            self.events.put(("text", emit, scores))
        return finish


class PromptCachePool:
    """The prompt caches of the latest finished requests (batched serving), at most `size`,
    the least recently used dropped first: a request takes the one sharing the longest
    prefix with its prompt, and gives it back when it leaves."""

    def __init__(self, size: int):
        self.size, self.caches = size, []  # most recently used last

    def take(self, ids):
        """The cache sharing the longest prefix with `ids` (out of the pool while its
        request runs), or a new one where none shares any."""
        from .decoding.steps import PromptCache

        best, most = None, 0
        for pc in self.caches:
            n = pc.shared_prefix(ids)
            if n > most:
                best, most = pc, n
        if best is None:
            return PromptCache()
        self.caches.remove(best)
        best.reused = 0  # (until its request joins)
        return best

    def put(self, pc) -> int:
        """A request's cache back (as it left it); returns the prompt tokens it found cached."""
        self.caches.append(pc)
        del self.caches[: -self.size]
        return pc.reused


class JobRunner:
    """The model, the loop that runs its generations (one at a time, or continuously
    batched), and the prompt caches it keeps. `run` is called on the main thread: MLX gives
    every thread its own streams, and a process whose other threads computed with MLX can
    abort as it exits."""

    def __init__(self, model, tokenizer, model_id: str, log=None, max_batch: int = 1):
        """Under mlx.launch (model.group set) this is rank 0: every request is sent to the
        other ranks (`follow`), which run the same generation on their shards. max_batch > 1:
        up to that many requests decode at once, continuously batched (`batch.py`)."""
        from .decoding.steps import PromptCache

        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.max_batch, self.running = max_batch, {}
        self.pool = PromptCachePool(max_batch)
        self.cache = PromptCache()
        self.prefix = None  # the tokens of a prompt cache file every request goes on after
        self.jobs = queue.Queue()
        self.current, self.stopping = None, False
        self.lock = threading.Lock()  # no job is queued behind the end of the loop
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def submit(self, job: Job) -> Job:
        with self.lock:
            if self.stopping:
                job.events.put(("error", SHUTTING_DOWN))
            else:
                self.jobs.put(job)
        return job

    def stop(self) -> None:
        """Cancel what runs, refuse what waits, and end `run` (from any thread)."""
        with self.lock:
            if not self.stopping:
                self.stopping = True
                if self.current is not None:
                    self.current.cancelled.set()
                for job in list(self.running.values()):
                    job.cancelled.set()
                self.jobs.put(None)

    def _next_job(self):
        """The next job, waited for in short slices: Python runs a signal's handler only on
        the main thread between bytecodes, and a signal the kernel hands to another thread
        (MLX's, BLAS's) would otherwise wait behind a wait that never ends."""
        while True:
            try:
                return self.jobs.get(timeout=0.25)
            except queue.Empty:
                pass

    def _queued(self):
        """The next queued job without waiting (False: none)."""
        try:
            return self.jobs.get_nowait()
        except queue.Empty:
            return False

    def run(self) -> None:
        """Serve the queued jobs until `stop`."""
        from .distributed import share_text

        if self.max_batch > 1:
            return self._run_batched()
        while True:
            job = self.current = self._next_job()
            if job is None:
                share_text(self.model.group, None)  # the other ranks stop too
                return
            if job.cancelled.is_set() or self.stopping:
                job.events.put(("error", SHUTTING_DOWN))
                continue
            try:
                self._run(job)
            except EagleError as e:
                job.events.put(("error", str(e)))
            except Exception as e:  # keep serving: the request fails, the server does not
                self.log(f"error: generation failed ({type(e).__name__}: {e})")
                job.events.put(("error", "generation failed inside the server."))
            finally:
                self.current = None

    def _run(self, job: Job):
        from .distributed import (CANCELLED, CONTINUE, FINISHED, share_response_signal,
                                  share_text)
        from .generation import stream_generate

        group = self.model.group
        share_text(group, json.dumps({"ids": job.ids, "settings": job.settings.asdict()}))
        finish, last = None, None
        for r in stream_generate(self.model, self.tokenizer, job.ids, prompt_cache=self.cache,
                                 settings=job.settings):
            last = r
            if job.cancelled.is_set():
                share_response_signal(group, CANCELLED)  # the other ranks stop with it
                finish = "cancelled"
                break
            finish = job.feed(r)
            if share_response_signal(group, FINISHED if finish else CONTINUE) != CONTINUE:
                break
        self._done(job, finish, last, self.cache.reused)

    @staticmethod
    def _done(job: Job, finish, last, cached: int) -> None:
        usage = {
            "prompt_tokens": len(job.ids),
            "completion_tokens": last.generation_tokens if last else 0,
            "total_tokens": len(job.ids) + (last.generation_tokens if last else 0),
            "prompt_tokens_details": {"cached_tokens": cached},
            "eagle": {"tau": round(last.mean_accept_length, 4) if last else 0.0,
                      "target_forwards": last.target_forwards if last else 0,
                      "speculative": bool(last and (
                          any(k != "plain" for k in last.passes) if last.passes
                          else last.accept_lengths)),
                      "passes": dict(last.passes) if last else {}},
        }
        job.events.put(("done", "stop" if finish in ("stop", "cancelled") else finish or "length",
                        usage))

    # ---------------------------------------------------------------- batched
    def _run_batched(self) -> None:
        """Serve the queued jobs continuously batched until `stop`: between cycles, new jobs
        join (their prefill a chunk per cycle), finished and cancelled ones leave."""
        from .decoding.batch import BatchGenerator

        gen = BatchGenerator(self.model, self.tokenizer, self.max_batch)
        self.last, self.caches = {}, {}  # per running request: its latest response, its cache
        while True:
            job = False if gen.busy else self._next_job()  # wait for work only when there is none
            if job is False:
                job = self._queued()
            while job is not False:
                if job is None or self.stopping:
                    return self._end_batched(job)
                self._admit(gen, job)
                job = self._queued()
            for uid, j in list(self.running.items()):
                if j.cancelled.is_set():  # the client left
                    gen.cancel(uid)
                    self._leave(uid, "cancelled", self.last.pop(uid, None))
            try:
                out = gen.step()
            except Exception as e:  # the batch fails, the server does not
                self.log(f"error: batched generation failed ({type(e).__name__}: {e})")
                for j in self.running.values():
                    j.events.put(("error", "generation failed inside the server."))
                self.running.clear()
                self.last.clear()
                gen = BatchGenerator(self.model, self.tokenizer, self.max_batch)
                continue
            self._deliver(gen, out)

    def _admit(self, gen, job: Job) -> None:
        """A queued job joins the batch with the pooled cache that fits it best."""
        if job.cancelled.is_set():
            job.events.put(("error", SHUTTING_DOWN))
            return
        pc = self.pool.take(job.ids)
        try:
            uid = gen.add(job.ids, job.settings, prompt_cache=pc)
        except EagleError as e:
            self.pool.put(pc)  # (a refused request leaves the cache as it was)
            job.events.put(("error", str(e)))
            return
        self.running[uid], self.caches[uid] = job, pc

    def _deliver(self, gen, out) -> None:
        """A step's responses to their requests' events; finished requests leave."""
        for uid, r in out:
            if uid not in self.running:
                continue
            self.last[uid] = r
            finish = self.running[uid].feed(r)
            if finish is not None:
                if r.finish_reason is None:  # a stop string: it leaves the batch
                    gen.cancel(uid)
                self._leave(uid, finish, self.last.pop(uid))

    def _leave(self, uid, finish, last) -> None:
        job = self.running.pop(uid)
        self._done(job, finish, last, self.pool.put(self.caches.pop(uid)))

    def _end_batched(self, job) -> None:
        """`stop`: the job that asked for it (if any) and every job still queued behind it
        refused, the running ones cancelled (no request waits on an answer that never
        comes; `submit` queues nothing once stopping is set)."""
        while job is not False:
            if job is not None:
                job.events.put(("error", SHUTTING_DOWN))
            job = self._queued()
        for uid, j in list(self.running.items()):
            self._done(j, "cancelled", self.last.get(uid), 0)
        self.running.clear()


def follow(model, tokenizer) -> None:
    """Ranks other than 0: run every generation rank 0's server runs, on this rank's shard,
    until it stops."""
    from .distributed import CONTINUE, share_response_signal, share_text
    from .generation import stream_generate
    from .decoding.steps import PromptCache
    from .decoding.settings import GenerationSettings

    cache = PromptCache()
    while True:
        spec = share_text(model.group, None)
        if spec is None:
            return
        spec = json.loads(spec)
        try:
            for r in stream_generate(model, tokenizer, spec["ids"], prompt_cache=cache,
                                     settings=GenerationSettings(**spec["settings"])):
                if share_response_signal(model.group, CONTINUE) != CONTINUE:
                    break
        except EagleError:
            pass  # rank 0 answers the request with the same error


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
        kind = {401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error"}.get(e.status, "invalid_request_error")
        self._send_json(e.status, {"error": {"message": str(e), "type": kind, "param": e.param,
                                             "code": e.code}})

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
            ids, settings, stop, stream, usage_in_stream = self._parse(body, chat)
        except RequestError as e:
            return self._error(e)
        job = self.engine.submit(Job(ids, settings, stop))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            if stream:
                self._stream(job, rid, chat, usage_in_stream)
            else:
                self._complete(job, rid, chat)
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled.set()  # the client left: generation stops at its next forward
            self.close_connection = True
            self.engine.log(f"client of {rid} disconnected; its generation was stopped")

    def _parse(self, body: dict, chat: bool):
        from .cli import chat_prompt
        from .decoding.plan import encode_prompt

        model = body.get("model")
        if model is not None and model not in (self.engine.model_id, "default"):
            raise RequestError(f"unknown model {model!r}; this server serves "
                               f"{self.engine.model_id!r}.", param="model", code="model_not_found")
        tok = self.engine.tokenizer
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError("'messages' must be a non-empty list of messages.",
                                   param="messages")
            rendered = []
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                                     "developer"):
                    raise RequestError(f"messages[{i}] must be an object with a 'role' of system, "
                                       "user, assistant or developer.", param="messages")
                role = "system" if m["role"] == "developer" else m["role"]
                rendered.append({"role": role,
                                 "content": _text_content(m.get("content"), f"messages[{i}].content")})
            if not getattr(tok, "chat_template", None):
                raise RequestError("this model has no chat template; use /v1/completions.")
            prefix = self.engine.prefix
            if prefix is None:
                ids = chat_prompt(tok, rendered)
            else:  # (the file's prompt, then the conversation from its first user message)
                from .generate import continuation

                first = next((i for i, m in enumerate(rendered) if m["role"] == "user"), None)
                if first is None:
                    raise RequestError("'messages' must hold a user message: it goes on "
                                       "after the server's cached prompt.", param="messages")
                ids = prefix + continuation(tok, rendered, True, first)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise RequestError("'prompt' must be a non-empty string.", param="prompt")
            ids = encode_prompt(tok, prompt)
            if self.engine.prefix is not None:
                ids = self.engine.prefix + ids
        context = self.engine.model.target.max_context
        if len(ids) >= context:
            raise RequestError(f"the prompt is {len(ids)} tokens long; the model's context is "
                               f"{context} tokens.", param="messages" if chat else "prompt",
                               code="context_length_exceeded")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        settings = request_settings(body, self.server.defaults, key)
        # capped by the context
        settings = settings.replace(max_tokens=min(settings.max_tokens, context - len(ids)))
        if _int(body, "n", 1, 1, 1) != 1:
            raise RequestError("'n' must be 1.", param="n")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS and
                all(isinstance(s, str) and s for s in stop)):
            raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} "
                               "non-empty strings.", param="stop")
        settings = settings.replace(logprobs=_logprobs(body, chat))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("'stream' must be true or false.", param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise RequestError("'stream_options' must be an object with a boolean "
                               "'include_usage'.", param="stream_options")
        return ids, settings, stop, stream, bool(options.get("include_usage", False))

    def _events(self, job: Job):
        while True:
            event = job.events.get()
            yield event
            if event[0] in ("done", "error"):
                return

    def _token_text(self, token: int) -> str:
        """A token as text, decoded alone (kept: the same tokens come back often)."""
        texts = self.server.token_texts
        if token not in texts:
            texts[token] = self.engine.tokenizer.decode([token])
        return texts[token]

    def _logprobs(self, job: Job, scores, chat: bool):
        """OpenAI's `logprobs` object for these tokens' entries, (offset in the text, entry)
        (None where the request did not ask): chat's `content` list, or the completions
        API's parallel lists, with each token's offset in the completion text."""
        if job.scores is None:
            return None
        if chat:
            def entry(token, lp):
                text = self._token_text(token)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

            return {"content": [dict(entry(s.token, s.logprob), top_logprobs=[
                entry(t, v) for t, v in s.top]) for _, s in scores], "refusal": None}
        return {"tokens": [self._token_text(s.token) for _, s in scores],
                "token_logprobs": [s.logprob for _, s in scores],
                "top_logprobs": [{self._token_text(t): v for t, v in s.top} for _, s in scores],
                "text_offset": [offset for offset, _ in scores]}

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
        content = "".join(text)
        logprobs = self._logprobs(job, scores, chat)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content},
                   "finish_reason": finish, "logprobs": logprobs} if chat else
                  {"index": 0, "text": content, "finish_reason": finish, "logprobs": logprobs})
        self._send_json(200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                              "created": int(time.time()), "model": self.engine.model_id,
                              "choices": [choice], "usage": usage})

    def _stream(self, job: Job, rid: str, chat: bool, include_usage: bool):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def send(choices, **extra):
            chunk = {"id": rid, "object": obj, "created": created, "model": self.engine.model_id,
                     "choices": choices, **extra}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        def choice(content=None, finish=None, role=False, logprobs=None):
            if chat:
                delta = {"role": "assistant"} if role else {}
                if content is not None:
                    delta["content"] = content
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            return {"index": 0, "text": content or "", "finish_reason": finish,
                    "logprobs": logprobs}

        if chat:
            send([choice(content="", role=True)])
        for event in self._events(job):
            if event[0] == "text":
                send([choice(content=event[1], logprobs=self._logprobs(job, event[2], chat))])
            elif event[0] == "error":
                self.wfile.write(f"data: {json.dumps({'error': {'message': event[1]}})}\n\n".encode())
                break
            else:
                _, finish, usage = event
                send([choice(finish=finish)])
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
        self.token_texts = {}  # token id -> its text decoded alone (for logprobs)
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


def _main(argv) -> int:
    from .cli import SPECULATE, UsageError, flag_name, kv_settings, load_from_args
    from .decoding.settings import GenerationSettings

    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be from 0 to 65535 (got {args.port}).")
    if args.max_body_bytes < 1024:
        raise UsageError(f"--max-body-bytes must be at least 1024 (got {args.max_body_bytes}).")
    try:  # the defaults of requests that give none
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
    model, tokenizer = load_from_args(args)
    if model.group is not None and args.max_batch > 1:
        raise UsageError("--max-batch runs on one machine; under mlx.launch serve one request at "
                         "a time (--max-batch 1).")
    if model.group is not None and model.group.rank() != 0:
        follow(model, tokenizer)  # rank 0 serves; this rank runs its share of the work
        return 0
    model_id = args.model_id or args.model or "eagle_mlx-demo"
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
        model.costs()  # (measured before serving, where this machine has no record yet)
        if defaults.kv is not None:
            model.costs(defaults.kv)  # (and with the quantized caches it serves with)
        size = 2
        while size <= args.max_batch:  # (and a batch's, at every size its rows choose with)
            model.costs(batch=size)
            size *= 2
    try:
        server = Server((args.host, args.port), Handler, max_connections=args.max_connections)
    except OSError as e:
        raise EagleError(f"cannot listen on {args.host}:{args.port} ({e.strerror}).") from None
    server.engine = JobRunner(model, tokenizer, model_id, max_batch=args.max_batch)
    if cache is not None:
        server.engine.cache, server.engine.prefix = cache, list(cache.tokens)
    server.api_key, server.max_body = args.api_key, args.max_body_bytes
    server.defaults = defaults
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
    mode = "plain decoding" if model.head is None else f"{model.head.kind} head"
    if model.lookup is not None:
        mode = "prompt lookup" if model.head is None else mode + " with prompt lookup"
    if defaults.speculate == "auto" and model.group is None:
        mode = "adaptive: plain" + (", prompt lookup" if model.auto_lookup is not None else "") \
            + ("" if model.head is None else f", {model.head.kind} head")
    if args.max_batch > 1:
        mode += f", up to {args.max_batch} requests batched"
    print(f"serving {model_id} ({mode}) on http://{host}:{port}/v1", file=sys.stderr, flush=True)
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
