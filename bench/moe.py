"""python -m bench.moe [--shape small] [--rows 4] [--seq-len 128] [--steps 9] [--quick]

Training step time of a mixture of experts (`models.moe`) against a dense model of the same
active parameters, and of its two dispatches, one JSON line per variant, all measured in
one run (the variants taking turns step by step, so load from other processes on a shared
machine falls on all of them alike).

Shapes (`--shape`): `small`, llama-small's attention (D 768, 12 heads, 4 kv heads) in 4
layers with 8 experts of width 1024, top 2; `tiny` (`--quick`), llama-tiny's with 8
experts of width 64, top 2. Variants:

    dense        no experts, the MLP of width 2 x 1024 (k x the expert width): the same
                 active parameters per token as the mixture
    moe_ragged   the mixture, dispatched by `jax.lax.ragged_dot` (`moe_dispatch="ragged"`)
    moe_dense    the mixture, every expert on every token (`moe_dispatch="dense"`)
    gpt_oss      the mixture as GPT-OSS's layer has it (`moe_dispatch="ragged"`): biases on
                 the router, the experts and the attention, the clamped SwiGLU, attention
                 sinks, sliding (a window of a quarter of the sequence) and full layers
                 alternating
    deepseek_v3  the mixture as DeepSeek-V3's layer has it: latent attention (a latent of
                 D / 3, queries of rank D / 2, heads of 64 unrotated + 32 rotated key
                 numbers and 64 value numbers), sigmoid scores with the selection bias
                 among the best 2 of 4 groups, scaled x2.5, and one routed expert a token
                 beside a shared one (so the same active MLP width as the others)

The mixtures train with the router's load-balancing loss (coefficient 0.01). Each line:

    params, active_params   all parameters, and those one token uses (the router, k of
                            E experts, the rest of the model)
    step_s_median, step_s_best    of `--steps` steps after a warm-up step, with the default
                            run's optimiser (adamw behind clipping), data parallel over
                            the local devices, `--rows` rows of `--seq-len` random tokens
                            a device
    step_time_ratio         median, this variant over `dense`

Times on a shared CPU are indicative; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax

import models
from bench.common import bench_settings, compile_step, make_state_fn, make_wrapper, param_count
from bench.decode import timed
from bench.train import make_batch

SHAPES = {
    "small": dict(name="llama-small", num_layers=4, expert_width=1024, num_experts=8, k=2),
    "tiny": dict(name="llama-tiny", expert_width=64, num_experts=8, k=2),       # --quick
}
VARIANTS = ("dense", "moe_ragged", "moe_dense", "gpt_oss", "deepseek_v3")


def variant_config(shape: str, variant: str, seq_len: int) -> models.TransformerConfig:
    """The shape's dense model (MLP k x the expert width) or its mixture of experts."""
    fields = dict(SHAPES[shape])
    name, width, experts, k = (fields.pop(x) for x in ("name", "expert_width",
                                                        "num_experts", "k"))
    if variant == "dense":
        return models.get_config(name, **fields, mlp_dim=k * width, max_len=seq_len)
    if variant == "gpt_oss":
        layers = fields.get("num_layers", models.get_config(name).num_layers)
        fields.update(use_bias=True, activation="clamped_swiglu", attention_sinks=True,
                      sliding_window=max(1, seq_len // 4),
                      layer_types=("sliding", "full") * (layers // 2) + ("sliding",) * (
                          layers % 2))
    if variant == "deepseek_v3":
        d = models.get_config(name).d_model
        fields.update(num_kv_heads=models.get_config(name).num_heads, head_dim=96,
                      kv_lora_rank=d // 3, q_lora_rank=d // 2, qk_rope_head_dim=32,
                      v_head_dim=64, rope_interleaved=True, router_score="sigmoid",
                      router_score_bias=True, router_groups=4, router_top_groups=2,
                      routed_scaling=2.5, shared_expert_mlp_dim=width)
        k -= 1                                         # the shared expert is the other
    return models.get_config(name, **fields, mlp_dim=width, max_len=seq_len,
                             num_experts=experts, experts_per_token=k,
                             router_aux_loss_coef=0.01,
                             moe_dispatch="dense" if variant == "moe_dense" else "ragged")


def active_params(cfg: models.TransformerConfig, total: int) -> int:
    """The parameters one token uses: all but the E - k experts it is not routed to."""
    if not cfg.num_experts:
        return total
    per_expert = 3 * cfg.d_model * cfg.expert_width
    if cfg.use_bias:                                   # gate, up and down biases
        per_expert += 2 * cfg.expert_width + cfg.d_model
    return total - cfg.num_layers * (cfg.num_experts - cfg.experts_per_token) * per_expert


class Stepper:
    """One variant's compiled train step and its live state, stepping on random tokens."""

    def __init__(self, cfg, variant: str, *, rows: int, seq_len: int):
        self.variant, self.cfg = variant, cfg
        model = models.build(cfg)
        devices = jax.local_device_count()
        self.wrapper, tx = make_wrapper(model, bench_settings(), rows=rows * devices)
        shapes = {k: (rows * devices, seq_len)
                  for k in ("targets", "targets_segmentation", "targets_position")}
        self.compiled = compile_step(self.wrapper, model, tx, shapes)[0]
        self.state = self.wrapper.init_state(make_state_fn(model, tx))
        self.batch = make_batch(cfg, devices, rows * devices, (seq_len, seq_len))
        self.params = param_count(model)
        self.times: list[float] = []

    def step(self) -> float:
        """Seconds of one step, the batch placed on the devices within it."""
        def run():
            self.state, metrics = self.compiled(self.state,
                                                self.wrapper.put_batch(self.batch))
            return metrics
        return timed(run)[1]


def step_time_lines(shape: str, *, rows: int, seq_len: int, steps: int) -> list[dict]:
    """Median and best seconds of `steps` steps of each variant after a warm-up step, the
    variants taking turns, with each one's ratio to `dense`."""
    steppers = [Stepper(variant_config(shape, v, seq_len), v, rows=rows, seq_len=seq_len)
                for v in VARIANTS]
    for s in steppers:
        s.step()
    for _ in range(steps):
        for s in steppers:
            s.times.append(s.step())
    lines = [{"what": "step_time", "shape": shape, "variant": s.variant,
              "num_experts": s.cfg.num_experts, "experts_per_token":
                  s.cfg.experts_per_token if s.cfg.num_experts else None,
              "mlp_dim": s.cfg.mlp_dim, "params": s.params,
              "active_params": active_params(s.cfg, s.params), "rows_per_device": rows,
              "seq_len": seq_len, "steps": steps,
              "step_s_median": round(statistics.median(s.times), 4),
              "step_s_best": round(min(s.times), 4)} for s in steppers]
    dense = lines[0]["step_s_median"]
    for line in lines[1:]:
        line["step_time_ratio"] = round(line["step_s_median"] / dense, 4)
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=4, help="rows per device")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    p.add_argument("--steps", type=int, default=9, help="timed steps after a warm-up step")
    p.add_argument("--quick", action="store_true", help="tiny, 16 tokens, 2 steps (tests)")
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.seq_len, args.steps = "tiny", 16, min(args.steps, 2)
    common = dict(backend=jax.default_backend(), devices=jax.local_device_count())
    for line in step_time_lines(args.shape, rows=args.rows, seq_len=args.seq_len,
                                steps=args.steps):
        print(json.dumps({**line, **common}), flush=True)


if __name__ == "__main__":
    main()
