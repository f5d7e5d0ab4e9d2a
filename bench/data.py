"""python -m bench.data [--steps N] [--data-dir DIR]

Examples per second through the whole input pipeline (grain iterator over the packed,
tokenised default dataset) next to the examples per second the default training step
consumes on this machine, as one JSON line:

    {"pipeline_examples_per_s": ..., "train_examples_per_s": ..., "ratio": ...}

The pipeline must be at least 10x faster than training needs, so data never stalls the step.
Both are measured in the same run on the same batches; the training step is timed after
compilation.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

import models
from train import configs, data as data_lib, state as state_lib
from train.model_config import preset_config
from train.objectives import fit
from train.run_config import RunConfig
from train.setup import make_wrapper, pipeline_config
from train.step import Steps


def _examples(batch: dict) -> int:
    seg = batch["targets_segmentation"].reshape(-1, batch["targets_segmentation"].shape[-1])
    return int(sum(len(set(row[row > 0].tolist())) for row in seg))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="batches timed through the pipeline")
    p.add_argument("--train-steps", type=int, default=20, help="training steps timed")
    p.add_argument("--data-dir", default=None, help="TFDS data dir (default TFDS's)")
    args = p.parse_args(argv)

    settings = RunConfig.from_config(configs.get("default"))
    data = settings.data
    ds = data_lib.load_dataset(data.dataset, args.data_dir)
    texts = (t for ex in ds.examples("train", range(len(ds.split("train")))) for t in ex)
    tok = data_lib.train_sentencepiece(texts, data.vocab_size, model_type=data.spm_model_type)
    pcfg = pipeline_config(settings)
    source, _ = data_lib.train_source(ds, tok, pcfg)
    iterator = data_lib.train_iterator(source, pcfg)
    next(iterator)                                            # first epoch plan, threads up
    t0, n = time.perf_counter(), 0
    for _ in range(args.steps):
        n += _examples(next(iterator))
    pipeline_rate = n / (time.perf_counter() - t0)
    del iterator                      # stop its prefetch threads before timing the step

    cfg = preset_config(settings.model, tok.vocab_size, max_len=settings.needed_max_len)
    cfg, objective = fit(cfg, ds, tok, settings.objective, model_name=settings.model.name)
    model = models.build(cfg)
    init_args, method = objective.init_inputs(jax.tree.map(lambda x: x[0], source[0]))
    params = jax.jit(model.init, static_argnames="method")(
        jax.random.key(0), *init_args, method=method)["params"]
    tx, schedule = state_lib.make_optimizer(settings.optimizer, settings.loop.num_train_steps)
    dp = make_wrapper(settings.parallel, Steps(model, objective, schedule), tx,
                      seed=settings.loop.seed)
    state = dp.put_state(state_lib.TrainState.create(params, tx, 0))
    batches = [source[i] for i in range(args.train_steps + 1)]
    state, m = dp.train_step(state, batches[0])
    jax.block_until_ready(m)
    state, m = dp.train_step(state, batches[0])              # a second warm-up step
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for b in batches[1:]:
        state, m = dp.train_step(state, b)
    jax.block_until_ready(m)
    train_rate = sum(_examples(b) for b in batches[1:]) / (time.perf_counter() - t0)
    print(json.dumps({"pipeline_examples_per_s": round(pipeline_rate, 1),
                      "train_examples_per_s": round(train_rate, 1),
                      "ratio": round(pipeline_rate / train_rate, 2),
                      "devices": jax.local_device_count(), "backend": jax.default_backend(),
                      "per_device_batch_size": settings.batch.per_device_batch_size}))


if __name__ == "__main__":
    main()
