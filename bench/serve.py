"""python -m bench.serve [--quick] [--requests N] [--model DIR] [--only default|gpt2]

The serving engine against static batching and one request at a time, in one run, on
(a) the default run's encoder-decoder (`runs/default/model`, or `--model DIR`; a random
model of the default config's shape when there is none) and (b) a random decoder-only
model of GPT-2 small's shape. One JSON line per model and mode, then a summary line per
model with `throughput_vs_static`, `throughput_vs_serial`, `ttft_p99_s` and `itl_p99_s`.

The workload (fixed seeds): prompt lengths uniform in [16, 512] and output lengths in
[8, 256] (each within the model's window; every request generates exactly its length).

- `engine` at saturation: every request arrives at once; the engine admits them as slots
  free. Output tokens per second over the whole run; time to first token and the gaps
  between tokens (p50, p99), as the caller sees them.
- `engine` at a moderate rate: Poisson arrivals at half the saturated request rate, for the
  latencies a lightly loaded server gives. `ttft_excess_p99_steps`: the p99 of (time to
  first token - the request's own prompt chunks x the measured chunk time), in decode
  steps (the goal: within 10).
- `static`: the requests in arrival order in batches of `max_slots`, each padded to its
  longest prompt and decoded for its longest output (`decode.generate`, compiled ahead so
  only execution is timed): a request's tokens all come when its batch ends.
- `serial`: one request at a time, likewise.

Every mode's compilation is outside its timing (the engine compiles at start; the
baselines' programs are compiled before their clock starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time

import jax
import numpy as np

import decode
import models
import serve
from models.pretrained import GenerationDefaults, Pretrained
from serve.engine import Engine

GPT2_SMALL = dict(vocab_size=50257, max_len=1024)


@dataclasses.dataclass(frozen=True)
class Job:
    arrival: float
    prompt: tuple[int, ...]
    new: int


def workload(seed: int, n: int, vocab: int, max_prompt: int, max_new: int) -> list[Job]:
    """n requests, prompt lengths in [16, max_prompt], outputs in [8, max_new]."""
    rng = np.random.default_rng(seed)
    return [Job(0.0, tuple(rng.integers(3, vocab, size=int(rng.integers(16, max_prompt + 1)))),
                int(rng.integers(8, max_new + 1))) for _ in range(n)]


def poisson(jobs: list[Job], rate: float, seed: int) -> list[Job]:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(jobs))
    times = np.cumsum(gaps)
    return [dataclasses.replace(j, arrival=float(t)) for j, t in zip(jobs, times, strict=True)]


def percentiles(xs) -> tuple[float, float]:
    xs = np.asarray(xs, np.float64)
    return (round(float(np.percentile(xs, 50)), 4), round(float(np.percentile(xs, 99)), 4)) \
        if xs.size else (None, None)


def run_engine(engine: Engine, jobs: list[Job]) -> dict:
    """Submits each job at its arrival time; returns throughput and latency figures."""
    stamps: list[list[float]] = [[] for _ in jobs]
    threads, start = [], time.perf_counter()
    steps0 = engine.steps

    def consume(i, handle):
        for event in handle.events():
            stamps[i].extend([time.perf_counter() - start] * len(event.token_ids))

    for i, job in enumerate(jobs):
        wait = job.arrival - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        request = decode.DecodeRequest(max_new_tokens=job.new, eos_id=None)
        handle = engine.submit(serve.Submission(job.prompt, request))
        threads.append(threading.Thread(target=consume, args=(i, handle)))
        threads[-1].start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    tokens = sum(len(s) for s in stamps)
    assert tokens == sum(j.new for j in jobs), "every request makes its tokens"
    ttft = [s[0] - j.arrival for s, j in zip(stamps, jobs, strict=True)]
    itl = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False)]
    return dict(mode="engine", seconds=round(elapsed, 3),
                output_tokens_per_s=round(tokens / elapsed, 2),
                ttft_p50_s=percentiles(ttft)[0], ttft_p99_s=percentiles(ttft)[1],
                itl_p50_s=percentiles(itl)[0], itl_p99_s=percentiles(itl)[1],
                steps=engine.steps - steps0, preemptions=engine.preemptions, ttft=ttft)


def run_static(pre, jobs: list[Job], batch: int) -> dict:
    """Batches of `batch` jobs in order, each padded to its longest prompt and output;
    every program compiled before the clock starts."""
    cfg = pre.config
    batches = [jobs[i:i + batch] for i in range(0, len(jobs), batch)]
    compiled = []
    for group in batches:
        prompts, lengths = decode.pad_prompts([j.prompt for j in group])
        new = max(j.new for j in group)
        width = prompts.shape[1] if cfg.is_encoder_decoder else min(
            prompts.shape[1], cfg.max_len - new)
        prompts, lengths = decode.pad_prompts([j.prompt for j in group], width)
        call = decode.generate.lower(pre.model, pre.params, prompts, lengths,
                                     max_new_tokens=new, eos_id=None).compile()
        args, _ = decode.generate_arguments(pre.model, pre.params, prompts, lengths,
                                            max_new_tokens=new, eos_id=None)
        compiled.append((call, args))
    done, start = [], time.perf_counter()
    for (call, args), group in zip(compiled, batches, strict=True):
        jax.block_until_ready(call(*args[1:]))
        done += [time.perf_counter() - start] * len(group)
    elapsed = time.perf_counter() - start
    tokens = sum(j.new for j in jobs)
    return dict(mode="static" if batch > 1 else "serial", seconds=round(elapsed, 3),
                output_tokens_per_s=round(tokens / elapsed, 2),
                ttft_p50_s=percentiles(done)[0], ttft_p99_s=percentiles(done)[1])


def random_pretrained(name: str, **overrides) -> Pretrained:
    cfg = models.get_config(name, **overrides)
    model = models.build(cfg)
    z = np.zeros((1, 8), np.int32)
    inputs = (z, z) if cfg.is_encoder_decoder else (z,)
    params = jax.jit(model.init)(jax.random.key(0), *inputs)["params"]
    return Pretrained(model=model, config=cfg, params=params, tokenizer=None,
                      generation=GenerationDefaults(), model_type=cfg.architecture)


def default_model(path: str | None) -> tuple[str, Pretrained]:
    path = path or os.path.join("runs", "default", "model")
    if os.path.isdir(path):
        return path, models.load(path)
    return "random transformer-tiny (the default run's shape)", random_pretrained(
        "transformer-tiny", d_model=128, num_heads=4, mlp_dim=256, num_encoder_layers=2,
        num_decoder_layers=2, vocab_size=1024)


def measure(name: str, pre: Pretrained, n: int, sizes: dict, seed: int) -> None:
    cfg = pre.config
    max_new = min(256, cfg.max_len // 2)
    max_prompt = min(512, cfg.max_len - max_new) if not cfg.is_encoder_decoder else min(
        512, cfg.max_len)
    jobs = workload(seed, n, cfg.vocab_size, max_prompt, max_new)
    engine = Engine(pre, **sizes)
    t0 = time.perf_counter()
    engine.start()
    base = dict(model=name, requests=n, prompt_range=[16, max_prompt], new_range=[8, max_new],
                **sizes)
    print(json.dumps(dict(base, mode="engine_compile", seconds=round(time.perf_counter() - t0,
                                                                      2),
                          compiled_shapes=engine.compiled_shapes)), flush=True)
    saturated = run_engine(engine, jobs)
    ttft_all = saturated.pop("ttft")
    print(json.dumps(dict(base, rate="saturation", **saturated)), flush=True)
    rate = 0.5 * n / saturated["seconds"]
    step_s = saturated["seconds"] / max(saturated["steps"], 1)
    moderate = run_engine(engine, poisson(jobs, rate, seed + 1))
    ttft = moderate.pop("ttft")
    chunks = [-(-len(j.prompt) // sizes["prefill_chunk"]) for j in jobs]
    excess = [(t - c * step_s) / step_s for t, c in zip(ttft, chunks, strict=True)]
    moderate["ttft_excess_p99_steps"] = percentiles(excess)[1]
    print(json.dumps(dict(base, rate=round(rate, 3), **moderate)), flush=True)
    engine.stop()
    static = run_static(pre, jobs, sizes["max_slots"])
    print(json.dumps(dict(base, **static)), flush=True)
    serial = run_static(pre, jobs, 1)
    print(json.dumps(dict(base, **serial)), flush=True)
    del ttft_all
    print(json.dumps(dict(
        model=name, summary=True,
        throughput_vs_static=round(saturated["output_tokens_per_s"]
                                   / static["output_tokens_per_s"], 2),
        throughput_vs_serial=round(saturated["output_tokens_per_s"]
                                   / serial["output_tokens_per_s"], 2),
        ttft_p99_s=moderate["ttft_p99_s"], itl_p99_s=moderate["itl_p99_s"],
        ttft_excess_p99_steps=moderate["ttft_excess_p99_steps"],
        decode_step_s=round(step_s, 4))), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny decoder-only model and a few requests (a smoke test)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--model", help="the encoder-decoder model directory "
                                        "(default runs/default/model)")
    parser.add_argument("--max-slots", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("default", "gpt2"), default=None,
                        help="one of the two models")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(json.dumps({"device": device.device_kind, "platform": device.platform}), flush=True)
    sizes = dict(max_slots=args.max_slots, page_size=16, max_tokens_per_step=256,
                 prefill_chunk=64)
    if args.quick:
        pre = random_pretrained("gpt-tiny", vocab_size=256, max_len=128)
        measure("random gpt-tiny", pre, min(args.requests, 8), sizes, args.seed)
        return
    if args.only in (None, "default"):
        name, pre = default_model(args.model)
        measure(name, pre, args.requests, sizes, args.seed)
    if args.only in (None, "gpt2"):
        measure("random gpt2-small", random_pretrained("gpt2-small", **GPT2_SMALL),
                args.requests, sizes, args.seed)


if __name__ == "__main__":
    main()
