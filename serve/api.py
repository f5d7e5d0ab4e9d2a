"""What crosses between the engine and its callers (the HTTP server, tests, notebooks).

    engine = serve.Engine(pre, max_slots=8, page_size=16)
    engine.start()                                   # compiles every step shape, then runs
    handle = engine.submit(serve.Submission(ids, request, seed=7, stop=("\n",)))
    for event in handle.events():                    # or `async for event in handle.stream()`
        print(event.text, end="")                    # a text delta (whole characters only)
    event.finish_reason, event.usage                 # on the last event: "stop" / "length" ...
    handle.cancel()                                  # frees its slot and pages within a step
    engine.stop(drain=True)                          # refuses new work, finishes what it has

Every accepted submission ends in exactly one final event (`finish_reason` set): "stop" (an
end id or a stop string), "length" (max tokens, or the model's window), "cancelled" (the
caller cancelled it, or the engine stopped without draining) or "error" (`error` says what).
"""

from __future__ import annotations

import dataclasses

from decode.request import DecodeRequest
from models.errors import UserError

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class QueueFull(UserError):
    """The engine's queue holds `max_queue` submissions: try again later (HTTP 429)."""


class EngineStopped(UserError):
    """The engine is stopping or stopped and takes no new submissions (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class Submission:
    """One request to the engine.

    Attributes:
        ids: the prompt's token ids (decoder-only), or the source's (encoder-decoder).
        request: a "greedy" or "sample" `decode.DecodeRequest`: its `max_new_tokens` (None:
            up to the model's window), sampling values, `repetition_penalty` and `eos_id`
            are read; beam search is refused.
        seed: the sampling seed (None: a fresh one): the same seed, prompt and values give
            the same tokens, whatever the batch mates.
        stop: strings that end the output (not included in it).
        presence_penalty, frequency_penalty: OpenAI's penalties on generated tokens (0 off).
        features: Whisper: float32[mel, frames] log-mel features of the audio window; the
            ids are then the decoder's forced prompt.
    """

    ids: tuple[int, ...]
    request: DecodeRequest = DecodeRequest()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    features: object = None


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of one request (OpenAI's `usage`)."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request made since its last event.

    Attributes:
        token_ids: the new tokens (the end token is not included).
        logprobs: the model's log-probability of each of them (before any processor).
        text: the new text: whole characters only, held back at a stop string's possible
            start until it is known not to be one.
        finish_reason: None while running; then one of `FINISH_REASONS`.
        usage: the counts, on the final event.
        error: what went wrong, when finish_reason is "error".
    """

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
