"""Encoder-only training runs end to end: the `classify` config learns toy_classification,
a stopped masked-LM run resumes bit for bit, a masked-LM export fine-tunes into a
classifier, and label mismatches are refused by name. (That the `mlm` config lowers its
masked-token loss below chance is asserted by notebooks/masked_lm.ipynb, which trains it.)"""

import os
import signal

import chex
import pytest

import models
from train import checkpoint, configs
from train.trainer import train_and_evaluate


def _mlm_config(data_dir: str, **overrides):
    c = configs.get("mlm")
    c.data_dir = data_dir
    c.model_overrides.update(d_model=32, num_heads=2, mlp_dim=64, num_layers=1,
                             use_bias=False)
    c.update(tokenizer="byte", max_source_length=32, max_target_length=32,
             max_decode_length=31, per_device_batch_size=2, eval_per_device_batch_size=250,
             num_train_steps=6, warmup_steps=2, log_every_steps=1, checkpoint_every_steps=3,
             eval_every_steps=1000, lr_decay="constant")
    c.update(overrides)
    return c


def test_the_classify_config_learns_toy_classification(data_dir, tmp_path, optimized_code):
    """400 steps: running them, not compiling, is this test's time (optimised, 0.8x)."""
    config = configs.get("classify")
    config.data_dir = data_dir
    config.per_device_batch_size = 8            # 4 test devices: the config's global 32
    # Evaluated and saved once, at the end (the config's step-200 evaluation and checkpoint
    # change nothing the run learns; the test reads the final one).
    config.eval_every_steps = config.checkpoint_every_steps = config.num_train_steps
    summary = train_and_evaluate(config, str(tmp_path))
    assert summary["test"]["accuracy"] >= 0.95, summary["test"]
    assert summary["test"]["macro_f1"] >= 0.95
    assert set(summary["test"]) >= {"f1/grammatical", "f1/ungrammatical", "loss"}
    pre = models.load(summary["model"])
    assert pre.config.label_names == ("grammatical", "ungrammatical")
    assert pre.tokenizer.encode("a", add_special_tokens=True)[::len("a") + 1] == [2, 1]


def test_a_stopped_masked_lm_run_resumes_bit_for_bit(data_dir, tmp_path):
    config = _mlm_config(data_dir)
    straight = str(tmp_path / "straight")
    train_and_evaluate(config, straight)
    stopped = str(tmp_path / "stopped")
    first = train_and_evaluate(config, stopped, hooks=[
        lambda step, m: step == 1 and os.kill(os.getpid(), signal.SIGTERM)])
    assert first["step"] == 2
    second = train_and_evaluate(config, stopped)
    assert second["resumed_from_step"] == 2 and second["step"] == 6
    chex.assert_trees_all_equal(checkpoint.restore_model(stopped).params,
                                checkpoint.restore_model(straight).params)
    assert models.load(second["model"]).tokenizer.mask_id == 260


def _tsv(path, rows):
    path.write_text("".join(f"{t}\t{label}\n" for t, label in rows))
    return str(path)


def test_a_masked_lm_export_fine_tunes_into_a_classifier_and_mismatches_are_named(
        data_dir, tmp_path, capsys):
    mlm = train_and_evaluate(_mlm_config(data_dir, num_train_steps=2), str(tmp_path / "mlm"))
    files = ",".join(_tsv(tmp_path / f"{s}.tsv", [(f"a {s} line {i}", ("neg", "pos", "meh")[
        i % 3]) for i in range(24)]) for s in ("train", "dev", "test"))

    def classify(workdir, init_from, **overrides):
        c = configs.get("finetune_classify")
        c.update(init_from=init_from, data_files=files,
                 data_dir=data_dir, num_train_steps=2, per_device_batch_size=2,
                 eval_per_device_batch_size=8, warmup_steps=1, log_every_steps=1,
                 max_source_length=32, max_target_length=32, max_decode_length=31)
        c.update(overrides)
        return train_and_evaluate(c, str(tmp_path / workdir))

    tuned = classify("tuned", mlm["model"])
    assert "mlm_head is not used; classifier newly initialised for 3 labels ['meh', 'neg', " \
           "'pos']" in capsys.readouterr().out
    assert models.load(tuned["model"]).config.label_names == ("meh", "neg", "pos")
    assert set(tuned["test"]) >= {"f1/meh", "f1/neg", "f1/pos", "macro_f1"}
    # A classifier with other labels: the count, then an unknown name, are refused.
    pre = models.load(tuned["model"])
    two = str(tmp_path / "two")
    models.save(two, pre.config.replace(num_labels=2, label_names=("neg", "pos")),
                {**pre.params, "classifier": {
                    "pooler": pre.params["classifier"]["pooler"],
                    "classifier": {"kernel": pre.params["classifier"]["classifier"]["kernel"][
                        :, :2], "bias": pre.params["classifier"]["classifier"]["bias"][:2]}}},
                pre.tokenizer)
    with pytest.raises(ValueError, match=r"model '.*two' has num_labels=2, but dataset "
                                         r"'local_classification' has 3 labels \['meh', 'neg', "
                                         r"'pos'\]"):
        classify("count", two)
    other = str(tmp_path / "other")
    models.save(other, pre.config.replace(label_names=("neg", "pos", "good")), pre.params,
                pre.tokenizer)
    with pytest.raises(ValueError, match=r"label\(s\) \['meh'\] that the model's labels "
                                         r"\['neg', 'pos', 'good'\] do not name"):
        classify("unknown", other)
