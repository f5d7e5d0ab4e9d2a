"""OpenAI's request bodies checked into what the engine takes, and its response shapes.

    call = parse_completion(body, limits)     # or parse_chat(body, limits)
    call.prompt                               # the text (completions) or None
    call.messages                             # the conversation (chat) or None
    call.submission(ids)                      # a serve.Submission for the prompt's ids

Every mistake is a `RequestError` naming the field (`param`), its value and the rule, with
the HTTP status it answers (400, or 404 for a model this server does not serve):

    {"temperature": -1}  ->  400 temperature=-1.0 is outside [0.0, inf)   param temperature
    {"n": 2}             ->  400 n=2: this server makes one choice per request (n=1)
    {"logprobs": 3}      ->  400 'logprobs' is not supported by this server

The sampling values become a `decode.DecodeRequest` field by field, so its own checks
(which name the field, the value and the rule) say what is wrong; temperature 0 is greedy
decoding, anything else sampling (OpenAI's default temperature is 1).

Whisper's form (`audio_fields`) gives the audio's features (`audio_features`: the upload
read as a file, one window) and its forced decoder prompt (`whisper_prompt`).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import tempfile

from decode.request import DecodeRequest
from decode.whisper import WhisperSettings, decoder_prompts, needs_detection
from models.audio_features import window_features
from models.audio_files import read_audio
from models.errors import UserError
from serve.api import Submission

# OpenAI's default for /v1/completions; a chat request without max_tokens runs to the
# model's window (or an end token), as OpenAI's chat does.
COMPLETION_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4
COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
          "stop", "seed", "presence_penalty", "frequency_penalty", "user",
          "top_k", "min_p", "repetition_penalty")           # the last three: extensions
COMPLETION_FIELDS = frozenset(COMMON + ("prompt",))
CHAT_FIELDS = frozenset(COMMON + ("messages", "max_completion_tokens"))
# OpenAI fields this server knows and does not implement: refused as such, not as unknown.
UNSUPPORTED = frozenset({
    "logprobs", "top_logprobs", "echo", "best_of", "logit_bias", "suffix", "tools",
    "tool_choice", "functions", "function_call", "response_format", "parallel_tool_calls",
    "audio", "modalities", "prediction", "reasoning_effort", "store", "metadata",
    "service_tier", "web_search_options"})
AUDIO_FORMATS = ("json", "text")
AUDIO_FIELDS = frozenset({"file", "model", "language", "prompt", "response_format",
                          "temperature"})
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI field -> DecodeRequest field.
SAMPLING = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
            ("min_p", "min_p"), ("repetition_penalty", "repetition_penalty"))


class RequestError(UserError):
    """A request the server refuses: OpenAI's error object with this status."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind

    def body(self) -> dict:
        return error_body(str(self), self.param, kind=self.kind, code=self.code)


def error_body(message: str, param: str | None = None, *, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the checks need from the server: the model's name, its end ids, and the names
    of the LoRA adapters it serves (each a `model` of its own, as vLLM lists them)."""

    model_name: str
    eos_ids: tuple[int, ...] | None = None
    adapters: tuple[str, ...] = ()

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model_name, *self.adapters)


@dataclasses.dataclass(frozen=True)
class Call:
    """One checked request.

    Attributes:
        prompt: the completion's prompt (or an encoder-decoder's source), else None.
        messages: the chat's messages, else None.
        request: the `DecodeRequest` (strategy, max_new_tokens, sampling values, eos_id).
        stream, include_usage: server-sent events; a final usage chunk.
        seed, stop, presence_penalty, frequency_penalty: the `Submission`'s.
        adapter: the LoRA adapter the `model` field named, or None (the base).
        prompt_param: the field that holds the prompt ("prompt" or "messages").
        tokens_param: the field that set max_new_tokens ("max_tokens" or
            "max_completion_tokens").
    """

    prompt: str | None
    messages: tuple[dict, ...] | None
    request: DecodeRequest
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_param: str = "prompt"
    tokens_param: str = "max_tokens"
    adapter: str | None = None

    def submission(self, ids) -> Submission:
        return Submission(ids=tuple(int(i) for i in ids), request=self.request, seed=self.seed,
                          stop=self.stop, presence_penalty=self.presence_penalty,
                          frequency_penalty=self.frequency_penalty, adapter=self.adapter)


def parse_completion(body, limits: Limits) -> Call:
    """A /v1/completions body: `prompt` a string or a list of one string."""
    body = _checked_fields(body, COMPLETION_FIELDS, limits)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError(f"prompt must be a string (or a list of one string), got "
                           f"{_short(prompt)}", "prompt")
    max_tokens = body.get("max_tokens", COMPLETION_MAX_TOKENS)
    return _call(body, limits, prompt=prompt, messages=None, max_tokens=max_tokens,
                 tokens_param="max_tokens", prompt_param="prompt")


def parse_chat(body, limits: Limits) -> Call:
    """A /v1/chat/completions body: `messages` a non-empty list of {role, content}."""
    body = _checked_fields(body, CHAT_FIELDS, limits)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of messages, got "
                           f"{_short(messages)}", "messages")
    for i, m in enumerate(messages):
        _check_message(m, f"messages[{i}]")
    param = "max_tokens"
    if body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise RequestError("give max_tokens or max_completion_tokens, not both",
                               "max_completion_tokens")
        param = "max_completion_tokens"
    return _call(body, limits, prompt=None, messages=tuple(messages),
                 max_tokens=body.get(param), tokens_param=param, prompt_param="messages")


def _checked_fields(body, allowed: frozenset, limits: Limits) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    for name in body:
        if name in UNSUPPORTED:
            raise RequestError(f"{name!r} is not supported by this server", name)
        if name not in allowed:
            raise RequestError(f"unknown field {name!r} (this endpoint takes "
                               f"{', '.join(sorted(allowed))})", name)
    model = body.get("model")
    if model is None:
        raise RequestError("model is required (GET /v1/models lists them)", "model")
    if model not in limits.models:
        raise RequestError(f"model {model!r} does not exist: this server serves "
                           f"{_names(limits.models)}", "model", status=404,
                           code="model_not_found")
    return body


def _names(models: tuple[str, ...]) -> str:
    return repr(models[0]) if len(models) == 1 else f"{list(models)}"


def _check_message(m, where: str) -> None:
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object with role and content, got "
                           f"{_short(m)}", where)
    role = m.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role={role!r} must be one of {ROLES}", f"{where}.role")
    content = m.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}.content[{j}] must be a text part "
                                   '({"type": "text", "text": ...}); this server reads text '
                                   "only", f"{where}.content")
    elif not (isinstance(content, str) or (content is None and role == "assistant")):
        raise RequestError(f"{where}.content must be a string or a list of text parts, got "
                           f"{_short(content)}", f"{where}.content")


def _call(body: dict, limits: Limits, *, prompt, messages, max_tokens, tokens_param: str,
          prompt_param: str) -> Call:
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise RequestError(f"n={n!r}: this server makes one choice per request (n=1)", "n")
    stream = _bool(body.get("stream", False), "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError("stream_options applies only with stream=true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError(f"stream_options must be {{\"include_usage\": bool}}, got "
                               f"{_short(options)}", "stream_options")
        include_usage = _bool(options.get("include_usage", False), "stream_options.include_usage")
    temperature = body.get("temperature", 1.0)
    strategy = "greedy" if _is_number(temperature) and temperature == 0 else "sample"
    request = DecodeRequest(strategy=strategy,
                            eos_id=limits.eos_ids if limits.eos_ids else "config")
    if max_tokens is not None:
        request = _replaced(request, tokens_param, "max_new_tokens", max_tokens)
    for name, field in SAMPLING:
        if body.get(name) is not None:
            value = body[name]
            if name == "temperature" and _is_number(value) and value > 2:
                raise RequestError(f"temperature={value!r} is outside [0, 2]", name)
            request = _replaced(request, name, field, value)
    seed = body.get("seed")
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool)):
        raise RequestError(f"seed={seed!r} must be an integer", "seed")
    return Call(prompt=prompt, messages=messages, request=request, stream=stream,
                include_usage=include_usage, seed=seed, stop=_stop(body.get("stop")),
                presence_penalty=_penalty(body, "presence_penalty"),
                frequency_penalty=_penalty(body, "frequency_penalty"),
                prompt_param=prompt_param, tokens_param=tokens_param,
                adapter=body["model"] if body["model"] in limits.adapters else None)


def _replaced(request: DecodeRequest, param: str, field: str, value) -> DecodeRequest:
    """`request` with `field` set, its UserError re-worded for the OpenAI field `param`."""
    if isinstance(value, bool) or not _is_number(value):
        raise RequestError(f"{param}={value!r} must be a number", param)
    try:
        return request.replace(**{field: value})
    except UserError as e:
        raise RequestError(str(e).replace(field, param, 1), param) from None


def _penalty(body: dict, name: str) -> float:
    value = body.get(name)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not _is_number(value) or not -2.0 <= value <= 2.0:
        raise RequestError(f"{name}={value!r} is outside [-2, 2]", name)
    return float(value)


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them, got "
                           f"{_short(stop)}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop holds {len(stops)} strings, over the limit of "
                           f"{MAX_STOP_STRINGS}", "stop")
    return tuple(stops)


def _bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{name}={value!r} must be true or false", name)
    return value


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------
# Whisper's form (POST /v1/audio/transcriptions).

def audio_fields(form, limits: Limits) -> dict:
    """The form's language and response_format, every other field checked."""
    for name in form:
        if name not in AUDIO_FIELDS:
            raise RequestError(f"unknown field {name!r} (this endpoint takes "
                               f"{', '.join(sorted(AUDIO_FIELDS))})", name)
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise RequestError("file is required: the audio, uploaded as a file", "file")
    model = form.get("model")
    if model is not None and model != limits.model_name:
        raise RequestError(f"model {model!r} does not exist: this server serves "
                           f"{limits.model_name!r}", "model", status=404,
                           code="model_not_found")
    fmt = form.get("response_format") or "json"
    if fmt not in AUDIO_FORMATS:
        raise RequestError(f"response_format={fmt!r} must be one of {AUDIO_FORMATS}",
                           "response_format")
    if form.get("prompt"):
        raise RequestError("prompt (text before the audio) is not supported by this server",
                           "prompt")
    temperature = form.get("temperature")
    if temperature not in (None, "", "0", "0.0"):
        raise RequestError(f"temperature={temperature!r}: transcription here is greedy "
                           "(temperature 0)", "temperature")
    return {"language": form.get("language") or None, "response_format": fmt}


def whisper_prompt(engine, fields: dict):
    """The forced decoder prompt and the request, as `decode.whisper.transcribe` makes them
    with no task given: the start token, the language (given, or the checkpoint's
    forced_decoder_ids), transcribe when a language is given, no timestamps."""
    settings = WhisperSettings.from_generation(engine.generation, engine.config)
    language = fields["language"]
    if needs_detection(settings, language, None):
        raise RequestError("language is required: this model is multilingual and the server "
                           "does not detect the language (give a code such as 'en')",
                           "language")
    try:
        ids = tuple(int(i) for i in decoder_prompts(settings, 1, language=language)[0])
    except UserError as e:
        raise RequestError(str(e), "language") from None
    new = max(1, min(settings.max_length, engine.max_prompt_tokens(1) + 1 - len(ids)))
    # The engine bans the checkpoint's suppress and begin-suppress tokens itself.
    request = DecodeRequest(strategy="greedy", max_new_tokens=new,
                            eos_id=settings.eos_ids or "config")
    return ids, request


def audio_features(data: bytes, audio):
    """float32[mel, frames] of the uploaded file's first (only) window."""
    if not data:
        raise RequestError("file is empty", "file")
    with tempfile.TemporaryDirectory(prefix="serve-audio-") as folder:
        path = os.path.join(folder, "upload")
        with open(path, "wb") as f:
            f.write(data)
        try:
            wave = read_audio(path)
            features, _ = window_features([wave], audio=audio)
        except UserError as e:
            raise RequestError(str(e).replace(repr(path), "the uploaded file"), "file") from None
    return features[0]
