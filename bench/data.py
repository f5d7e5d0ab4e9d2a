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
from train import configs, data as data_lib, parallel, state as state_lib, step as step_lib
from train.model_config import model_config
from train.setup import pipeline_config


def _examples(batch: dict) -> int:
    seg = batch["targets_segmentation"].reshape(-1, batch["targets_segmentation"].shape[-1])
    return int(sum(len(set(row[row > 0].tolist())) for row in seg))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="batches timed through the pipeline")
    p.add_argument("--train-steps", type=int, default=20, help="training steps timed")
    p.add_argument("--data-dir", default=None, help="TFDS data dir (default TFDS's)")
    args = p.parse_args(argv)

    config = configs.get("default")
    ds = data_lib.load_dataset(config.dataset, args.data_dir)
    texts = (t for ex in ds.examples("train", range(len(ds.split("train")))) for t in ex)
    tok = data_lib.train_sentencepiece(texts, config.vocab_size, model_type=config.spm_model_type)
    pcfg = pipeline_config(config)
    source, _ = data_lib.train_source(ds, tok, pcfg)
    iterator = data_lib.train_iterator(source, pcfg)
    next(iterator)                                            # first epoch plan, threads up
    t0, n = time.perf_counter(), 0
    for _ in range(args.steps):
        n += _examples(next(iterator))
    pipeline_rate = n / (time.perf_counter() - t0)
    del iterator                      # stop its prefetch threads before timing the step

    model = models.build(model_config(config, tok.vocab_size))
    first = jax.tree.map(lambda x: x[0], source[0])
    params = jax.jit(model.init)(jax.random.key(0), first["inputs"], first["targets"])["params"]
    tx, schedule = state_lib.make_optimizer(config)
    dp = parallel.DataParallel(config.parallel, *step_lib.make_steps(model, config, schedule))
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
                      "per_device_batch_size": config.per_device_batch_size}))


if __name__ == "__main__":
    main()
