"""The engine: continuous batching of many requests over one paged KV cache.

    engine = serve.Engine(pre, max_slots=8, page_size=16)
    engine.start()                                  # compiles the step shapes, then runs
    handle = engine.submit(serve.Submission(ids, decode.DecodeRequest(max_new_tokens=32)))
    text = "".join(event.text for event in handle.events())

One thread runs the loop; each iteration, between two device steps, the host:

1. retires what was cancelled, then admits waiting requests into free slots, oldest first
   (an encoder-decoder's sources are encoded there, together: `serve.step.admit_sources`);
2. plans the step: every running request with one token to feed (its last new token, or
   the last token of its prompt) is a decode row; its page for that position is taken
   from the pool, and when the pool is empty the newest running request is preempted (its
   pages returned, itself queued first again, to be recomputed from its prompt and the
   tokens it has made). What is left of `max_tokens_per_step` goes to prompt chunks of
   at most `prefill_chunk` tokens, oldest first, as far as free pages allow: a long
   prompt is prefilled over several iterations while the others decode;
3. runs the prompt chunks (rows in a power-of-two bucket, `prefill_chunk` tokens wide),
   then the decode rows (every slot, one token), each one jitted step over fixed shapes;
4. hands each request its new token: an end id or a stop string finishes it ("stop"), so
   does its token limit ("length"); its text delta goes to its handle, and its pages back
   to the pool when it ends.

Exactness: a greedy request's tokens are `decode.generate`'s for that request alone, and
a seeded sampled request's the same every time, whatever its batch mates, its arrival,
its preemptions or its pages (tests/test_serve_engine.py).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time

import jax
import numpy as np

import models
from decode.placement import cache_sharding
from models.cache_int8 import check_kv_cache_dtype
from models.errors import UserError, check_positive_int
from serve import step as device
from serve.adapters import stack as stack_adapters
from serve.api import EngineStopped, Event, QueueFull, Submission, Usage
from serve.pages import PagePool, default_num_pages
from serve.requests import Handle, Live, checked


class _NoMetrics:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


class Engine:
    """Continuous batching over a paged KV cache for a decoder-only or encoder-decoder model.

    Args:
        pre: a `models.Pretrained` (`models.load(DIR)`).
        max_slots: requests decoded at once (each step's rows).
        page_size: positions per page.
        num_pages: pages in the pool; None: enough for every slot at the model's full
            window, or what the device's free memory holds when it reports it.
        max_tokens_per_step: the tokens one iteration feeds (decode rows count one each);
            the rest of it goes to prompt chunks.
        prefill_chunk: the most prompt tokens of one request fed in one iteration.
        max_queue: submissions waiting for a slot before `submit` raises `QueueFull`.
        decode_steps: tokens a decode call makes per row while no request waits for a slot
            (1: one per call, the host deciding between every two).
        metrics: an object with the `serve.metrics.Metrics` methods (None: none recorded).
        banned_ids: ids no request generates (None: the model directory's own, its
            bad_words_ids or Whisper's suppress_tokens).
        banned_first_ids: ids no request generates first (None: Whisper's
            begin_suppress_tokens; none for a text model).
        adapters: LoRA adapters of this base served by name, {name: (LoraConfig, adapter
            tree)} as `models.read_adapter` gives them; a request names one
            (`Submission.adapter`) or none, and one step mixes them (`serve.adapters`).
        kv_cache_dtype: the pool's pages: "auto" (the config's dtype) or "int8" (int8 keys
            and values with a scale per token per kv head, `models.cache_int8`: about a
            quarter of float32's bytes, so `num_pages`' default holds about four times the
            tokens where the device reports its memory). Every request is decoded with
            it; one whose `DecodeRequest.kv_cache_dtype` names another (not "auto") is
            refused.

    Raises:
        UserError: a size out of range (naming it), or a model the engine cannot serve.
    """

    def __init__(self, pre, *, max_slots: int = 8, page_size: int = 16,
                 num_pages: int | None = None, max_tokens_per_step: int = 256,
                 prefill_chunk: int = 64, max_queue: int = 256, decode_steps: int = 4,
                 metrics=None, banned_ids=None, banned_first_ids=None, adapters=None,
                 kv_cache_dtype: str = "auto"):
        self.model, self.params, self.config = pre.model, pre.params, pre.config
        self.adapters = self._adapters = None
        if adapters:
            self.adapters = stack_adapters(pre, adapters)
            self._adapters = self.adapters.stacked
            self.model = models.build(self.config.replace(lora=self.adapters.lora))
        self.tokenizer, self.generation = pre.tokenizer, pre.generation
        cfg = self.config
        if cfg.architecture not in ("decoder_only", "encoder_decoder"):
            raise UserError(f"the engine serves generative models; this one is "
                            f"{cfg.architecture}")
        self.max_slots = check_positive_int(max_slots, "max_slots")
        self.page_size = check_positive_int(page_size, "page_size")
        self.prefill_chunk = check_positive_int(prefill_chunk, "prefill_chunk")
        self.max_tokens_per_step = check_positive_int(max_tokens_per_step,
                                                      "max_tokens_per_step")
        if self.max_tokens_per_step < self.max_slots:
            raise UserError(f"max_tokens_per_step={max_tokens_per_step} must be at least "
                            f"max_slots={max_slots}: every slot feeds a token each step")
        self.max_queue = check_positive_int(max_queue, "max_queue")
        self.decode_steps = check_positive_int(decode_steps, "decode_steps")
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        pages_per_slot = -(-cfg.max_len // self.page_size)
        if num_pages is None:
            num_pages = default_num_pages(cfg, self.max_slots, pages_per_slot, self.page_size,
                                          self.kv_cache_dtype)
        self.num_pages = check_positive_int(num_pages, "num_pages")
        self.metrics = metrics if metrics is not None else _NoMetrics()
        self.pool = PagePool(self.num_pages, self.page_size, self.max_slots, pages_per_slot)
        # The page-table widths a decode step compiles for: powers of two, then all.
        self.page_buckets = sorted({min(1 << i, pages_per_slot)
                                    for i in range(pages_per_slot.bit_length() + 1)})
        self._source_len = None if not cfg.is_encoder_decoder else (
            cfg.max_len if cfg.audio is None else cfg.audio.max_source_positions)
        self.banned_ids, self.banned = device.Banned.for_model(pre, banned_ids, banned_first_ids)
        # Parameters split over a mesh's tensor axis split the pool by kv heads the same way.
        self._sharding = cache_sharding(self.params)
        self._state = device.create_state(cfg, slots=self.max_slots, num_pages=self.num_pages,
                                          page_size=self.page_size,
                                          pages_per_slot=pages_per_slot,
                                          source_len=self._source_len,
                                          cache_sharding=self._sharding,
                                          kv_cache_dtype=self.kv_cache_dtype)
        self._cv = threading.Condition()
        self._incoming: collections.deque[Live] = collections.deque()
        self._waiting: collections.deque[Live] = collections.deque()
        self._slots: list[Live | None] = [None] * self.max_slots
        self._numbers = itertools.count()
        self._stopping = self._drain = False
        self._thread: threading.Thread | None = None
        self._recent: collections.deque = collections.deque(maxlen=64)   # (time, tokens)
        self.compiled_shapes = 0
        self.failure: str | None = None           # what stopped the loop, if an error did
        self.preemptions = 0
        self.steps = 0

    # --- the callers' side --------------------------------------------------------------

    def adapter_index(self, name: str | None) -> int:
        """A request's adapter entry (0: the base).

        Raises:
            UserError: a name this engine does not serve.
        """
        if self.adapters is None:
            if name is not None:
                raise UserError(f"adapter {name!r}: this engine serves no adapters")
            return 0
        return self.adapters.index(name)

    def max_prompt_tokens(self, max_new_tokens: int | None = None) -> int:
        """The longest prompt (decoder-only; Whisper's decoder prompt) or source (a text
        encoder-decoder) accepted with `max_new_tokens` new tokens (None: at least one)."""
        cfg = self.config
        if cfg.is_encoder_decoder and cfg.audio is None:
            return cfg.max_len
        return cfg.max_len - (1 if max_new_tokens is None else max_new_tokens)

    def submit(self, submission: Submission) -> Handle:
        """Queues a request; its events come through the returned handle.

        Raises:
            UserError: a request the engine cannot decode (naming the value and the limit).
            QueueFull: `max_queue` requests are already waiting.
            EngineStopped: the engine is stopping.
        """
        live = checked(self, submission, next(self._numbers))
        with self._cv:
            if self.failure is not None:
                raise EngineStopped(f"the engine stopped after an error: {self.failure}")
            if self._stopping:
                raise EngineStopped("the engine is stopping and takes no new requests")
            if len(self._incoming) + len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting (max_queue)")
            self._incoming.append(live)
            self._cv.notify()
        self.metrics.request_started()
        return live.handle

    def gauges(self) -> dict[str, float]:
        """Waiting and running requests, pages in use, and recent tokens per second."""
        with self._cv:
            waiting = len(self._incoming) + len(self._waiting)
        recent = list(self._recent)
        rate = 0.0
        if len(recent) > 1 and recent[-1][0] > recent[0][0]:
            rate = sum(n for _, n in recent[1:]) / (recent[-1][0] - recent[0][0])
        return {"waiting": waiting, "running": sum(x is not None for x in self._slots),
                "pages_used": self.pool.used, "pages_total": self.num_pages,
                "tokens_per_second": rate}

    def start(self, warmup: bool = True) -> Engine:
        """Compiles every step shape (`warmup`), then starts the loop thread."""
        if warmup:
            self._warm_up()
        self._thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuses new requests; with `drain` finishes the ones it holds, else cancels
        them; returns once the loop has ended (or after `timeout` seconds)."""
        with self._cv:
            self._stopping, self._drain = True, drain
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # --- the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._incoming or self._waiting or self._busy() or self._stopping):
                    self._cv.wait()
                self._waiting.extend(self._incoming)
                self._incoming.clear()
                if self._stopping and not self._drain:
                    for live in list(self._waiting) + [x for x in self._slots if x]:
                        live.handle.cancelled = True
                if self._stopping and not (self._waiting or self._busy()) and not any(
                        x and x.handle.cancelled for x in self._slots):
                    return
            try:
                self._iterate()
            except Exception as e:       # a bug: every request hears of it, and the engine
                self.failure = f"{type(e).__name__}: {e}"        # takes no more (submit)
                with self._cv:
                    self._stopping = True
                    self._waiting.extend(self._incoming)
                    self._incoming.clear()
                for live in list(self._waiting) + [x for x in self._slots if x]:
                    self._finish(live, "error", error=self.failure)
                self._waiting.clear()
                raise

    def _busy(self) -> bool:
        return any(x is not None for x in self._slots)

    def _iterate(self) -> None:
        for live in [x for x in self._waiting if x.handle.cancelled]:
            self._waiting.remove(live)
            self._finish(live, "cancelled")
        for live in [x for x in self._slots if x is not None and x.handle.cancelled]:
            self._finish(live, "cancelled")
        self._admit()
        decode_rows, chunks = self._plan()
        if chunks:
            self._prefill(chunks)
        if decode_rows:
            self._decode(decode_rows)

    def _admit(self) -> None:
        """Free slots to waiting requests, oldest first, while the pool has the pages of
        each one's first prompt chunk."""
        arrivals, promised = [], 0
        while self._waiting and None in self._slots:
            first = min(len(self._waiting[0].prompt) + len(self._waiting[0].generated),
                        self.prefill_chunk)
            promised += self.pool.pages_for(first)
            if promised > self.pool.free:
                break
            live = self._waiting.popleft()
            live.slot = self._slots.index(None)
            self._slots[live.slot] = live
            live.length = 0
            live.pending = live.prompt + live.generated
            arrivals.append(live)
        if arrivals and self.config.is_encoder_decoder:
            self._encode(arrivals)

    def _encode(self, arrivals: list[Live], R: int | None = None,
                width: int | None = None) -> None:
        """Encodes the arrivals' sources together into their slots' cross-attention
        regions: R rows (the bucket of their count), each source right-padded to `width`
        (the bucket of the longest, `source_widths`); Whisper's features are one window."""
        R = R or self._row_bucket(len(arrivals))
        slots = np.full((R,), self.max_slots, np.int32)
        for r, live in enumerate(arrivals):
            slots[r] = live.slot
        if self.config.audio is not None:
            audio = self.config.audio
            features = np.zeros((R, audio.num_mel_bins, audio.num_frames), np.float32)
            for r, live in enumerate(arrivals):
                features[r] = live.features
            self._state = device.admit_sources(
                self.model, self.params, self._state, slots, features, None, self._adapters,
                self._arrival_adapters(arrivals, R), cache_sharding=self._sharding)
            return
        longest = max((len(x.source) for x in arrivals), default=1)
        width = width or next(w for w in self.source_widths if w >= longest)
        src = np.zeros((R, width), np.int32)
        lengths = np.ones((R,), np.int32)             # padding rows: one (ignored) token
        for r, live in enumerate(arrivals):
            src[r, :len(live.source)], lengths[r] = live.source, len(live.source)
        self._state = device.admit_sources(
            self.model, self.params, self._state, slots, src, lengths, self._adapters,
            self._arrival_adapters(arrivals, R), cache_sharding=self._sharding)

    def _arrival_adapters(self, arrivals: list[Live], R: int):
        """int32[R]: each arriving row's adapter entry (None without adapters)."""
        if self._adapters is None:
            return None
        index = np.zeros((R,), np.int32)
        index[:len(arrivals)] = [x.adapter for x in arrivals]
        return index

    def _row_bucket(self, n: int) -> int:
        """The rows a step of n requests compiles for: the next power of two, at most
        max_slots."""
        return min(_bucket(n), self.max_slots)

    @property
    def source_widths(self) -> list[int]:
        """The padded source widths the encoder compiles for: powers of two from 16, then
        the model's window."""
        return sorted({min(max(16, 1 << i), self._source_len)
                       for i in range(self._source_len.bit_length() + 1)})

    def _plan(self) -> tuple[list[Live], list[tuple[Live, int]]]:
        """The decode rows and the prompt chunks of this iteration, their pages taken
        (preempting the newest running requests when the pool runs out)."""
        running = sorted((x for x in self._slots if x is not None), key=lambda x: x.number)
        decode_rows = []
        for live in running:
            if live.slot is None or len(live.pending) != 1:
                continue
            while not self.pool.ensure(live.slot, live.length + 1):
                victim = max((x for x in self._slots if x is not None),
                             key=lambda x: x.number)
                self._preempt(victim)
                if victim is live:
                    break
            if live.slot is not None:
                decode_rows.append(live)
        budget = self.max_tokens_per_step - len(decode_rows)
        chunks = []
        for live in running:
            if live.slot is None or len(live.pending) <= 1 or budget <= 0:
                continue
            room = (self.pool.held(live.slot) + self.pool.free) * self.page_size - live.length
            n = min(len(live.pending), self.prefill_chunk, budget, room)
            if n > 0 and self.pool.ensure(live.slot, live.length + n):
                chunks.append((live, n))
                budget -= n
        if not decode_rows and not chunks and running:
            # Prompts stalled for pages held by other prompts: the newest gives way.
            self._preempt(running[-1])
        return decode_rows, chunks

    def _preempt(self, live: Live) -> None:
        self.pool.release(live.slot)
        self._slots[live.slot] = None
        live.slot, live.length, live.pending = None, 0, []
        live.preemptions += 1
        self.preemptions += 1
        self._waiting.appendleft(live)

    def _rows(self, rows: list[Live], width: int, feeds: list[list[int]], *,
              all_slots: bool, R: int | None = None, M: int | None = None) -> device.StepRows:
        """The `StepRows` of `rows` feeding `feeds`: row r is slot r when `all_slots`, else
        the rows in order, padded to `R` (default: the bucket of their count); each row's
        first `M` page-table entries (default: all)."""
        R = self.max_slots if all_slots else (R or self._row_bucket(len(rows)))
        M = M or self.pool.table.shape[1]
        out = device.StepRows.padding(R, width, M, slots=self.max_slots,
                                      num_pages=self.num_pages)
        if all_slots:
            out.ints[device.INTS.index("slots")] = np.arange(R)
        for i, (live, feed) in enumerate(zip(rows, feeds, strict=True)):
            r = live.slot if all_slots else i
            out.tokens[r, :len(feed)] = feed
            out.page_table[r] = self.pool.table[live.slot, :M]
            temperature, top_k, top_p, min_p, penalty = live.sampling
            out.set(r, slots=live.slot, n_new=len(feed), lengths=live.length,
                    generated_from=len(live.prompt), generated=len(live.generated),
                    seed=live.seed, top_k=top_k, adapter=live.adapter,
                    temperature=temperature, top_p=top_p,
                    min_p=min_p, repetition_penalty=penalty, presence=live.penalties[0],
                    frequency=live.penalties[1])
        return out

    def _prefill(self, chunks: list[tuple[Live, int]]) -> None:
        rows = [live for live, _ in chunks]
        feeds = [live.pending[:n] for live, n in chunks]
        tokens, logprobs = self._step(
            self._rows(rows, self.prefill_chunk, feeds, all_slots=False), False)
        for i, (live, n) in enumerate(chunks):
            live.length += n
            live.pending = live.pending[n:]
            if not live.pending:
                self._new_token(live, int(tokens[0, i]), float(logprobs[0, i]))

    def _decode(self, rows: list[Live]) -> None:
        """The next tokens of every decode row, attending over as many pages as the longest
        row holds (rounded up to a power of two, `page_buckets`): a step reads what is in
        flight, not every slot's full window. When nothing waits for a slot, one call makes
        `decode_steps` tokens a row (`serve.step.run_step`'s `steps`), as far as the pool
        has their pages: the host's work per step, most of a small model's step, is paid
        once for them all."""
        steps = self._steps_for(rows)
        held = max(self.pool.held(x.slot) for x in rows)
        M = next(m for m in self.page_buckets if m >= held)
        tokens, logprobs = self._step(
            self._rows(rows, 1, [x.pending for x in rows], all_slots=True, M=M), True,
            steps=steps)
        for live in rows:
            for j in range(steps):
                if live.slot is None:                # it ended: the rest is not its
                    break
                live.length += 1
                live.pending = []
                self._new_token(live, int(tokens[j, live.slot]), float(logprobs[j, live.slot]))

    def _steps_for(self, rows: list[Live]) -> int:
        """Tokens a row for this decode call: `decode_steps` while no waiting request could
        take a slot now (none waits; or every slot is busy and every row needs that many
        more tokens, so no slot frees on the way and idles) and every row has room and
        pages for them (taken here); else 1. (Two programs a page width, no more.)"""
        k = self.decode_steps
        if k > 1 and (self._waiting or self._incoming) and (
                None in self._slots or any(x.max_new - len(x.generated) < k for x in rows)):
            return 1
        room = self.pool.table.shape[1] * self.page_size
        if k == 1 or any(x.length + k > room for x in rows):
            return 1
        for live in rows:
            if not self.pool.ensure(live.slot, live.length + k):
                return 1
        return k

    def _step(self, rows: device.StepRows, all_slots: bool,
              steps: int = 1) -> tuple[np.ndarray, np.ndarray]:
        tokens, logprobs, self._state = device.run_step(
            self.model, self.params, self._state, rows, self.banned, self._adapters,
            all_slots=all_slots, cache_sharding=self._sharding, steps=steps)
        self.steps += 1
        return jax.device_get((tokens, logprobs))

    def _new_token(self, live: Live, token: int, logprob: float) -> None:
        now = time.perf_counter()
        if live.last_time is None:
            self.metrics.observe_ttft(now - live.arrived)
        else:
            self.metrics.observe_itl(now - live.last_time)
        live.last_time = now
        self._recent.append((now, 1))
        if token in live.eos:
            self._finish(live, "stop")
            return
        live.generated.append(token)
        live.pending = [token]
        delta, stopped = live.text.add(token)
        made = dict(token=token, logprob=logprob, delta=delta)
        if stopped:
            self._finish(live, "stop", **made)
        elif len(live.generated) >= live.max_new:
            self._finish(live, "length", **{**made, "delta": delta + live.text.flush()})
        else:
            live.handle._push(Event(token_ids=(token,), logprobs=(logprob,), text=delta))

    def _finish(self, live: Live, reason: str, *, token: int | None = None,
                logprob: float = 0.0, delta: str = "", error: str | None = None) -> None:
        if live.slot is not None:
            self.pool.release(live.slot)
            self._slots[live.slot] = None
            live.slot = None
        if reason == "stop" and token is None:
            delta += live.text.flush()
        usage = Usage(len(live.source if live.source is not None else live.prompt),
                      len(live.generated))
        self.metrics.request_finished(reason)
        self.metrics.add_tokens(usage.prompt_tokens, usage.completion_tokens)
        made = {} if token is None else dict(token_ids=(token,), logprobs=(logprob,))
        live.handle._push(Event(**made, text=delta, finish_reason=reason, usage=usage,
                                error=error))

    # --- compilation ----------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Compiles the decode step (every page-table width), every prompt-chunk bucket and,
        for an encoder-decoder, the encoder of every arrival bucket and source width, each
        run once on padding rows that write nothing: no request waits for a compile."""
        buckets = sorted({self._row_bucket(n) for n in range(1, self.max_slots + 1)})
        for M in self.page_buckets:
            for steps in sorted({1, self.decode_steps}):
                self._step(self._rows([], 1, [], all_slots=True, M=M), True, steps=steps)
        for R in buckets:
            self._step(self._rows([], self.prefill_chunk, [], all_slots=False, R=R), False)
        encoders = []
        if self.config.is_encoder_decoder:
            widths = [None] if self.config.audio is not None else self.source_widths
            encoders = [(R, w) for R in buckets for w in widths]
            for R, width in encoders:
                self._encode([], R, width)
        self.compiled_shapes = (len(self.page_buckets) * len({1, self.decode_steps})
                                + len(buckets) + len(encoders))
