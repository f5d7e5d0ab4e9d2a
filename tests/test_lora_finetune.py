"""A LoRA run end to end (`finetune_lora` on a tiny random GPT-2 directory made by
transformers): the loss falls, the run exports PEFT-layout adapters that decode (with their
base found from adapter_config.json) and load in PEFT with our logits, the merged export
loads in transformers, and a resumed run ends with exactly the adapters of a straight one."""

import os
import shutil

import jax
import numpy as np
import pytest

import decode.__main__ as decode_cli
import models
from tests.test_finetune import _finetune_config, gpt2_dir  # noqa: F401  (gpt2_dir: a fixture)
from tests.train_helpers import train_metric_rows
from train import checkpoint, configs
from train.trainer import train_and_evaluate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _lora_config(data_dir, gpt2_dir, steps, **lora):  # noqa: F811
    c = _finetune_config(data_dir, gpt2_dir, steps)       # the same run, adapters on top
    c.update(learning_rate=1e-2, checkpoint_every_steps=4)
    defaults = configs.get("finetune_lora").lora
    c.lora.update(defaults.to_dict())
    c.lora.update(rank=4, alpha=8.0, dropout=0.0, **lora)
    return c


def _logits(pre, ids):
    with jax.default_matmul_precision("highest"):
        return np.asarray(pre.model.apply({"params": pre.params}, ids))


def test_a_lora_run_trains_exports_peft_adapters_and_merges(data_dir, gpt2_dir, tmp_path,  # noqa: F811
                                                            capsys):
    workdir = str(tmp_path / "lora")
    summary = train_and_evaluate(_lora_config(data_dir, gpt2_dir, 12, export_merged=True),
                                 workdir)
    losses = [r["loss"] for r in train_metric_rows(workdir)]
    assert losses[-1] < losses[0] - 0.15, losses          # 5.71 -> 5.47 in 12 steps
    adapter = os.path.join(workdir, "adapter")
    assert os.path.isfile(os.path.join(adapter, "adapter_config.json")), summary
    base = models.load(gpt2_dir[0])
    adapted = models.load(adapter)                        # the base named in the adapter
    assert adapted.config.lora.rank == 4 and adapted.tokenizer is not None
    ids = np.array([base.tokenizer.encode("the cat sat on a mat")])
    ours = _logits(adapted, ids)
    assert np.abs(ours - _logits(base, ids)).max() > 1e-2       # the adapters changed it
    # PEFT reads the run's adapters onto transformers' base model: the same logits (the
    # frozen base trained in bfloat16 storage, but the export adapts the directory's own
    # float32 weights, as PEFT does).
    hf = transformers.AutoModelForCausalLM.from_pretrained(gpt2_dir[0],
                                                           attn_implementation="eager")
    with torch.no_grad():
        expected = peft.PeftModel.from_pretrained(hf, adapter)(torch.tensor(ids)).logits
    np.testing.assert_allclose(ours, expected.numpy(), atol=1e-4, rtol=0)
    merged = models.load(os.path.join(workdir, "model"))
    assert merged.config.lora is None
    np.testing.assert_allclose(_logits(merged, ids), ours, atol=1e-4, rtol=0)
    capsys.readouterr()
    assert decode_cli.main(["--workdir", workdir, "--max-new-tokens", "4", "the cat"]) == 0
    assert decode_cli.main(["--model", gpt2_dir[0], "--adapter", adapter,
                            "--max-new-tokens", "4", "the cat"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert out[0] == out[1] and out[0], out


def test_a_resumed_lora_run_ends_with_the_adapters_of_a_straight_one(data_dir, gpt2_dir,  # noqa: F811
                                                                     tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train_and_evaluate(_lora_config(data_dir, gpt2_dir, 8), straight)
    train_and_evaluate(_lora_config(data_dir, gpt2_dir, 4), resumed)
    shutil.rmtree(os.path.join(resumed, "adapter"))
    train_and_evaluate(_lora_config(data_dir, gpt2_dir, 8), resumed)  # from step 4
    a, b = (checkpoint.restore_model(w, 8) for w in (straight, resumed))
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.config.lora == b.config.lora
