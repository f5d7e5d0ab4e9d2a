"""The server's counters and latency histograms, in Prometheus' text exposition format.

    metrics = Metrics()
    metrics.request_started()                     # the engine calls these
    metrics.observe_ttft(0.042)                   # seconds to the first token
    metrics.observe_itl(0.011)                    # seconds between two tokens
    metrics.add_tokens(prompt=12, generated=30)
    metrics.request_finished("stop")
    metrics.http_response("/v1/completions", 429)  # the HTTP layer calls this one
    metrics.render(engine.gauges())               # GET /metrics

`render` gives every counter, one gauge per entry of the engine's dict and the two
histograms (cumulative buckets, `_sum` and `_count`), each under `serve_` (a name that is
not a valid metric name is cleaned: `pages/used` -> `serve_pages_used`):

    # TYPE serve_requests_finished_total counter
    serve_requests_finished_total{reason="stop"} 1
    # TYPE serve_time_to_first_token_seconds histogram
    serve_time_to_first_token_seconds_bucket{le="0.05"} 1
    ...

Every method takes one lock: the engine's loop thread and the server's event loop call
them at once. Written here rather than taken from prometheus_client: it is this small.
"""

from __future__ import annotations

import bisect
import math
import re
import threading

PREFIX = "serve_"
# Time to first token: queueing and prefill, from milliseconds (a tiny model, an idle
# engine) to tens of seconds (a long queue).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Inter-token latency: one engine step, from a millisecond to a second.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Observations counted into fixed upper bounds (`le`), as Prometheus reads them."""

    def __init__(self, bounds: tuple[float, ...]):
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bucket bounds {bounds} must increase")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(bounds) + 1)        # the last one is +Inf's own
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [f"# TYPE {name} histogram"], 0
        for bound, count in zip(self.bounds + (math.inf,), self.counts, strict=True):
            total += count
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {total}')
        out += [f"{name}_sum {_number(self.sum)}", f"{name}_count {total}"]
        return out


class Metrics:
    """Thread-safe counts of the requests, their tokens and their latencies."""

    def __init__(self):
        self._lock = threading.Lock()
        self.started = 0
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.responses: dict[tuple[str, int], int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def request_started(self) -> None:
        with self._lock:
            self.started += 1

    def request_finished(self, reason: str) -> None:
        """One request ended: "stop", "length", "cancelled" or "error"."""
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(float(seconds))

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(float(seconds))

    def add_tokens(self, prompt: int, generated: int) -> None:
        with self._lock:
            self.prompt_tokens += int(prompt)
            self.generated_tokens += int(generated)

    def http_response(self, endpoint: str, status: int) -> None:
        """One HTTP response of `status` from `endpoint` (a route's path)."""
        with self._lock:
            key = (endpoint, int(status))
            self.responses[key] = self.responses.get(key, 0) + 1

    def snapshot(self) -> dict:
        """The counts as plain values (tests and logs)."""
        with self._lock:
            return dict(started=self.started, finished=dict(self.finished),
                        prompt_tokens=self.prompt_tokens,
                        generated_tokens=self.generated_tokens,
                        ttft_count=sum(self.ttft.counts), itl_count=sum(self.itl.counts))

    def render(self, gauges: dict[str, float]) -> str:
        """The text exposition (format 0.0.4) of these counts and the engine's `gauges`."""
        p = PREFIX
        with self._lock:
            out = [f"# TYPE {p}requests_started_total counter",
                   f"{p}requests_started_total {self.started}",
                   f"# TYPE {p}requests_finished_total counter"]
            out += [f'{p}requests_finished_total{{reason="{_label(r)}"}} {n}'
                    for r, n in sorted(self.finished.items())]
            out += [f"# TYPE {p}prompt_tokens_total counter",
                    f"{p}prompt_tokens_total {self.prompt_tokens}",
                    f"# TYPE {p}generated_tokens_total counter",
                    f"{p}generated_tokens_total {self.generated_tokens}",
                    f"# TYPE {p}http_responses_total counter"]
            out += [f'{p}http_responses_total{{endpoint="{_label(e)}",code="{s}"}} {n}'
                    for (e, s), n in sorted(self.responses.items())]
            out += self.ttft.lines(f"{p}time_to_first_token_seconds")
            out += self.itl.lines(f"{p}inter_token_latency_seconds")
        for key, value in sorted(gauges.items()):
            name = p + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            out += [f"# TYPE {name} gauge", f"{name} {_number(float(value))}"]
        return "\n".join(out) + "\n"


def _number(value: float) -> str:
    """Prometheus' spelling: +Inf, NaN, integers without a fraction."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return str(int(value)) if value == int(value) and abs(value) < 1e15 else repr(value)


def _label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
