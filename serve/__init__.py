"""Serving: continuous batching over a paged KV cache, behind an OpenAI-compatible server.

    engine = serve.Engine(models.load("runs/default/model"), max_slots=8, page_size=16)
    engine.start()
    handle = engine.submit(serve.Submission(ids, decode.DecodeRequest(max_new_tokens=32)))
    "".join(event.text for event in handle.events())

`python -m serve --model DIR` runs the HTTP server (`serve.server`). The engine
(`serve.engine`) owns the slots, the page pool and the queue on the host and runs one
jitted step per iteration (`serve.step`); `serve.api` holds what crosses between them.
`serve` imports `models` and `decode`, never `train`.
"""

from serve.api import FINISH_REASONS, EngineStopped, Event, QueueFull, Submission, Usage
from serve.engine import Engine

__all__ = ["FINISH_REASONS", "Engine", "EngineStopped", "Event", "QueueFull", "Submission",
           "Usage"]
