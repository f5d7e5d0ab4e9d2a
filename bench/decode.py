"""python -m bench.decode [--quick] [--only NAME ...]

Decoding throughput, one JSON line per measurement, all measured in one run:

- `greedy`, `top_p` (sampling), `beam4` and `no_cache` (the full forward pass re-run on the
  padded sequence every step, the best a cache-free decoder can do under jit) for the
  decoder-only shape of the decoding issue (6 layers, D 512, 8 heads, MLP 2048, V 8192,
  float32), at batch 8 / prompt 32 / 224 new tokens, batch 1, and total length 1024;
  and the same for `transformer-base` (V 8192) with source length 64.
- `roofline`: a plain x @ W over a weight matrix as large as all parameters, for the
  memory bandwidth this machine gives a matmul of the decode batch; each cached line then
  reports `bound_s_per_step` = (parameter bytes + KV-cache bytes the step must read, the
  filled slots on average) / that bandwidth and `fraction_of_bound` = bound / measured.
  A step reads the decoder's parameters only: the encoder and the cross-attention K/V
  projection run once per source, so they are not in the bound (their cost, and the
  prefill's, is in the measured time). Beam search's step runs B x 4 rows: its lines add
  `fraction_of_step_bound`, the same bytes at the bandwidth a matmul of that many rows
  gets (on a CPU a 32-row matmul is already partly compute-bound).
- `beam4` keeps the beams in a `models.BeamKVCache` (the default); `beam4_gathered`
  gathers a plain cache by parent beam every step (`beam_cache="gathered"`).

Every line: `first_call_s` (compile + one run), `decode_s` (the best of `--repeats` further
runs for greedy and top-p, whose timings on a shared CPU are noisy; one run for the slow
beam and no-cache lines), `new_tokens_per_s` (prefill included). The no-cache baseline
times `no_cache_steps` steps (each costs the same, shapes being static) and extrapolates to
the full run.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp

import decode
import models

DECODER_ONLY = dict(architecture="decoder_only", num_layers=6, d_model=512, num_heads=8,
                    mlp_dim=2048, vocab_size=8192, positions="learned", norm="layernorm",
                    norm_position="pre", activation="gelu")


def timed(fn):
    """(fn()'s result, seconds until it is ready)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def step_param_bytes(params) -> int:
    """Parameter bytes a decoding step reads: all but the encoder and the cross-attention
    K/V projection, which run once per source before the loop."""
    once = ("encoder", "cross_kv", "src_embed")
    return sum(x.size * x.dtype.itemsize
               for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
               if getattr(path[0], "key", None) not in once)


def matmul_bandwidth(n_bytes: int, batch: int, repeats: int = 10) -> float:
    """Bytes/s of x[batch, 512] @ W[512, n / 512 / 4] in float32 (weight-read bound), the
    best of `repeats` runs: a roofline is the most the machine gives."""
    cols = max(1, n_bytes // 4 // 512)
    w = jnp.ones((512, cols), jnp.float32)
    x = jnp.ones((batch, 512), jnp.float32)
    f = jax.jit(lambda x, w: x @ w)
    f(x, w).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        _, t = timed(lambda: f(x, w))
        best = min(best, t)
    return w.size * 4 / best


_BANDWIDTHS: dict = {}


def step_bandwidth(n_bytes: int, rows: int) -> float:
    """`matmul_bandwidth` of a batch of `rows`, measured once per (bytes, rows)."""
    if (n_bytes, rows) not in _BANDWIDTHS:
        _BANDWIDTHS[n_bytes, rows] = matmul_bandwidth(n_bytes, rows)
    return _BANDWIDTHS[n_bytes, rows]


def kv_bytes_per_step(cfg, batch: int, prompt: int, new: int, beams: int = 1) -> float:
    """Filled self-attention slots a step must read, averaged over the run, in bytes."""
    avg_filled = prompt + (new - 1) / 2
    per_slot = 2 * cfg.decoder_layers * cfg.num_kv_heads * cfg.head_dim * 4
    return batch * beams * avg_filled * per_slot


def cross_bytes(cfg, batch: int, src_len: int) -> float:
    return batch * src_len * 2 * cfg.decoder_layers * cfg.num_kv_heads * cfg.head_dim * 4


def no_cache_step_fn(model, steps: int):
    """`steps` greedy steps, each re-running the full forward pass over the whole padded
    sequence it is given."""
    cfg = model.config

    @jax.jit
    def run(params, src, seq_BT, lengths_B):
        rows = jnp.arange(seq_BT.shape[0])

        def body(carry, _):
            seq, lens = carry
            args = (src, seq) if cfg.is_encoder_decoder else (seq,)
            logits = model.apply({"params": params}, *args)
            nxt = jnp.argmax(logits[rows, lens - 1], -1).astype(jnp.int32)
            return (seq.at[rows, lens].set(nxt), lens + 1), None

        (seq, lens), _ = jax.lax.scan(body, (seq_BT, lengths_B), None, length=steps)
        return seq
    return run


def best_of(fn, repeats: int) -> float:
    return min(timed(fn)[1] for _ in range(repeats))


def run_case(name, cfg, *, batch, prompt, new, bandwidth, no_cache_steps, only, repeats):
    model = models.build(cfg)
    key = jax.random.key(0)
    prompts = jax.random.randint(key, (batch, prompt), 3, cfg.vocab_size)
    lengths = jnp.full((batch,), prompt, jnp.int32)
    init_args = (prompts, prompts[:, :1]) if cfg.is_encoder_decoder else (prompts,)
    params = jax.jit(model.init)(key, *init_args)["params"]
    p_bytes = step_param_bytes(params)
    base = dict(arch=cfg.architecture, case=name, batch=batch, prompt=prompt, new_tokens=new,
                params=sum(x.size for x in jax.tree.leaves(params)))
    decoder_prompt = 1 if cfg.is_encoder_decoder else prompt
    extra = cross_bytes(cfg, batch, prompt) if cfg.is_encoder_decoder else 0.0
    results = {}

    strategies = {
        "greedy": lambda: decode.generate(model, params, prompts, lengths, max_new_tokens=new,
                                          eos_id=None),
        "top_p": lambda: decode.generate(model, params, prompts, lengths, max_new_tokens=new,
                                         eos_id=None, temperature=1.0, top_p=0.9, rng=key),
        "beam4": lambda: decode.beam_search(model, params, prompts, lengths, beam_size=4,
                                            max_new_tokens=new, eos_id=None),
        "beam4_gathered": lambda: decode.beam_search(model, params, prompts, lengths,
                                                     beam_size=4, max_new_tokens=new,
                                                     eos_id=None, beam_cache="gathered"),
    }
    for strategy, fn in strategies.items():
        if only and strategy not in only:
            continue
        _, first = timed(fn)
        beams = 4 if strategy.startswith("beam4") else 1
        second = best_of(fn, 1 if beams > 1 else repeats)
        kv = kv_bytes_per_step(cfg, batch, decoder_prompt, new, beams) + extra
        bound = (p_bytes + kv) / bandwidth
        line = dict(base, strategy=strategy, first_call_s=round(first, 3),
                    decode_s=round(second, 3), new_tokens_per_s=round(batch * new / second, 1),
                    s_per_step=second / new, bound_s_per_step=bound,
                    fraction_of_bound=round(bound / (second / new), 3))
        if beams > 1:   # the bound again at the bandwidth a matmul of the step's rows gets
            step_bound = (p_bytes + kv) / step_bandwidth(p_bytes, batch * beams)
            line.update(step_rows=batch * beams, step_bound_s_per_step=step_bound,
                        fraction_of_step_bound=round(step_bound / (second / new), 3))
        results[strategy] = line
        print(json.dumps(line), flush=True)

    if not only or "no_cache" in only:
        total = decoder_prompt + new
        seq = jnp.zeros((batch, total), jnp.int32)
        if cfg.is_encoder_decoder:
            src, seq = prompts, seq.at[:, 0].set(cfg.bos_id)
        else:
            src, seq = None, seq.at[:, :prompt].set(prompts)
        run = no_cache_step_fn(model, no_cache_steps)
        _, first = timed(
            lambda: run(params, src, seq, jnp.full((batch,), decoder_prompt, jnp.int32)))
        second = best_of(
            lambda: run(params, src, seq, jnp.full((batch,), decoder_prompt, jnp.int32)), 1)
        per_step = second / no_cache_steps
        line = dict(base, strategy="no_cache", first_call_s=round(first, 3),
                    decode_s=round(per_step * new, 3), measured_steps=no_cache_steps,
                    new_tokens_per_s=round(batch / per_step, 1), s_per_step=per_step)
        results["no_cache"] = line
        print(json.dumps(line), flush=True)
        if "greedy" in results:
            print(json.dumps(dict(base, strategy="speedup", cached_greedy_over_no_cache=round(
                results["greedy"]["new_tokens_per_s"] / line["new_tokens_per_s"], 1))), flush=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.decode",
                                     description=__doc__.split("\n")[2])
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and short runs (a smoke test, not a measurement)")
    parser.add_argument("--only", nargs="*", default=[],
                        help="strategies to run: greedy top_p beam4 beam4_gathered no_cache")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the first")
    parser.add_argument("--cases", nargs="*", default=[],
                        help="cases to run: b8_t256 b1_t256 b8_t1024 encdec_b8_t256")
    args = parser.parse_args(argv)
    print(json.dumps({"device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
                      "jax": jax.__version__}), flush=True)
    if args.quick:
        dec = dict(DECODER_ONLY, num_layers=2, d_model=64, num_heads=4, mlp_dim=128, vocab_size=256)
        cases = {"b8_t256": (dec, 2, 8, 8, 64), "encdec_b8_t256": (None, 2, 8, 8, 64)}
        encdec = models.get_config("transformer-tiny", vocab_size=256, max_len=64)
        no_cache_steps = 2
    else:
        dec = DECODER_ONLY
        cases = {
            "b8_t256": (dec, 8, 32, 224, 256),
            "b1_t256": (dec, 1, 32, 224, 256),
            "b8_t1024": (dec, 8, 32, 992, 1024),
            "encdec_b8_t256": (None, 8, 64, 224, 256),
        }
        encdec = models.get_config("transformer-base", vocab_size=8192, dropout_rate=0.0)
        no_cache_steps = 8
    param_sizes = []
    for name, (shape, batch, _prompt, _new, max_len) in cases.items():
        if args.cases and name not in args.cases:
            continue
        cfg = (encdec.replace(max_len=max_len) if shape is None
               else models.TransformerConfig(**dict(shape, max_len=max_len)))
        param_sizes.append((name, cfg, batch))
    for name, cfg, batch in param_sizes:
        model = models.build(cfg)
        tok = jnp.zeros((1, 4), jnp.int32)
        inputs = (tok, tok) if cfg.is_encoder_decoder else (tok,)
        shapes = jax.eval_shape(model.init, jax.random.key(0), *inputs)["params"]
        n_bytes = step_param_bytes(shapes)
        bw = step_bandwidth(n_bytes, batch)
        print(json.dumps({"case": name, "strategy": "roofline", "step_param_bytes": n_bytes,
                          "matmul_batch": batch, "bandwidth_GB_per_s": round(bw / 1e9, 2)}),
              flush=True)
        shape, batch, prompt, new, _ = cases[name]
        run_case(name, cfg, batch=batch, prompt=prompt, new=new, bandwidth=bw,
                 no_cache_steps=no_cache_steps, only=args.only, repeats=args.repeats)


if __name__ == "__main__":
    main()
