"""The OpenAI protocol of `python -m eagle_mlx.server`: requests checked (one sentence
naming the field for every bad value) and turned into the package's settings, responses,
stream chunks and log-probabilities shaped as OpenAI's API shapes them. `generate` and
`chat` write `--logprobs N` through the same shaping (`Protocol.logprobs`)."""

import json
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from .errors import EagleError, is_int

MAX_STOP_STRINGS = 4      # as OpenAI's API
# the API's bounds beyond the package's own checks (OpenAI's: temperature at most 2)
MAX_TEMPERATURE = 2.0
MAX_REQUEST_TOKENS = 10**9


class RequestError(Exception):
    """A bad request: HTTP status and one sentence for the OpenAI-style error object."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def int_field(body: dict, key: str, default, low: int, high: Optional[int] = None):
    """A whole-number field of a request, within its bounds (a RequestError naming it)."""
    value = body.get(key, default)
    if value is None:
        return default
    if not is_int(value) or value < low or \
            (high is not None and value > high):
        bound = f" from {low} to {high}" if high is not None else f" of at least {low}"
        raise RequestError(f"'{key}' must be a whole number{bound} (got {value!r}).", param=key)
    return value


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


def logprobs_asked(body: dict, chat: bool) -> Optional[int]:
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
    top = int_field(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not asked:
        raise RequestError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return (top or 0) if asked else None


def text_content(content, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"{where} must be a string or a list of text parts.", param="messages")


@dataclass
class Request:
    """A checked request: its prompt's token ids, settings, stop strings, whether it
    streams and whether its stream ends with the usage."""
    ids: List[int]
    settings: object
    stop: List[str]
    stream: bool
    include_usage: bool


class Protocol:
    """The API of one served model: `parse` checks a request against it (its id, its
    tokenizer and context, the defaults of fields a request leaves out, the tokens of a
    prompt cache file every request goes on after); the rest shapes what comes back."""

    def __init__(self, model_id: str, tokenizer, context: int, defaults,
                 prefix: Optional[List[int]] = None):
        self.model_id, self.tokenizer, self.context = model_id, tokenizer, context
        self.defaults, self.prefix = defaults, prefix
        self.token_texts: Dict[int, str] = {}  # token id -> its text decoded alone

    def parse(self, body: dict, chat: bool) -> "Request":
        """A chat (`chat`) or completions request's body, every field checked (a
        RequestError naming the first bad one): the prompt's token ids, settings, stop
        strings, streaming and whether the stream ends with the usage."""
        from .cli import chat_prompt
        from .decoding.plan import encode_prompt

        model = body.get("model")
        if model is not None and model not in (self.model_id, "default"):
            raise RequestError(f"unknown model {model!r}; this server serves "
                               f"{self.model_id!r}.", param="model", code="model_not_found")
        tok = self.tokenizer
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
                                 "content": text_content(m.get("content"), f"messages[{i}].content")})
            if not getattr(tok, "chat_template", None):
                raise RequestError("this model has no chat template; use /v1/completions.")
            prefix = self.prefix
            if prefix is None:
                ids = chat_prompt(tok, rendered)
            else:  # (the file's prompt, then the conversation from its first user message)
                from .cli import continuation

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
            if self.prefix is not None:
                ids = self.prefix + ids
        context = self.context
        if len(ids) >= context:
            raise RequestError(f"the prompt is {len(ids)} tokens long; the model's context is "
                               f"{context} tokens.", param="messages" if chat else "prompt",
                               code="context_length_exceeded")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        settings = request_settings(body, self.defaults, key)
        # capped by the context
        settings = settings.replace(max_tokens=min(settings.max_tokens, context - len(ids)))
        if int_field(body, "n", 1, 1, 1) != 1:
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
        settings = settings.replace(logprobs=logprobs_asked(body, chat))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("'stream' must be true or false.", param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise RequestError("'stream_options' must be an object with a boolean "
                               "'include_usage'.", param="stream_options")
        return Request(ids, settings, stop, stream, bool(options.get("include_usage", False)))

    def token_text(self, token: int) -> str:
        """A token as text, decoded alone (kept: the same tokens come back often)."""
        if token not in self.token_texts:
            self.token_texts[token] = self.tokenizer.decode([token])
        return self.token_texts[token]

    def logprobs(self, scores, chat: bool) -> dict:
        """OpenAI's `logprobs` object for these tokens' entries, (offset in the text, entry):
        chat's `content` list, or the completions API's parallel lists, with each token's
        offset in the completion text."""
        if chat:
            def entry(token, lp):
                text = self.token_text(token)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

            return {"content": [dict(entry(s.token, s.logprob), top_logprobs=[
                entry(t, v) for t, v in s.top]) for _, s in scores], "refusal": None}
        return {"tokens": [self.token_text(s.token) for _, s in scores],
                "token_logprobs": [s.logprob for _, s in scores],
                "top_logprobs": [{self.token_text(t): v for t, v in s.top} for _, s in scores],
                "text_offset": [offset for offset, _ in scores]}

    def completion(self, rid: str, chat: bool, content: str, finish: str, logprobs,
                   usage: dict) -> dict:
        """A whole (not streamed) answer."""
        choice = ({"index": 0, "message": {"role": "assistant", "content": content},
                   "finish_reason": finish, "logprobs": logprobs} if chat else
                  {"index": 0, "text": content, "finish_reason": finish, "logprobs": logprobs})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_id, "choices": [choice],
                "usage": usage}

    def chunk(self, rid: str, chat: bool, created: int, choices: list, **extra) -> dict:
        """One chunk of a stream."""
        return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_id, "choices": choices, **extra}

    @staticmethod
    def chunk_choice(chat: bool, content=None, finish=None, role=False, logprobs=None) -> dict:
        """A stream chunk's choice: chat's delta (the role in the first), or the text."""
        if chat:
            delta = {"role": "assistant"} if role else {}
            if content is not None:
                delta["content"] = content
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return {"index": 0, "text": content or "", "finish_reason": finish,
                "logprobs": logprobs}


def error_body(e: RequestError) -> dict:
    """OpenAI's error object for a refused request."""
    kind = {401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error"}.get(e.status, "invalid_request_error")
    return {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}}


def print_logprobs(tokenizer, entries) -> None:
    """The generated tokens' log-probabilities (their `TokenLogprob`s, in order) on stderr,
    one JSON line shaped as the server's completions answers shape them
    (`Protocol.logprobs`): tokens, their log-probabilities, the top alternatives
    and each token's offset in the text."""
    scores, offset = [], 0
    for s in entries:
        scores.append((offset, s))
        offset += len(s.text)
    shaped = Protocol("", tokenizer, 0, None).logprobs(scores, chat=False)
    print("logprobs: " + json.dumps(shaped), file=sys.stderr, flush=True)
