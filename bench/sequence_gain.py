"""Sequence-level fine-tuning against continued teacher forcing at the same wall-clock.

    python -m bench.sequence_gain --task toy --out /tmp/gain [--budget 60] [--slice 5] \\
        [--arms tf mrt scst "mrt:learning_rate=3e-4,sequence.alpha=0.05"]
    python -m bench.sequence_gain --task corpus --data DIR --out /tmp/gain ...

The start: a short teacher-forced run, trained once into OUT/base and reused after (`toy`:
`default` on toy_translation for `--base-steps` steps; `corpus`: `translate_small` on
DIR/{train,validation,test}.tsv, `python -m bench.corpus`'s files, stopped by
`--base-seconds` of its 2,600-step cosine). Each arm continues from its export
(OUT/base/model, `init_from`) into OUT/<arm>:

    tf      continued teacher forcing: `finetune_translation` (packed rows, label smoothing
            0.1, the base run's batch)
    ss      the same with scheduled sampling (`scheduled_sampling.*`: linear to 0.25 over
            `--ss-ramp` steps)
    mrt     `finetune_sequence` (minimum risk, sentence chrF, K 4, alpha 0.005, loss_weight
            0.7, 8 unpacked rows)
    scst    the same with `sequence.objective=scst`

every arm at the same constant learning rate (`--lr`) after `--warmup` steps. `NAME:KEY=VALUE,...`
overrides any config key of one arm (`mrt:sequence.alpha=0.05,learning_rate=3e-4`).

Fairness on a shared machine: each arm gets `--budget` seconds of its own measured step
time (the host's next batch, the step, reading its metrics back: for mrt and scst that
includes drawing and scoring the candidates), and the arms take turns in slices of
`--slice` seconds, so the load other jobs put on the machine falls on all of them alike.
Each arm's first step (compiling) is run but not charged; setting up (data, the
tokenizer, the model) is not charged either. Then each arm is saved, exported and scored
with the start on the test split (`--test-pairs`, default all): BLEU with beam search
(`--beam-size` 4, length penalty 0.6), greedy BLEU, and exact match, with the evaluation's
own pieces (`train.evaluate`). JSON lines:

    {"what": "base", "workdir": ..., "step": ..., "train_seconds": ...}
    {"what": "arm", "arm": "mrt", "overrides": {...}, "steps": 93, "charged_s": 60.3,
     "step_s_median": 0.63, "first_step_s": 9.1, "train": {last logged means}}
    {"what": "score", "arm": "start" | name, "beam_bleu": ..., "greedy_bleu": ...,
     "beam_exact_match": ..., "validation_nll": ..., "pairs": ...}
    {"what": "gain", "arm": name, "beam_bleu_vs_start": ..., "beam_bleu_vs_tf": ...,
     "steps_vs_tf": ...}

Large outputs go under OUT; the arms' directories are emptied first, the base is reused.

Measured on 2 CPU cores shared with three other busy sessions (load 6-10), 1,000 test
pairs, 4 beams; each line one invocation, so its arms are comparable with each other and
with its start, not across invocations (the load changes the steps a budget buys):

    toy: the start is `default` at 400 steps (cosine to 0), beam BLEU 77.9 (exact 0.638)
      60 s an arm, --lr 3e-4: tf 80.5 (90 steps), ss 80.5 (59), mrt 74.0 (43),
        mrt alpha 0.05 73.0 (41), scst 67.9 (40)
      60 s, --lr 1e-4: tf 80.8 (174), mrt 76.1 (84), mrt alpha 1 76.9 (83), mrt alpha 1
        and loss_weight 0.3 77.1 (86); tf at 3e-4 84.0 (182)
      60 s, --lr 1e-4: tf 81.3 (155); mrt with loss_weight 0 (next-token on mrt's 8
        unpacked rows: no sampling) 80.3 (839); mrt with label smoothing 0.1 77.4 (71);
        the same at 32 rows 78.2 (15)
    corpus (--base-overrides max_train_seconds=0,num_train_steps=800: translate_small's
      schedule cut to 800 steps), the start beam BLEU 16.9 (greedy 16.0)
      90 s an arm, --lr 3e-4: tf 17.3 (127 steps), mrt 17.1 (56), mrt alpha 0.05 17.2
        (57), scst 16.2 (58); greedy: tf 16.2, mrt 15.4, scst 14.7

A sequence-level step (4 samples a source, scored on the host) cost 2.0-2.4 teacher-forced
steps of the start's batch and 15 of its own 8 rows: at equal seconds it made half the
updates or fewer, and no setting tried gained over continued teacher forcing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import models
from train import checkpoint, checkpoint_average, configs, evaluate
from train.setup import start_run
from train.step import summarise
from train.trainer import train_and_evaluate

ARMS = {
    "tf": ("finetune_translation", {}),
    "ss": ("finetune_translation", {"scheduled_sampling.enabled": True}),
    "mrt": ("finetune_sequence", {}),
    "scst": ("finetune_sequence", {"sequence.objective": "scst"}),
}


def set_key(config, key: str, value) -> None:
    """`config.KEY = value` for a dotted key, a string converted to the key's type."""
    *parents, last = key.split(".")
    for p in parents:
        config = config[p]
    old = config[last]
    if isinstance(value, str) and not isinstance(old, str):
        value = (value.lower() in ("1", "true", "yes") if isinstance(old, bool)
                 else type(old)(value))
    config[last] = value


def parse_arm(spec: str) -> tuple[str, str, dict]:
    """`NAME[:KEY=VALUE,...]` -> (the label, the preset name, the overrides)."""
    name, _, rest = spec.partition(":")
    if name not in ARMS:
        raise SystemExit(f"unknown arm {name!r}: one of {', '.join(ARMS)}")
    overrides = dict(item.split("=", 1) for item in rest.split(",") if item)
    return spec, name, overrides


def data_keys(task: str, data: str | None, data_dir: str = "") -> dict:
    """The dataset keys of `task`'s runs (`data_dir`: toy's TFDS directory)."""
    if task == "toy":
        return {"dataset": "toy_translation", "data_dir": data_dir}
    if not data:
        raise SystemExit("--task corpus needs --data DIR (python -m bench.corpus --out DIR)")
    files = ",".join(os.path.join(data, f"{s}.tsv") for s in ("train", "validation", "test"))
    return {"dataset": "local_translation", "data_files": files}


def base_config(task: str, data_settings: dict, *, steps: int, seconds: float):
    """The teacher-forced start: a short `default` run (toy) or `translate_small` stopped
    by the clock (corpus); its final evaluation decodes little (the bench scores it)."""
    if task == "toy":
        config = configs.get("default")
        config.update(num_train_steps=steps, warmup_steps=max(1, min(100, steps // 4)),
                      eval_every_steps=100_000, checkpoint_every_steps=steps)
    else:
        config = configs.get("translate_small")
        config.max_train_seconds = seconds
    config.update(num_eval_decode=0, num_test_decode=0, **data_settings)
    return config


def arm_config(preset: str, overrides: dict, *, base, init_from: str, lr: float,
               warmup: int, ss_ramp: int):
    """An arm's config: `preset` from `init_from` at the base run's lengths and data, a
    constant learning rate `lr` after `warmup` steps, nothing decoded during training."""
    config = configs.get(ARMS[preset][0])
    lengths = {k: base[k] for k in ("max_source_length", "max_target_length",
                                     "max_decode_length")}
    config.update(init_from=init_from, learning_rate=lr, warmup_steps=warmup,
                  lr_decay="constant", num_train_steps=1_000_000, log_every_steps=10,
                  eval_every_steps=1_000_000, checkpoint_every_steps=1_000_000,
                  num_eval_decode=0, num_test_decode=0, dataset=base.dataset,
                  data_files=base.data_files, data_dir=base.data_dir, **lengths)
    if ARMS[preset][0] == "finetune_translation":
        config.update(per_device_batch_size=base.per_device_batch_size,
                      label_smoothing=base.label_smoothing)
        config.scheduled_sampling.ramp_steps = ss_ramp
    else:
        config.sequence.update(candidates=4, max_new_tokens=min(32, base.max_decode_length))
    for key, value in {**ARMS[preset][1], **overrides}.items():
        set_key(config, key, value)
    return config


class Arm:
    """One arm's run, stepped by the bench: its state, its steps and its charged time."""

    def __init__(self, label: str, config, workdir: str):
        self.label, self.workdir = label, workdir
        self.run, start = start_run(config, workdir)
        self.state, self.iterator, self.step = start.state, start.iterator, start.step
        self.charged, self.times, self.first_step_s, self.last = 0.0, [], None, {}

    def validation(self) -> dict:
        """Next-token loss metrics of the current parameters on the validation split."""
        out = evaluate.loss_metrics(self.run.wrapper, self.state.eval_params,
                                    self.run.eval_batches)
        return {f"validation_{k}": round(float(out[k]), 4) for k in ("nll", "accuracy")}

    def train_step(self) -> float:
        """One step, its metrics read back; its seconds."""
        t0 = time.perf_counter()
        self.state, metrics = self.run.wrapper.train_step(self.state, next(self.iterator))
        sums = self.run.wrapper.metrics(metrics)
        seconds = time.perf_counter() - t0
        self.step += 1
        if self.step % self.run.config.loop.log_every_steps == 0:
            self.last = {k: round(float(v), 4) for k, v in summarise(sums).items()}
            self.run.writer.write(self.step, "train", self.last)
        return seconds

    def advance(self, seconds: float) -> None:
        """Steps until `seconds` more have been charged (the first step: compiling, free)."""
        if self.first_step_s is None:
            self.first_step_s = self.train_step()
        goal = self.charged + seconds
        while self.charged < goal:
            dt = self.train_step()
            self.times.append(dt)
            self.charged += dt

    def finish(self, *, validate: bool = True) -> dict:
        """Saves, exports and releases the run; its `arm` line (with the validation loss
        unless not `validate`)."""
        validation = self.validation() if validate else {}
        self.run.save(self.step, self.state, self.iterator)
        self.run.export(self.state)
        self.run.writer.close()
        self.run.lock.release()
        return {"what": "arm", "arm": self.label, "steps": self.step,
                "charged_s": round(self.charged, 2),
                "step_s_median": round(statistics.median(self.times), 4) if self.times else None,
                "first_step_s": round(self.first_step_s or 0.0, 2), "train": self.last,
                **validation}


def race(arms: list[Arm], *, budget: float, slice_s: float) -> None:
    """The arms in turn, `slice_s` of charged time each, until each has `budget`."""
    while any(a.charged < budget for a in arms):
        for a in arms:
            if a.charged < budget:
                a.advance(min(slice_s, budget - a.charged))


def score(workdir: str, pairs: list[tuple[str, ...]], *, average_last: int | None,
          beam_size: int, length_penalty: float, greedy: bool = True) -> dict:
    """Beam (and unless not `greedy`, greedy) BLEU and exact match of the model a run
    exports (its newest checkpoint averaged as the run averages, or over `average_last`)."""
    saved = checkpoint.restore_model(workdir)
    experiment = saved.experiment
    count = average_last or experiment.get("average_last_checkpoints", 1)
    saved, _ = checkpoint_average.averaged_model(workdir, saved, count)
    model = models.build(saved.config)
    sources, references = [p[0] for p in pairs], [p[1] for p in pairs]
    limits = dict(max_source_length=experiment["max_source_length"],
                  max_new_tokens=experiment["max_decode_length"])
    beam = evaluate.translate(model, saved.params, saved.tokenizer, sources,
                              beam_size=beam_size, length_penalty=length_penalty, **limits)
    out = {"pairs": len(pairs), "step": saved.step}
    out.update({f"beam_{k}": v for k, v in evaluate.scores(beam, references, "both").items()})
    if greedy:
        hyps = evaluate.translate(model, saved.params, saved.tokenizer, sources, **limits)
        out.update({f"greedy_{k}": v for k, v in
                    evaluate.scores(hyps, references, "both").items()})
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def _print(line: dict) -> None:
    print(json.dumps(line), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sequence_gain",
                                description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=("toy", "corpus"), default="toy")
    p.add_argument("--data", default=None, help="corpus: python -m bench.corpus's --out")
    p.add_argument("--data-dir", default="", help="toy: the TFDS data directory")
    p.add_argument("--out", required=True, help="the base run and the arms' workdirs")
    p.add_argument("--arms", nargs="+", default=["tf", "mrt"])
    p.add_argument("--budget", type=float, default=60.0, help="charged seconds per arm")
    p.add_argument("--slice", type=float, default=5.0, help="charged seconds per turn")
    p.add_argument("--base-steps", type=int, default=400, help="toy: the start's steps")
    p.add_argument("--base-seconds", type=float, default=120.0,
                   help="corpus: the start's max_train_seconds")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--ss-ramp", type=int, default=200)
    p.add_argument("--test-pairs", type=int, default=None, help="default: the whole split")
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--length-penalty", type=float, default=0.6)
    p.add_argument("--base-overrides", default="",
                   help="KEY=VALUE,... for the base run (the smoke test shrinks it)")
    args = p.parse_args(argv)
    arms = [parse_arm(a) for a in args.arms]
    if len({a[0] for a in arms}) != len(arms):
        raise SystemExit("each arm once")

    base_dir = os.path.join(args.out, "base")
    base = base_config(args.task, data_keys(args.task, args.data, args.data_dir),
                       steps=args.base_steps, seconds=args.base_seconds)
    for item in filter(None, args.base_overrides.split(",")):
        set_key(base, *item.split("=", 1))
    if not os.path.exists(os.path.join(base_dir, "summary.json")):
        summary = train_and_evaluate(base, base_dir)
    else:
        with open(os.path.join(base_dir, "summary.json")) as f:
            summary = json.load(f)
    _print({"what": "base", "workdir": base_dir, "step": summary["step"],
            "train_seconds": summary["train_seconds"], "task": args.task})

    runs = []
    for label, preset, overrides in arms:
        workdir = os.path.join(args.out, "arm-" + "".join(
            c if c.isalnum() or c in "-_." else "_" for c in label))
        shutil.rmtree(workdir, ignore_errors=True)
        config = arm_config(preset, overrides, base=base,
                            init_from=os.path.join(base_dir, "model"), lr=args.lr,
                            warmup=args.warmup, ss_ramp=args.ss_ramp)
        runs.append(Arm(label, config, workdir))
    start_validation = runs[0].validation()
    race(runs, budget=args.budget, slice_s=args.slice)
    lines = {}
    for (label, preset, overrides), arm in zip(arms, runs, strict=True):
        line = arm.finish()
        _print({**line, "preset": preset, "overrides": overrides, "lr": args.lr})
        lines[label] = line

    test = _test_pairs(runs[0], args.test_pairs)
    scored = {}
    validation = {"start": start_validation, **lines}
    for label, workdir, average in [("start", base_dir, None)] + [
            (r.label, r.workdir, 1) for r in runs]:
        t0 = time.time()
        scored[label] = score(workdir, test, average_last=average,
                              beam_size=args.beam_size, length_penalty=args.length_penalty)
        _print({"what": "score", "arm": label, **scored[label],
                **{k: v for k, v in validation[label].items() if k.startswith("validation")},
                "beam_size": args.beam_size, "seconds": round(time.time() - t0, 1)})
    ref = next((r.label for r in runs if r.label.split(":")[0] == "tf"), None)
    for r in runs:
        gain = {"what": "gain", "arm": r.label, "beam_bleu_vs_start": round(
            scored[r.label]["beam_bleu"] - scored["start"]["beam_bleu"], 2)}
        if ref and r.label != ref:
            gain["beam_bleu_vs_tf"] = round(scored[r.label]["beam_bleu"]
                                            - scored[ref]["beam_bleu"], 2)
            gain["steps_vs_tf"] = round(lines[r.label]["steps"] / lines[ref]["steps"], 3)
        _print(gain)
    return 0


def _test_pairs(arm: Arm, n: int | None) -> list[tuple[str, ...]]:
    """The first `n` (default all) pairs of the runs' test split."""
    ds, split = arm.run.dataset, arm.run.config.data.test_split
    size = len(ds.split(split))
    return ds.examples(split, range(size if n is None else min(n, size)))


if __name__ == "__main__":
    sys.exit(main())
