"""A request inside the engine: its checks, its state and the handle its caller holds.

`checked(engine, submission, number)` turns a `serve.Submission` into a `Live` request, or
refuses it naming the value and the limit; the engine's thread then owns the `Live` (its
slot, its length, the tokens it still has to feed) and pushes `Event`s to its `Handle`,
which the caller reads from a thread (`events`) or an asyncio loop (`stream`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time

import numpy as np

from decode.checks import check_eos
from decode.request import DecodeRequest
from models.audio import check_features
from models.errors import UserError
from serve.api import Event, Submission
from serve.text import Detokenizer

# DecodeRequest fields the engine does not apply: a request that sets one is refused by
# name rather than decoded without it. (`forced_bos_id`, a translation model's target
# language, is applied to text encoder-decoders: `checked`.)
UNSUPPORTED = {"forced_eos_id": None, "min_new_tokens": 0, "no_repeat_ngram_size": 0}


class Handle:
    """One submission's stream of `Event`s (the engine's thread produces, the caller
    consumes from a thread or an asyncio loop)."""

    def __init__(self, engine):
        self._engine, self._lock = engine, threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._loop = self._async_queue = None
        self.cancelled = False

    def _push(self, event: Event) -> None:
        with self._lock:
            if self._loop is None:
                self._queue.put(event)
                return
            try:
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, event)
            except RuntimeError:         # the consumer's loop has closed: nobody listens
                self.cancelled = True

    def events(self):
        """The events, blocking until each arrives; ends after the final one."""
        while True:
            event = self._queue.get()
            yield event
            if event.finish_reason is not None:
                return

    async def stream(self):
        """The events as an async iterator, in the running loop."""
        with self._lock:
            self._loop, self._async_queue = asyncio.get_running_loop(), asyncio.Queue()
            while not self._queue.empty():
                self._async_queue.put_nowait(self._queue.get_nowait())
        while True:
            event = await self._async_queue.get()
            yield event
            if event.finish_reason is not None:
                return

    def cancel(self) -> None:
        """Ends the request: its slot and pages are freed within one step."""
        self.cancelled = True
        self._engine._wake()

    def result(self) -> tuple[str, list[int], Event]:
        """Blocks until the end: (the text, the token ids, the final event); the final
        event's `logprobs` are every token's."""
        text, ids, logprobs, last = [], [], [], None
        for last in self.events():
            text.append(last.text)
            ids.extend(last.token_ids)
            logprobs.extend(last.logprobs)
        return "".join(text), ids, dataclasses.replace(last, logprobs=tuple(logprobs))


@dataclasses.dataclass(eq=False)
class Live:
    """A request from its submission to its end."""

    number: int
    handle: Handle
    prompt: list[int]                   # the decoder's prompt: its input, or [start token]
    source: list[int] | None            # an encoder-decoder's source
    features: object                    # Whisper's [mel, frames], or None
    adapter: int                        # its entry in the engine's adapters (0: the base)
    max_new: int
    eos: frozenset
    sampling: tuple                     # temperature, top_k, top_p, min_p, penalty
    penalties: tuple                    # presence, frequency
    seed: int
    text: Detokenizer
    arrived: float
    generated: list[int] = dataclasses.field(default_factory=list)
    pending: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    length: int = 0                     # positions of the slot's cache it holds
    last_time: float | None = None
    preemptions: int = 0


def checked(engine, s: Submission, number: int) -> Live:
    cfg, request = engine.config, s.request
    if not isinstance(request, DecodeRequest):
        raise UserError(f"request must be a decode.DecodeRequest, got "
                        f"{type(request).__name__}")
    if request.strategy == "beam":
        raise UserError("the engine decodes greedy and sampled requests; beam search "
                        "is decode.beam_search's")
    for name, off in UNSUPPORTED.items():
        if getattr(request, name) != off:
            raise UserError(f"{name}={getattr(request, name)!r}: the engine does not "
                            f"apply {name} (leave it at {off!r})")
    ids = [int(i) for i in s.ids]
    if not ids:
        raise UserError("the prompt is empty: give at least one token")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside the vocabulary [0, "
                        f"{cfg.vocab_size})")
    if request.kv_cache_dtype not in ("auto", engine.kv_cache_dtype):
        raise UserError(f"kv_cache_dtype={request.kv_cache_dtype!r}: the engine's page pool "
                        f"is {engine.kv_cache_dtype!r} for every request "
                        "(Engine(kv_cache_dtype=...), python -m serve --kv-cache-dtype)")
    if request.banned_ids and set(request.banned_ids) != set(engine.banned_ids):
        raise UserError(f"banned_ids={request.banned_ids!r}: the engine bans the same ids "
                        f"for every request, {engine.banned_ids!r} (Engine(banned_ids=...))")
    limit = engine.max_prompt_tokens(request.max_new_tokens)
    if len(ids) > limit:
        raise UserError(f"the prompt is {len(ids)} tokens; the model takes at most "
                        f"{limit} with max_new_tokens={request.max_new_tokens}")
    features = _features(cfg, s.features)
    forced = _forced_first(cfg, request)
    if cfg.is_encoder_decoder and cfg.audio is None:
        prompt, source = [cfg.bos_id, *forced], ids
    else:                                        # a decoder's prompt (Whisper's forced one)
        prompt, source = ids, None
    # A forced first token is the first of max_new_tokens (as in `decode.generate`), fed
    # after the start token rather than chosen: the tokens after it are the request's.
    max_new = (request.max_new_tokens - len(forced) if request.max_new_tokens
               else cfg.max_len - len(prompt))
    if len(prompt) + max_new > cfg.max_len:
        raise UserError(f"max_new_tokens={max_new} with a decoder prompt of "
                        f"{len(prompt)} tokens exceeds the model's max_len {cfg.max_len}")
    if engine.pool.pages_for(len(prompt) + max_new) > engine.num_pages:
        raise UserError(f"{len(prompt) + max_new} positions need "
                        f"{engine.pool.pages_for(len(prompt) + max_new)} pages; the pool "
                        f"has {engine.num_pages}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not -2.0 <= value <= 2.0:
            raise UserError(f"{name}={value} is outside [-2.0, 2.0]")
    stops = tuple(s.stop)
    if any(not isinstance(x, str) or not x for x in stops):
        raise UserError(f"stop={stops!r}: each stop must be a non-empty string")
    if stops and engine.tokenizer is None:
        raise UserError("stop strings need the model directory's tokenizer")
    greedy = request.strategy == "greedy"
    sampling = (0.0 if greedy else request.temperature, 0 if greedy else request.top_k,
                1.0 if greedy else request.top_p, 0.0 if greedy else request.min_p,
                request.repetition_penalty)
    if sampling[1] > cfg.vocab_size:
        raise UserError(f"top_k={sampling[1]} exceeds the vocabulary ({cfg.vocab_size})")
    seed = s.seed if s.seed is not None else int(np.random.default_rng().integers(2**31))
    if not 0 <= seed < 2**32:
        raise UserError(f"seed={seed} must be in [0, 2**32)")
    return Live(number=number, handle=Handle(engine), prompt=prompt,
                 source=source, features=features, adapter=engine.adapter_index(s.adapter),
                 max_new=max_new,
                 eos=frozenset(check_eos(cfg, request.eos_id) or ()),
                 sampling=sampling, penalties=(s.presence_penalty, s.frequency_penalty),
                 seed=seed, text=Detokenizer(engine.tokenizer, stops),
                 arrived=time.perf_counter())


def _forced_first(cfg, request: DecodeRequest) -> list[int]:
    """[forced_bos_id], or []: the first new token of a text encoder-decoder's request."""
    forced = request.forced_bos_id
    if forced is None:
        return []
    if not cfg.is_encoder_decoder or cfg.audio is not None:
        raise UserError(f"forced_bos_id={forced!r}: the engine forces a first token for a "
                        "text encoder-decoder (a translation model's target language) only")
    if not 0 <= forced < cfg.vocab_size:
        raise UserError(f"forced_bos_id={forced} is outside the vocabulary [0, "
                        f"{cfg.vocab_size})")
    if request.max_new_tokens == 1:
        raise UserError("max_new_tokens=1 with forced_bos_id leaves no token to generate "
                        "after the forced one")
    return [int(forced)]


def _features(cfg, features):
    """Whisper's features as float32 [mel, frames], checked; None for a text model."""
    if cfg.audio is None:
        if features is not None:
            raise UserError("features are for an audio model; this one reads text")
        return None
    if features is None:
        raise UserError("a Whisper request needs its audio's features ([mel, frames], "
                        "models.audio_features.log_mel_features)")
    features = np.asarray(features, np.float32)
    check_features(cfg.audio, features[None])
    return features
