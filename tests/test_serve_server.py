"""The OpenAI-compatible server (`serve.server`, `python -m serve`).

Two halves:
- the HTTP layer in process (Starlette's TestClient) over `FakeEngine`, a small engine
  that honours `serve.Engine`'s interface and makes deterministic tokens: every error path,
  the response and chunk shapes, the chat template against transformers', Whisper's form;
- the server as a real process on loopback (`python -m serve --model DIR --port P`) with a
  tiny random Llama and a byte-level BPE tokenizer, queried with the official `openai`
  client (and `requests` where a client must hang up mid-stream): completions, chat,
  streaming, usage, errors, concurrent load, disconnects, SIGTERM's drain and a soak. It
  runs `serve.Engine` when the package has it, else `FakeEngine` in the same process
  (started through `python -c`), so the HTTP half is tested either way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

import models
from decode.request import DecodeRequest
from models.chat import ChatTemplate
from models.errors import UserError
from serve.api import EngineStopped, Event, QueueFull, Submission, Usage
from serve.metrics import Metrics
from serve.protocol import COMPLETION_MAX_TOKENS

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
from starlette.testclient import TestClient  # noqa: E402

from serve import server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key-123"
WORDS = "the cat sat on a mat and saw one dog run to its home by the sea".split()
SPECIALS = ["<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen's templates write it, with a check that raises and a special token read
# from the tokenizer's files.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# ---------------------------------------------------------------------------------------------
# A tiny model directory with a Hugging Face tokenizer and a chat template.

def _tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    lines = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5 + i % 6))
             for i in range(200)]
    backend = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<unk>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama (d_model 32, 2 layers, window 64) whose tokenizer_config.json
    holds CHAT_TEMPLATE."""
    import jax

    from models.tokenizer import HFTokenizer
    path = str(tmp_path_factory.mktemp("serve") / "tiny")
    staged = path + "-tok"
    hf = _tokenizer(staged)
    cfg = models.get_config("llama-tiny", vocab_size=len(hf), d_model=32, num_heads=2,
                            num_kv_heads=1, mlp_dim=64, num_layers=2, max_len=64,
                            eos_id=0, bos_id=0, pad_id=0)
    model = models.build(cfg)
    params = model.init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"]
    models.save(path, cfg, params, HFTokenizer(hf), model_type="llama")
    config = os.path.join(path, "tokenizer_config.json")
    with open(config) as f:
        meta = json.load(f)
    meta["chat_template"] = CHAT_TEMPLATE
    with open(config, "w") as f:
        json.dump(meta, f)
    integrity = os.path.join(path, "zoo_integrity.json")
    if os.path.exists(integrity):            # the edit above is ours: re-seal the directory
        os.remove(integrity)
    return path


# ---------------------------------------------------------------------------------------------
# A fake engine with serve.Engine's interface.

class _Handle:
    """Events of one submission, to a blocking iterator or an asyncio one."""

    def __init__(self, engine, submission: Submission):
        self.engine, self.submission = engine, submission
        self.lock = threading.Lock()
        self.buffered: list[Event] = []
        self.cond = threading.Condition(self.lock)
        self.loop = self.queue = None
        self.cancelled = False
        self.out: list[int] = []
        self.text = ""
        self.rng = random.Random(submission.seed)
        self.submitted = time.monotonic()
        self.last = None

    def push(self, event: Event) -> None:
        with self.lock:
            if self.queue is not None:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
            else:
                self.buffered.append(event)
                self.cond.notify_all()

    def events(self):
        i = 0
        while True:
            with self.cond:
                while len(self.buffered) <= i:
                    self.cond.wait()
                event = self.buffered[i]
            i += 1
            yield event
            if event.finish_reason is not None:
                return

    async def stream(self):
        with self.lock:
            self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()
            for event in self.buffered:
                self.queue.put_nowait(event)
        while True:
            event = await self.queue.get()
            yield event
            if event.finish_reason is not None:
                return

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngine:
    """One token per running request every `step_s`; greedy tokens are a function of the
    prompt alone (so a request gives the same text alone or among others), sampled ones of
    the seed. Honours max_slots, max_queue, cancel, stop(drain) and the metrics calls."""

    def __init__(self, pre, *, max_slots=8, page_size=16, num_pages=None,
                 max_tokens_per_step=256, prefill_chunk=64, max_queue=256, step_s=0.002):
        self.config, self.tokenizer, self.generation = pre.config, pre.tokenizer, pre.generation
        self.max_slots, self.max_queue, self.page_size = max_slots, max_queue, page_size
        self.step_s = step_s
        self.metrics = Metrics()
        self.compiled_shapes = 0
        self.lock = threading.Lock()
        self.waiting: list[_Handle] = []
        self.running: list[_Handle] = []
        self.accepting = False
        self.stopped = threading.Event()
        self.submissions: list[Submission] = []
        self.paused = threading.Event()        # tests: hold every request where it is
        self.words = [i for i in range(len(SPECIALS), self.tokenizer.vocab_size)]
        self.thread = None

    def start(self):
        self.compiled_shapes, self.accepting = 3, True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def max_prompt_tokens(self, max_new_tokens: int) -> int:
        return self.config.max_len - max_new_tokens

    def submit(self, submission: Submission) -> _Handle:
        new = submission.request.max_new_tokens or 1
        if len(submission.ids) > self.max_prompt_tokens(new):
            raise UserError(f"the prompt is {len(submission.ids)} tokens, over the "
                            f"{self.max_prompt_tokens(new)} the window leaves")
        with self.lock:
            if not self.accepting:
                raise EngineStopped("the engine is stopping")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (max_queue)")
            handle = _Handle(self, submission)
            self.waiting.append(handle)
            self.submissions.append(submission)
        self.metrics.request_started()
        return handle

    def gauges(self) -> dict:
        with self.lock:
            pages = sum(-(-(len(h.submission.ids) + len(h.out)) // self.page_size)
                        for h in self.running)
            return {"waiting": len(self.waiting), "running": len(self.running),
                    "pages_used": pages, "pages_total": 64, "tokens_per_second": 0.0}

    def stop(self, drain=True, timeout=None):
        with self.lock:
            self.accepting = False
            if not drain:
                for h in self.waiting + self.running:
                    h.cancelled = True
        end = None if timeout is None else time.monotonic() + timeout
        while self.waiting or self.running:
            if end is not None and time.monotonic() > end:
                break
            time.sleep(0.01)
        self.stopped.set()

    def _next(self, h: _Handle) -> int:
        if h.submission.request.strategy == "greedy":
            return self.words[(sum(h.submission.ids) * 7 + 3 * len(h.out)) % len(self.words)]
        return h.rng.choice(self.words)

    def _finish(self, h: _Handle, reason: str, ids=(), text="") -> None:
        self.running.remove(h)
        usage = Usage(len(h.submission.ids), len(h.out))
        self.metrics.add_tokens(usage.prompt_tokens, usage.completion_tokens)
        self.metrics.request_finished(reason)
        h.push(Event(token_ids=tuple(ids), text=text, finish_reason=reason, usage=usage))

    def _loop(self):
        while not self.stopped.is_set():
            time.sleep(self.step_s)
            if self.paused.is_set():
                continue
            with self.lock:
                for h in [h for h in self.waiting if h.cancelled]:
                    self.waiting.remove(h)
                    self.running.append(h)
                while self.waiting and len(self.running) < self.max_slots:
                    self.running.append(self.waiting.pop(0))
                for h in list(self.running):
                    if h.cancelled:
                        self._finish(h, "cancelled")
                        continue
                    self._step(h)

    def _step(self, h: _Handle) -> None:
        token = self._next(h)
        h.out.append(token)
        now = time.monotonic()
        if h.last is None:
            self.metrics.observe_ttft(now - h.submitted)
        else:
            self.metrics.observe_itl(now - h.last)
        h.last = now
        text = self.tokenizer.decode(h.out)
        delta, h.text = text[len(h.text):], text
        for stop in h.submission.stop:
            if stop in h.text:
                cut = h.text.index(stop)
                delta = delta[:max(0, len(delta) - (len(h.text) - cut))]
                return self._finish(h, "stop", (token,), delta)
        if len(h.out) >= (h.submission.request.max_new_tokens
                          or self.config.max_len - len(h.submission.ids)):
            return self._finish(h, "length", (token,), delta)
        h.push(Event(token_ids=(token,), text=delta))


@pytest.fixture(scope="module")
def pre(model_dir):
    return models.load(model_dir)


@pytest.fixture
def fake(pre):
    engine = FakeEngine(pre)
    engine.start()
    yield engine
    engine.stop(drain=False)


def _client(engine, model_dir=None, **options) -> TestClient:
    template = ChatTemplate.from_directory(model_dir) if model_dir else None
    return TestClient(server.app(engine, model_name="tiny", chat_template=template, **options))


def _error(response, status: int, param) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] and error["param"] == param, error
    return error["message"]


# ---------------------------------------------------------------------------------------------
# 1. The HTTP layer in process, over the fake engine.

def test_completion_shape_usage_and_defaults(fake, pre):
    client = _client(fake)
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "the cat",
                                             "temperature": 0, "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["text"]
    ids = pre.tokenizer.encode("the cat", add_special_tokens=True)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 5,
                             "total_tokens": len(ids) + 5}
    sub = fake.submissions[-1]
    assert sub.ids == tuple(ids) and sub.request.strategy == "greedy"
    assert sub.request.max_new_tokens == 5
    # OpenAI's defaults: sampling at temperature 1, 16 tokens; a list of one prompt.
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["a dog"], "seed": 3,
                                             "stop": "\n", "top_k": 5, "min_p": 0.1,
                                             "repetition_penalty": 1.2,
                                             "presence_penalty": 0.5})
    assert r.status_code == 200, r.text
    sub = fake.submissions[-1]
    assert sub.request.strategy == "sample" and sub.request.temperature == 1.0
    assert sub.request.max_new_tokens == COMPLETION_MAX_TOKENS and sub.seed == 3
    assert (sub.stop, sub.request.top_k, sub.request.min_p) == (("\n",), 5, 0.1)
    assert sub.request.repetition_penalty == 1.2 and sub.presence_penalty == 0.5


def test_streamed_chunks_join_to_the_whole_answer(fake):
    client = _client(fake, None)
    body = {"model": "tiny", "prompt": "the sea", "temperature": 0, "max_tokens": 12}
    whole = client.post("/v1/completions", json=body).json()
    chunks = _sse(client, "/v1/completions", {**body, "stream": True,
                                              "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]"
    data = [json.loads(c) for c in chunks[:-1]]
    assert all(d["object"] == "text_completion" for d in data)
    assert "".join(d["choices"][0]["text"] for d in data if d["choices"]) == \
        whole["choices"][0]["text"]
    assert data[-2]["choices"][0]["finish_reason"] == "length"
    assert data[-1]["choices"] == [] and data[-1]["usage"] == whole["usage"]


def _sse(client, path: str, body: dict, headers=None) -> list[str]:
    with client.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "the cat sat"},
            {"role": "assistant", "content": "on a mat", "name": None},
            {"role": "user", "content": [{"type": "text", "text": "and the dog"}]}]


def test_chat_renders_the_template_as_transformers_does(fake, model_dir):
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    plain = [{k: v for k, v in m.items() if v is not None} for m in MESSAGES[:3]]
    template = ChatTemplate.from_directory(model_dir)
    assert template.render(MESSAGES[:3]) == hf.apply_chat_template(
        plain, add_generation_prompt=True, tokenize=False)
    client = _client(fake, model_dir)
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES[:3], "temperature": 0,
        "max_completion_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    ids = hf.apply_chat_template(plain, add_generation_prompt=True, tokenize=True,
                                 return_dict=False)
    assert fake.submissions[-1].ids == tuple(ids)
    assert body["usage"]["prompt_tokens"] == len(ids)
    chunks = [json.loads(c) for c in _sse(client, "/v1/chat/completions", {
        "model": "tiny", "messages": MESSAGES[:3], "temperature": 0, "max_tokens": 4,
        "stream": True})[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        body["choices"][0]["message"]["content"]
    # A role the template refuses: its own message, as a 400 on messages.
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "tool", "content": "x"}]})
    assert "Unknown role: tool" in _error(r, 400, "messages")


def test_chat_template_file_wins_and_named_templates(tmp_path, model_dir):
    import shutil
    d = str(tmp_path / "m")
    shutil.copytree(model_dir, d)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m.role }}]{% endfor %}{{ eos_token }}")
    assert ChatTemplate.from_directory(d).render(MESSAGES[:2]) == "[system][user]<|endoftext|>"
    os.remove(os.path.join(d, "chat_template.jinja"))
    config = os.path.join(d, "tokenizer_config.json")
    meta = json.load(open(config))
    meta["chat_template"] = [{"name": "tool_use", "template": "T"},
                             {"name": "default", "template": "D{{ messages | length }}"}]
    json.dump(meta, open(config, "w"))
    assert ChatTemplate.from_directory(d).render(MESSAGES[:2]) == "D2"
    del meta["chat_template"]
    json.dump(meta, open(config, "w"))
    assert ChatTemplate.from_directory(d) is None


def test_a_model_without_a_chat_template_is_refused_by_name(fake):
    r = _client(fake).post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert "'tiny' has no chat template" in _error(r, 400, "messages")


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "best_of": 2}, "best_of", "not supported"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate", "unknown field 'frobnicate'"),
    ({"prompt": "x", "n": 2}, "n", "n=2"),
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature=-1"),
    ({"prompt": "x", "temperature": 3}, "temperature", "outside [0, 2]"),
    ({"prompt": "x", "top_p": 0}, "top_p", "top_p=0"),
    ({"prompt": "x", "top_k": -2}, "top_k", "top_k=-2"),
    ({"prompt": "x", "min_p": 1}, "min_p", "min_p=1"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty=0"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens=0 must be a positive int"),
    ({"prompt": "x", "max_tokens": "9"}, "max_tokens", "max_tokens='9' must be a number"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "outside [-2, 2]"),
    ({"prompt": "x", "frequency_penalty": "a"}, "frequency_penalty", "outside [-2, 2]"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop", "non-empty string"),
    ({"prompt": "x", "stop": ["a"] * 5}, "stop", "over the limit of 4"),
    ({"prompt": "x", "seed": 1.5}, "seed", "seed=1.5 must be an integer"),
    ({"prompt": "x", "stream": "yes"}, "stream", "stream='yes'"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": ["a", "b"]}, "prompt", "a list of one string"),
    ({"prompt": 5}, "prompt", "must be a string"),
    ({}, "prompt", "must be a string"),
])
def test_bad_completion_fields_are_400s_naming_them(fake, body, param, words):
    r = _client(fake).post("/v1/completions", json={"model": "tiny", **body})
    assert words in _error(r, 400, param)


@pytest.mark.parametrize("body, param, words", [
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "text part"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
      "max_completion_tokens": 2}, "max_completion_tokens", "not both"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     "max_completion_tokens", "max_completion_tokens=-1"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt", "unknown"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools", "not supported"),
])
def test_bad_chat_fields_are_400s_naming_them(fake, model_dir, body, param, words):
    r = _client(fake, model_dir).post("/v1/chat/completions", json={"model": "tiny", **body})
    assert words in _error(r, 400, param)


def test_malformed_bodies_unknown_models_and_routes(fake):
    client = _client(fake)
    for raw in (b"{not json", b"\xff\xfe", b""):
        r = client.post("/v1/completions", content=raw,
                        headers={"content-type": "application/json"})
        assert "not valid JSON" in _error(r, 400, None)
    r = client.post("/v1/completions", json=["a list"])
    assert "JSON object" in _error(r, 400, None)
    r = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert "'gpt-4' does not exist" in _error(r, 404, "model")
    assert r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert "model is required" in _error(r, 400, "model")
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/v1/completions").status_code == 405
    models_list = client.get("/v1/models").json()
    assert [m["id"] for m in models_list["data"]] == ["tiny"]


def test_a_prompt_over_the_window_names_both_numbers(fake, pre):
    prompt = " ".join(["the cat sat"] * 40)
    n = len(pre.tokenizer.encode(prompt, add_special_tokens=True))
    r = _client(fake).post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                     "max_tokens": 10})
    message = _error(r, 400, "prompt")
    assert f"{n} tokens" in message and f"the {64 - 10} this model takes" in message
    assert "max_tokens=10" in message


def test_the_api_key_guards_everything_but_health(fake):
    client = _client(fake, api_key=KEY)
    assert client.get("/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                             ("POST", "/v1/completions")):
            r = client.request(method, path, headers=headers, json={})
            assert _error(r, 401, None) and r.json()["error"]["code"] == "invalid_api_key"
            assert KEY not in r.text
    ok = client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


def test_bodies_over_the_limit_are_413s(fake):
    client = _client(fake, max_body_bytes=200)
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 300})
    assert "limit of 200 bytes" in _error(r, 413, None)

    def chunks():                  # no content-length: counted as it arrives
        for _ in range(10):
            yield b" " * 50
    r = client.post("/v1/completions", content=chunks(),
                    headers={"content-type": "application/json"})
    assert "limit of 200 bytes" in _error(r, 413, None)


def test_a_full_queue_is_429_with_retry_after_and_a_stopped_engine_503(pre):
    engine = FakeEngine(pre, max_queue=1)
    engine.start()
    engine.paused.set()
    client = _client(engine)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.post, "/v1/completions", json=body)
        while not engine.waiting:
            time.sleep(0.01)
        r = client.post("/v1/completions", json=body)
        assert "busy" in _error(r, 429, None) and r.headers["retry-after"] == "1"
        engine.paused.clear()
        assert first.result().status_code == 200
    engine.stop()
    r = client.post("/v1/completions", json=body)
    assert "stopping" in _error(r, 503, None)


def test_health_is_503_once_stopping(fake):
    state = server.ServerState()
    client = TestClient(server.app(fake, model_name="tiny", state=state))
    assert client.get("/health").json() == {"status": "ok"}
    state.stopping = True
    assert client.get("/health").status_code == 503


def test_metrics_render_prometheus_text(fake):
    client = _client(fake)
    client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3,
                                         "temperature": 0})
    client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 3})
    text = client.get("/metrics").text
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")
    assert "serve_requests_started_total 1" in text
    assert 'serve_requests_finished_total{reason="length"} 1' in text
    assert "serve_generated_tokens_total 3" in text
    assert 'serve_http_responses_total{endpoint="/v1/completions",code="400"} 1' in text
    assert "serve_time_to_first_token_seconds_count 1" in text
    assert 'serve_inter_token_latency_seconds_bucket{le="+Inf"} 2' in text
    assert "serve_pages_total 64" in text and "# TYPE serve_running gauge" in text
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r'[a-z_]+(\{[^}]*\})? [-+0-9.eInfNa]+', line) for line in lines)


def test_histogram_buckets_are_cumulative_and_inclusive():
    m = Metrics()
    for s in (0.005, 0.006, 100.0):
        m.observe_ttft(s)
    lines = m.ttft.lines("t")
    assert 't_bucket{le="0.005"} 1' in lines and 't_bucket{le="0.01"} 2' in lines
    assert 't_bucket{le="30"} 2' in lines and 't_bucket{le="+Inf"} 3' in lines
    assert "t_count 3" in lines


def _wav(seconds: float) -> bytes:
    import soundfile
    buf = io.BytesIO()
    t = np.arange(int(16000 * seconds)) / 16000
    soundfile.write(buf, (0.1 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000,
                    format="WAV")
    return buf.getvalue()


def test_transcriptions_refuse_a_text_model_by_name(fake):
    r = _client(fake).post("/v1/audio/transcriptions", files={"file": ("a.wav", _wav(0.5))},
                           data={"model": "tiny"})
    assert "'tiny' is not a Whisper model" in _error(r, 400, "model")


def test_transcriptions_parse_the_form_into_a_whisper_submission(pre):
    from models.audio import AudioInput
    from models.pretrained.generation import GenerationDefaults
    raw = {"decoder_start_token_id": 5, "eos_token_id": 0, "no_timestamps_token_id": 7,
           "lang_to_id": {"<|en|>": 8, "<|es|>": 11}, "task_to_id": {"transcribe": 9},
           "suppress_tokens": [12], "max_length": 20}
    whisper = types.SimpleNamespace(
        config=types.SimpleNamespace(audio=AudioInput(num_mel_bins=80, max_source_positions=50),
                                     max_len=64, eos_id=0, bos_id=0),
        tokenizer=pre.tokenizer, generation=GenerationDefaults(eos_ids=(0,), raw=raw))
    engine = FakeEngine(whisper)
    engine.start()
    client = _client(engine)
    r = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", _wav(0.5))},
                    data={"model": "tiny", "language": "es"})
    assert r.status_code == 200 and isinstance(r.json()["text"], str), r.text
    sub = engine.submissions[-1]
    assert sub.ids == (5, 11, 9, 7) and sub.request.max_new_tokens == 20
    assert sub.features.shape == (80, 100) and sub.features.dtype == np.float32
    r = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", _wav(0.5))},
                    data={"language": "en", "response_format": "text"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    post = client.post
    cases = [
        (dict(data={"language": "en"}), "file", "file is required"),
        (dict(files={"file": ("a.wav", _wav(0.5))}), "language", "language is required"),
        (dict(files={"file": ("a.wav", _wav(0.5))}, data={"language": "fr"}), "language",
         "'fr'"),
        (dict(files={"file": ("a.wav", _wav(1.5))}, data={"language": "en"}), "file",
         "over the model's window of 1 s"),
        (dict(files={"file": ("a.wav", b"not audio")}, data={"language": "en"}), "file",
         "cannot read audio file the uploaded file"),
        (dict(files={"file": ("a.wav", _wav(0.5))},
              data={"language": "en", "response_format": "srt"}), "response_format", "srt"),
        (dict(files={"file": ("a.wav", _wav(0.5))}, data={"language": "en", "prompt": "p"}),
         "prompt", "not supported"),
        (dict(files={"file": ("a.wav", _wav(0.5))}, data={"language": "en", "x": "1"}),
         "x", "unknown field 'x'"),
    ]
    for kwargs, param, words in cases:
        assert words in _error(post("/v1/audio/transcriptions", **kwargs), 400, param)
    r = post("/v1/audio/transcriptions", content=b"plain", headers={"content-type": "text/x"})
    assert _error(r, 400, "file")
    engine.stop(drain=False)


# ---------------------------------------------------------------------------------------------
# 2. The server as a process (serve.engine.Engine over the tiny model), queried over HTTP.

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Process:
    """`python -m serve --model DIR --port P FLAGS`, up once /health answers 200."""

    def __init__(self, model_dir: str, *flags: str, timeout: float = 180.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(os.path.dirname(model_dir),
                                     f"serve-{self.port}.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serve", "--model", model_dir, "--port", str(self.port),
             "--served-model-name", "tiny", *flags],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > end:
                self.stop()
                raise AssertionError(f"the server did not start:\n{self.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def client(self, key: str = KEY):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                             timeout=60)

    def metrics(self) -> dict[str, float]:
        text = requests.get(self.url + "/metrics", headers=AUTH, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def idle(self, timeout: float = 30.0) -> dict[str, float]:
        """The metrics once nothing waits or runs and every page is free."""
        end = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["serve_waiting"] == 0 and m["serve_running"] == 0 and \
                    m["serve_pages_used"] == 0:
                return m
            assert time.monotonic() < end, m
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


AUTH = {"Authorization": f"Bearer {KEY}"}
# One token a decode call (not four): 60 tokens then take 60 round trips, so a client's
# hang-up reaches the engine long before its request could end (test_process_a_client_...).
LIVE_FLAGS = ("--api-key", KEY, "--max-slots", "4", "--page-size", "8", "--prefill-chunk", "16",
              "--max-tokens-per-step", "32", "--max-body-bytes", "65536", "--decode-steps", "1")
PROMPTS = [" ".join(WORDS[i:i + 2 + i % 5]) for i in range(16)]


# Every test of `live` is slow: the first to run starts the server (about 12 s on 2 cores).
@pytest.fixture(scope="module")
def live(model_dir):
    process = _Process(model_dir, *LIVE_FLAGS)
    yield process
    process.stop()


def _finished(m: dict) -> float:
    return sum(v for k, v in m.items() if k.startswith("serve_requests_finished_total"))


@pytest.mark.slow
def test_process_completions_chat_and_streams(live, pre, model_dir):
    assert "compiled" in live.output() and "step shapes" in live.output()
    client = live.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = "the cat sat on"
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    n = len(pre.tokenizer.encode(prompt, add_special_tokens=True))
    assert whole.usage.prompt_tokens == n and 1 <= whole.usage.completion_tokens <= 8
    assert whole.choices[0].finish_reason in ("stop", "length")
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    # Chat: the prompt is the template transformers renders, token for token.
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    plain = [{k: v for k, v in m.items() if v is not None} for m in MESSAGES[:3]]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES[:3], max_tokens=6,
                                          temperature=0)
    ids = hf.apply_chat_template(plain, add_generation_prompt=True, return_dict=False)
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.role == "assistant"
    parts = client.chat.completions.create(model="tiny", messages=MESSAGES[:3], max_tokens=6,
                                           temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == \
        chat.choices[0].message.content
    # A seeded sampled request is the same every time.
    same = [client.completions.create(model="tiny", prompt=prompt, max_tokens=8, seed=5,
                                      temperature=0.9, top_p=0.9).choices[0].text
            for _ in range(2)]
    assert same[0] == same[1]


@pytest.mark.slow
def test_process_errors(live):
    client = live.client()

    def refused(error, param, **kwargs):
        with pytest.raises(error) as e:
            client.completions.create(model=kwargs.pop("model", "tiny"), **kwargs)
        assert e.value.body["param"] == param, e.value.body
        return e.value.body["message"]

    assert "temperature=-1" in refused(openai.BadRequestError, "temperature", prompt="x",
                                       temperature=-1)
    assert "n=2" in refused(openai.BadRequestError, "n", prompt="x", n=2)
    assert "frobnicate" in refused(openai.BadRequestError, "frobnicate", prompt="x",
                                   extra_body={"frobnicate": 1})
    assert "does not exist" in refused(openai.NotFoundError, "model", prompt="x",
                                       model="tiny-lora")
    long = " ".join(["the cat sat on a mat"] * 20)
    assert "over the 54 this model takes with max_tokens=10" in refused(
        openai.BadRequestError, "prompt", prompt=long, max_tokens=10)
    with pytest.raises(openai.AuthenticationError):
        live.client("wrong").models.list()
    r = requests.post(live.url + "/v1/completions", data=b" " * 70000,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"]
    r = requests.post(live.url + "/v1/completions", data=b"{oops", headers=AUTH)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert requests.get(live.url + "/health").status_code == 200        # no key needed


@pytest.mark.slow
def test_process_concurrent_requests_equal_each_alone(live):
    client = live.client()

    def ask(i):
        kind = dict(temperature=0) if i % 2 else dict(temperature=0.8, seed=i)
        return client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=10,
                                         **kind).choices[0].text

    alone = [ask(i) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, range(16)))
    assert together == alone
    live.idle()


def _hang_up_after_first_chunk(url: str, body: dict) -> None:
    with requests.post(url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                       stream=True, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())


@pytest.mark.slow
def test_process_a_client_that_hangs_up_is_cancelled(live):
    before = live.idle()
    cancelled = 'serve_requests_finished_total{reason="cancelled"}'
    for _ in range(5):                # a request may finish before the server sees the hang-up
        _hang_up_after_first_chunk(live.url, {"model": "tiny", "prompt": "the",
                                              "max_tokens": 60, "temperature": 0})
        after = live.idle()
        if after.get(cancelled, 0) > before.get(cancelled, 0):
            break
    assert after.get(cancelled, 0) > before.get(cancelled, 0), after
    assert after["serve_pages_used"] == 0 and after["serve_running"] == 0
    assert after["serve_requests_started_total"] == _finished(after)
    # A client waiting for a whole answer that goes away: its request is cancelled too.
    body = json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 60,
                       "temperature": 0}).encode()
    for _ in range(5):
        before = after
        with socket.create_connection(("127.0.0.1", live.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nAuthorization: Bearer "
                      + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                      + b"\r\n\r\n" + body)
        after = live.idle()
        if after.get(cancelled, 0) > before.get(cancelled, 0):
            break
    assert after.get(cancelled, 0) > before.get(cancelled, 0), after


@pytest.mark.slow
def test_process_soak_with_random_hang_ups(live):
    """Two hundred short requests from 8 threads, some streamed and dropped after their
    first chunk, some invalid: each ends in a response, an error or a recorded
    cancellation, and the counts reconcile with every page free."""
    before = live.idle()
    rng = random.Random(0)
    plan = [(i, rng.random()) for i in range(200)]

    def one(item):
        i, roll = item
        body = {"model": "tiny", "prompt": PROMPTS[i % 16], "max_tokens": 1 + i % 8,
                "temperature": 0}
        if roll < 0.25:
            _hang_up_after_first_chunk(live.url, body)
            return "dropped"
        if roll < 0.3:
            body["top_p"] = 0
        path = "/v1/completions"
        if 0.3 <= roll < 0.5:
            path = "/v1/chat/completions"
            body = {k: v for k, v in body.items() if k != "prompt"}
            body["messages"] = [{"role": "user", "content": PROMPTS[i % 16]}]
        r = requests.post(live.url + path, json=body, headers=AUTH, timeout=60)
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            return "ok"
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text
        return "refused"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, plan))
    after = live.idle()
    accepted = outcomes.count("ok") + outcomes.count("dropped")
    started = after["serve_requests_started_total"] - before["serve_requests_started_total"]
    assert started == accepted and _finished(after) - _finished(before) == accepted
    assert outcomes.count("refused") and outcomes.count("dropped")
    assert after["serve_pages_used"] == 0


def _burst(n: int, send) -> list:
    """`send(i)` from n threads released at once: what each returned or raised."""
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        try:
            return send(i)
        except Exception as e:            # the caller looks at what was raised
            return e
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.slow
def test_process_full_queue_is_429(model_dir):
    process = _Process(model_dir, "--max-slots", "1", "--max-queue", "1",
                       "--max-tokens-per-step", "16", "--prefill-chunk", "16")
    body = {"model": "tiny", "max_tokens": 50, "temperature": 0}
    try:
        for _ in range(5):                # a burst may be served before it overlaps
            answers = _burst(8, lambda i: requests.post(
                process.url + "/v1/completions", timeout=60,
                json={**body, "prompt": PROMPTS[i]}))
            codes = {r.status_code for r in answers}
            if 429 in codes:
                break
        assert codes == {200, 429}, codes
        busy = next(r for r in answers if r.status_code == 429)
        assert busy.headers["Retry-After"] == "1"
        assert busy.json()["error"]["type"] == "rate_limit_error"
        for _ in range(5):                # the official client raises its own error
            outcomes = _burst(8, lambda i: process.client().completions.create(
                prompt=PROMPTS[i], **body))
            if any(isinstance(o, openai.RateLimitError) for o in outcomes):
                break
        assert any(isinstance(o, openai.RateLimitError) for o in outcomes), outcomes
        assert all(isinstance(o, openai.RateLimitError) or o.choices for o in outcomes)
    finally:
        process.stop()


@pytest.mark.slow
def test_process_sigterm_drains_then_exits_0(model_dir):
    process = _Process(model_dir, "--max-slots", "1", "--max-tokens-per-step", "16",
                       "--prefill-chunk", "16")
    try:
        body = {"model": "tiny", "max_tokens": 50, "temperature": 0, "stream": True}

        def stream(i):
            with requests.post(process.url + "/v1/completions", stream=True, timeout=60,
                               json={**body, "prompt": PROMPTS[i]}) as r:
                return [line for line in r.iter_lines() if line]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            flights = [pool.submit(stream, i) for i in range(4)]
            m, end = {}, time.monotonic() + 30     # every one accepted, some still waiting
            while m.get("serve_requests_started_total", 0) < 4:
                assert time.monotonic() < end, m
                m = process.metrics()
            process.proc.send_signal(signal.SIGTERM)
            refused = None
            while refused is None:
                try:
                    if requests.get(process.url + "/health", timeout=5).status_code == 503:
                        refused = requests.post(process.url + "/v1/completions", timeout=5,
                                                json={**body, "prompt": "x", "stream": False})
                except requests.ConnectionError as e:
                    refused = e
            results = [f.result() for f in flights]
        assert process.proc.wait(60) == 0, process.output()
        if not isinstance(refused, Exception):
            assert refused.status_code == 503 and "stopping" in refused.text
        for lines in results:
            assert lines[-1] == b"data: [DONE]"
            final = json.loads(lines[-2][len(b"data: "):])
            assert final["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        process.stop()


@pytest.mark.slow
def test_an_encoder_decoder_served_in_process_equals_the_engine_alone(tmp_path):
    """The default run's kind of model (a translator: the prompt is the source), over the
    real engine: the server's answer is the engine's own for the same request."""
    import jax

    from models.tokenizer import ByteTokenizer
    from serve.engine import Engine
    from tests.helpers import tiny
    cfg = tiny("encoder_decoder", vocab_size=260, max_len=32)
    model = models.build(cfg)
    dummy = np.full((1, 4), 5, np.int32)
    params = jax.jit(model.init)(jax.random.key(3), dummy, dummy)["params"]
    path = str(tmp_path / "translator")
    models.save(path, cfg, params, ByteTokenizer().with_specials(add_bos=False, add_eos=True))
    engine = Engine(models.load(path), max_slots=2, page_size=8, prefill_chunk=8,
                    metrics=Metrics())
    engine.start()
    try:
        client = _client(engine)
        source = "a cat ."
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": source,
                                                 "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        ids = engine.tokenizer.encode(source, add_special_tokens=True)
        text, _, final = engine.submit(Submission(ids=tuple(ids), request=DecodeRequest(
            max_new_tokens=12))).result()
        assert r.json()["choices"][0]["text"] == text
        assert r.json()["usage"]["prompt_tokens"] == len(ids) == final.usage.prompt_tokens
        # The source may fill the encoder's window: max_tokens does not shorten it.
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 40})
        assert "over the 32 this model takes with its encoder's window" in _error(r, 400, "prompt")
    finally:
        engine.stop(drain=False)


def test_command_line_mistakes_are_one_error_line_and_status_2(tmp_path, model_dir, capsys):
    from serve.__main__ import main
    port = ["--port", str(_free_port())]

    def error(argv) -> str:
        assert main(argv + port) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert "Traceback" not in "\n".join(lines)
        return lines[-1]

    assert error(["--model", str(tmp_path / "none")]).startswith("error:")
    assert error(["--model", model_dir, "--max-slots", "8", "--max-tokens-per-step", "4"]) \
        .startswith("error: max_tokens_per_step=4 must be at least max_slots=8")
    with socket.socket() as taken:                # a port in use: before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        assert main(["--model", "unread", "--port", str(busy)]) == 2
    assert f"error: cannot listen on 127.0.0.1:{busy}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--model", model_dir, "--max-slots", "0"])
    assert e.value.code == 2 and "--max-slots: 0 must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_a_whisper_transcription_over_the_real_engine_equals_transcribe(tmp_path):
    """A tiny random Whisper (4 mel bins, a 0.12 s window) with a byte tokenizer: the
    uploaded WAV's transcription is `decode.whisper.transcribe`'s of the same features."""
    import jax

    from decode.whisper import transcribe
    from models.audio_features import window_features
    from models.audio_files import read_audio
    from models.pretrained import Pretrained
    from models.pretrained.generation import GenerationDefaults
    from models.tokenizer import ByteTokenizer
    from serve.engine import Engine
    cfg = models.get_config("whisper-tiny", vocab_size=260, d_model=32, num_heads=4,
                            mlp_dim=48, num_encoder_layers=1, num_decoder_layers=1,
                            max_len=32, pad_id=0, eos_id=1, bos_id=2,
                            audio=dict(num_mel_bins=4, max_source_positions=6))
    model = models.build(cfg)
    params = model.init(jax.random.key(4), np.zeros((1, 4, 12), np.float32),
                        np.zeros((1, 3), np.int32))["params"]
    raw = dict(decoder_start_token_id=2, eos_token_id=1, forced_decoder_ids=[[1, 5]],
               suppress_tokens=[7], begin_suppress_tokens=[8], max_length=12)
    pre = Pretrained(model=model, config=cfg, params=params, tokenizer=ByteTokenizer(),
                     generation=GenerationDefaults(raw=raw), model_type="whisper")
    engine = Engine(pre, max_slots=2, page_size=4, max_tokens_per_step=8, prefill_chunk=4,
                    metrics=Metrics())
    engine.start()
    try:
        wav = tmp_path / "a.wav"
        wav.write_bytes(_wav(0.1))
        r = _client(engine).post("/v1/audio/transcriptions",
                                 files={"file": ("a.wav", wav.read_bytes())},
                                 data={"model": "tiny", "response_format": "text"})
        assert r.status_code == 200, r.text
        features, _ = window_features([read_audio(str(wav))], audio=cfg.audio)
        out = transcribe(pre, features, max_new_tokens=12)
        want = ByteTokenizer().decode(np.asarray(out.tokens)[0, :int(out.lengths[0])])
        assert r.text == want.strip()
    finally:
        engine.stop(drain=False)


@pytest.mark.slow
def test_adapters_are_models_of_their_own_over_the_real_engine(tmp_path, model_dir, pre):
    """`--adapter NAME=DIR`: a PEFT adapter directory read for the base, listed by GET
    /v1/models beside it, chosen by the `model` field; its answer is the engine's with that
    adapter, and differs from the base's."""
    from models.lora import LoraConfig, join
    from serve.engine import Engine
    from tests.helpers import random_adapters
    lora = LoraConfig(rank=2, alpha=8.0, targets=("query", "value", "mlp"))
    adapted = pre.config.replace(lora=lora)
    path = str(tmp_path / "adapter")
    models.save_adapter(path, adapted, join(pre.params, random_adapters(adapted, 7)),
                        base_name_or_path=model_dir)
    engine = Engine(pre, max_slots=2, page_size=8, prefill_chunk=8, metrics=Metrics(),
                    adapters={"tuned": models.read_adapter(path, model_dir)})
    engine.start(warmup=False)
    try:
        client = _client(engine)
        listed = client.get("/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [("tiny", None),
                                                                 ("tuned", "tiny")]
        answers = {}
        for name in ("tiny", "tuned"):
            r = client.post("/v1/completions", json={"model": name, "prompt": "the cat",
                                                     "max_tokens": 10, "temperature": 0})
            assert r.status_code == 200, r.text
            answers[name] = r.json()["choices"][0]["text"]
        ids = engine.tokenizer.encode("the cat", add_special_tokens=True)
        text = engine.submit(Submission(ids=tuple(ids), request=DecodeRequest(
            max_new_tokens=10), adapter="tuned")).result()[0]
        assert answers["tuned"] == text != answers["tiny"]
        r = client.post("/v1/completions", json={"model": "other", "prompt": "x"})
        assert "this server serves ['tiny', 'tuned']" in _error(r, 404, "model")
    finally:
        engine.stop(drain=False)


def test_an_adapter_flag_that_is_not_name_equals_dir_is_refused(capsys):
    from serve.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["--model", "m", "--adapter", "tuned"])
    assert e.value.code == 2 and "'tuned' is not NAME=DIR" in capsys.readouterr().err


def test_the_mesh_flag_splits_the_parameters_over_the_tensor_axis(pre, capsys):
    """--mesh tensor=N: the parameters split as sharded decoding splits them (the engine
    over such parameters equals one device: tests/test_serve_engine.py); mistakes named."""
    from decode.placement import cache_sharding
    from serve.__main__ import main, placed
    from tests.helpers import tiny
    cfg = tiny("decoder_only", num_heads=4, num_kv_heads=2, vocab_size=64)
    model = models.build(cfg)
    import jax
    params = model.init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"]
    two = placed(dataclasses.replace(pre, model=model, config=cfg, params=params),
                 {"tensor": 2})
    assert cache_sharding(two.params) is not None
    with pytest.raises(models.errors.UserError, match="num_kv_heads=1 does not divide over "
                                                      "the tensor axis of 2 devices"):
        placed(pre, {"tensor": 2})
    with pytest.raises(models.errors.UserError, match="--mesh needs 8 devices; there are 4"):
        placed(pre, {"tensor": 8})
    with pytest.raises(SystemExit) as e:
        main(["--model", "m", "--mesh", "data=2"])
    assert e.value.code == 2 and "give tensor=N and optionally expert=M" in \
        capsys.readouterr().err
