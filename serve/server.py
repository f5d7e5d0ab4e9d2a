"""The OpenAI-compatible HTTP layer: a Starlette app over a started `serve.Engine`.

    application = app(engine, model_name="default", api_key=None)   # an ASGI app
    uvicorn.run(application, host="127.0.0.1", port=8000)            # python -m serve does this

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/audio/transcriptions
(Whisper), GET /v1/models, GET /health, GET /metrics. The app parses and checks a request
(`serve.protocol`: bad input is a 400 naming the field), tokenises it (a chat with the
model's own template, `models.chat`), submits it and streams what the engine yields: no
model logic and no scheduling live here. The engine's refusals map to statuses: a
`QueueFull` is 429 with Retry-After, an `EngineStopped` 503, any other `UserError` 400.

A client that goes away (its connection closes) cancels its request, whether it streams or
waits for the whole answer, so its slot and pages free within one engine step. `stopping`
(`ServerState`) turns /health to 503 once a shutdown began; `ServerState.active` counts the
requests still answering, so a graceful shutdown can wait for their last bytes.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import re
import threading
import time
import uuid

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from models.chat import ChatTemplate
from models.errors import UserError
from serve.api import EngineStopped, QueueFull, Submission
from serve.protocol import (
    AUDIO_FIELDS,
    Call,
    Limits,
    RequestError,
    audio_features,
    audio_fields,
    error_body,
    parse_chat,
    parse_completion,
    whisper_prompt,
)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024     # a 30 s WAV upload is about 1 MiB at 16 kHz
RETRY_AFTER_SECONDS = 1


@dataclasses.dataclass
class ServerState:
    """What the app and its shutdown share: `stopping` (no new work; /health answers
    503) and `active`, the requests that have not sent their last byte."""

    stopping: bool = False
    active: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def enter(self) -> None:
        with self.lock:
            self.active += 1

    def leave(self) -> None:
        with self.lock:
            self.active -= 1


class _BodyTooLarge(Exception):
    pass


def app(engine, *, model_name: str, api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template: ChatTemplate | None = None,
        state: ServerState | None = None) -> Starlette:
    """The ASGI app serving `engine` (started) under `model_name`.

    Args:
        engine: a started `serve.Engine` (or anything with its interface).
        model_name: the one name clients give as `model` (GET /v1/models lists it).
        api_key: when set, every endpoint but /health needs `Authorization: Bearer KEY`.
        max_body_bytes: a larger request body is refused (413).
        chat_template: the model's chat template (`ChatTemplate.from_directory`); None
            refuses /v1/chat/completions, naming the model.
        state: the `ServerState` the caller's shutdown sets (a fresh one by default).
    """
    state = state or ServerState()
    created = int(time.time())
    gen = getattr(engine, "generation", None)
    adapters = getattr(engine, "adapters", None)
    limits = Limits(model_name=model_name, eos_ids=getattr(gen, "eos_ids", None),
                    adapters=adapters.names if adapters is not None else ())
    metrics = engine.metrics
    # A text encoder-decoder's forced first token (a translation model's target language:
    # the directory's forced_bos_token_id, or --target-lang's), for every request.
    cfg = getattr(engine, "config", None)
    forced_first = (getattr(gen, "forced_bos_id", None)
                    if getattr(cfg, "is_encoder_decoder", False)
                    and getattr(cfg, "audio", None) is None else None)

    async def completions(request: Request) -> Response:
        call = parse_completion(await _json(request), limits)
        tokenizer = _tokenizer(engine)
        ids = await anyio.to_thread.run_sync(
            lambda: tokenizer.encode(call.prompt, add_special_tokens=True))
        return await _answer(request, call, ids, chat=False)

    async def chat_completions(request: Request) -> Response:
        call = parse_chat(await _json(request), limits)
        if chat_template is None:
            raise RequestError(f"model {model_name!r} has no chat template (its directory's "
                               "tokenizer_config.json sets no chat_template): use "
                               "/v1/completions", "messages")
        tokenizer = _tokenizer(engine)

        def render():
            text = chat_template.render(list(call.messages), add_generation_prompt=True)
            return tokenizer.encode(text, add_special_tokens=False)
        try:
            ids = await anyio.to_thread.run_sync(render)
        except UserError as e:
            raise RequestError(str(e), "messages") from None
        return await _answer(request, call, ids, chat=True)

    async def _answer(request: Request, call: Call, ids, *, chat: bool) -> Response:
        if forced_first is not None:
            call = dataclasses.replace(call, request=call.request.replace(
                forced_bos_id=forced_first))
        _check_prompt(engine, call, ids)
        handle = _submit(engine, call.submission(ids), call.prompt_param)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = dict(id=rid, object="chat.completion" if chat else "text_completion",
                    created=int(time.time()), model=model_name)
        if call.stream:
            return _EventStream(_chunks(handle, head, call, chat), handle=handle, state=state)
        events, failed = await _whole(handle, request, state)
        if failed is not None:
            return failed
        final = events[-1]
        text = "".join(e.text for e in events)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "logprobs": None, "finish_reason": final.finish_reason} if chat else
                  {"index": 0, "text": text, "logprobs": None,
                   "finish_reason": final.finish_reason})
        return JSONResponse({**head, "choices": [choice], "usage": _usage(final.usage)})

    async def transcriptions(request: Request) -> Response:
        cfg = engine.config
        if getattr(cfg, "audio", None) is None:
            raise RequestError(f"model {model_name!r} is not a Whisper model (it has no audio "
                               "encoder): /v1/audio/transcriptions needs one", "model")
        try:
            form = await request.form(max_files=1, max_fields=len(AUDIO_FIELDS))
        except _BodyTooLarge:
            raise
        except Exception as e:        # Starlette's and python-multipart's parse errors
            raise RequestError(f"the body is not a valid multipart form: {e}") from None
        try:
            fields = audio_fields(form, limits)
            data = await form["file"].read()
        finally:
            await form.close()
        ids, request_ = whisper_prompt(engine, fields)
        features = await anyio.to_thread.run_sync(lambda: audio_features(data, cfg.audio))
        handle = _submit(engine, Submission(ids=ids, request=request_, features=features),
                         "file")
        events, failed = await _whole(handle, request, state)
        if failed is not None:
            return failed
        text = "".join(e.text for e in events).strip()
        if fields["response_format"] == "text":
            return PlainTextResponse(text)
        return JSONResponse({"text": text})

    async def list_models(request: Request) -> Response:
        base = {"object": "model", "created": created, "owned_by": "jax-transformer-zoo"}
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, **base},
            *({"id": name, **base, "parent": model_name} for name in limits.adapters)]})

    async def health(request: Request) -> Response:
        if state.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(request: Request) -> Response:
        return PlainTextResponse(metrics.render(engine.gauges()),
                                 media_type="text/plain; version=0.0.4")

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/audio/transcriptions", transcriptions, methods=["POST"]),
              Route("/v1/models", list_models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics_text, methods=["GET"])]
    handlers = {RequestError: _request_error, _BodyTooLarge: _too_large(max_body_bytes),
                404: _not_found, 405: _not_allowed}
    inner = Starlette(routes=routes, exception_handlers=handlers)
    return _Guard(inner, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics,
                  state=state)


# ---------------------------------------------------------------------------------------------
# Requests in, events out.

async def _json(request: Request):
    body = await request.body()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None


def _tokenizer(engine):
    if engine.tokenizer is None:
        raise RequestError("the model directory has no tokenizer: this server takes text")
    return engine.tokenizer


def _check_prompt(engine, call: Call, ids) -> None:
    if not ids:
        raise RequestError(f"{call.prompt_param} gives no tokens", call.prompt_param)
    new = call.request.max_new_tokens
    limit = engine.max_prompt_tokens(1 if new is None else new)
    if len(ids) > limit:
        given = ("its encoder's window (a source)"
                 if getattr(engine.config, "is_encoder_decoder", False)
                 else f"{call.tokens_param}={new}" if new is not None
                 else "at least one new token")
        raise RequestError(f"{call.prompt_param} is {len(ids)} tokens, over the {limit} this "
                           f"model takes with {given}", call.prompt_param)


_FIELD = re.compile(r"^(\w+)=")


def _submit(engine, submission, prompt_param: str):
    try:
        return engine.submit(submission)
    except QueueFull as e:
        raise RequestError(f"the server is busy: {e}", status=429, kind="rate_limit_error",
                           code="queue_full") from None
    except EngineStopped as e:
        raise RequestError(f"the server is stopping: {e}", status=503,
                           kind="service_unavailable") from None
    except UserError as e:
        match = _FIELD.match(str(e))
        param = ({"max_new_tokens": "max_tokens"}.get(match[1], match[1]) if match
                 else prompt_param)
        raise RequestError(str(e), param) from None


async def _collect(handle, request: Request) -> list:
    """Every event of `handle`; the request is cancelled when the client goes away."""
    events = []
    try:
        async with anyio.create_task_group() as group:
            async def watch():
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                handle.cancel()
            group.start_soon(watch)
            async for event in handle.stream():
                events.append(event)
            group.cancel_scope.cancel()
    finally:
        if not events or events[-1].finish_reason is None:
            handle.cancel()
    return events


async def _whole(handle, request: Request, state) -> tuple[list, Response | None]:
    """A non-streamed answer's events (counted in `state` while awaited), and the error
    response when the engine failed (500) or cancelled it while stopping (503)."""
    state.enter()
    try:
        events = await _collect(handle, request)
    finally:
        state.leave()
    reason = events[-1].finish_reason
    if reason == "error":
        return events, JSONResponse(error_body(events[-1].error or "the engine failed",
                                               kind="server_error"), status_code=500)
    if reason == "cancelled":
        return events, JSONResponse(error_body("the request was cancelled: the server is "
                                               "stopping", kind="server_error"),
                                    status_code=503)
    return events, None


def _usage(usage) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _chunks(handle, head: dict, call: Call, chat: bool):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if call.include_usage else {}

    def chunk(text=None, finish=None, role=False):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return _sse({**head, "choices": [choice], **extra})

    if chat:
        yield chunk(role=True)
    async for event in handle.stream():
        if event.text:
            yield chunk(event.text)
        if event.finish_reason is None:
            continue
        if event.finish_reason in ("error", "cancelled"):
            message = event.error or "the request was cancelled: the server is stopping"
            yield _sse(error_body(message, kind="server_error"))
        else:
            yield chunk(finish=event.finish_reason)
            if call.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(event.usage)})
        break
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that stop (and cancel the request) when the client goes away,
    whatever ASGI version the server speaks; counted in `state.active` while open."""

    media_type = "text/event-stream"

    def __init__(self, content, *, handle, state: ServerState):
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self.handle, self.serve_state = handle, state

    async def __call__(self, scope, receive, send) -> None:
        self.serve_state.enter()
        try:
            async with anyio.create_task_group() as group:
                async def stream():
                    await self.stream_response(send)
                    group.cancel_scope.cancel()
                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            self.handle.cancel()            # nothing, when the request had finished
            self.serve_state.leave()


# ---------------------------------------------------------------------------------------------
# Errors, the key and the body limit.

async def _request_error(request: Request, e: RequestError) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _too_large(limit: int):
    async def handler(request: Request, e: Exception) -> Response:
        return JSONResponse(error_body(f"the request body is over the limit of {limit} bytes"),
                            status_code=413)
    return handler


async def _not_found(request: Request, e: Exception) -> Response:
    return JSONResponse(error_body(f"no endpoint {request.url.path}"), status_code=404)


async def _not_allowed(request: Request, e: Exception) -> Response:
    return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}"),
                        status_code=405)


class _Guard:
    """ASGI middleware: the API key, the body limit, and a count of each response."""

    def __init__(self, inner, *, api_key, max_body_bytes: int, metrics, state: ServerState):
        self.inner, self.max_body_bytes, self.metrics = inner, max_body_bytes, metrics
        self.key = None if api_key is None else f"Bearer {api_key}".encode()
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        path = scope["path"]
        status = {}

        async def counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                self.metrics.http_response(path if path in _PATHS else "other",
                                           message["status"])
            await send(message)

        if self.key is not None and path != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                return await _send_json(counted, 401, error_body(
                    "a valid API key is required: Authorization: Bearer KEY",
                    code="invalid_api_key"))
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_json(counted, 413, error_body(
                f"the request body ({int(length)} bytes) is over the limit of "
                f"{self.max_body_bytes} bytes"))
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise _BodyTooLarge()
            return message

        await self.inner(scope, limited, counted)


_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/audio/transcriptions",
          "/v1/models", "/health", "/metrics")


async def _send_json(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
