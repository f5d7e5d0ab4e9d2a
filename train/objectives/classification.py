"""Sequence classification with an encoder-only classifier: each example's label, read at
its first position (`[CLS]` / `<s>`), so a packed row holds several labelled examples.

    objective = Classification(label_names=("neg", "pos"))
    task = objective.prepare(batch, key=key, row_ids=rows)   # labels at first positions

The loss sums carry each class's confusion counts (`train.losses.confusion`), so every
evaluation reports per-class F1; the final one scores the test split too.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from models.errors import UserError
from train import losses
from train.objectives.base import Objective


@dataclasses.dataclass(frozen=True)
class Classification(Objective):
    """Classification (see the module docstring).

    Attributes:
        label_names: the classes in the model's order (its head's outputs).
        label_smoothing, z_loss: the training loss's (`train.losses.cross_entropy`).
    """

    name = "classification"
    label_names: tuple[str, ...] = ()
    label_smoothing: float = 0.0
    z_loss: float = 0.0

    @classmethod
    def adapt_model(cls, model_config, labels: tuple[str, ...], *, model_name: str,
                    dataset_name: str):
        """A classifier of the data's `labels`: a masked-LM model (num_labels 0) gets a new
        head for them; a classifier must have as many labels as the data, and its own names
        (if any) fix the class order (the data's labels are mapped to them by name, see
        `train.data.PipelineConfig.label_names`).

        Raises:
            UserError: a label count that does not match num_labels, naming both.
        """
        if model_config.num_labels == 0:
            return model_config.replace(num_labels=len(labels), label_names=labels)
        if model_config.num_labels != len(labels):
            raise UserError(f"model {model_name!r} has num_labels={model_config.num_labels}, "
                            f"but dataset {dataset_name!r} has {len(labels)} labels "
                            f"{list(labels)[:10]}")
        return (model_config if model_config.label_names
                else model_config.replace(label_names=labels))

    @classmethod
    def build(cls, model_config, tokenizer, settings, *, model_name: str) -> Classification:
        del tokenizer, model_name
        return cls(label_names=tuple(model_config.label_names),
                   label_smoothing=settings.label_smoothing, z_loss=settings.z_loss)

    def pipeline_options(self) -> dict:
        return {"text_role": "sentence", "label_names": self.label_names}

    def init_inputs(self, row: dict) -> tuple[tuple, str | None]:
        return (row["inputs"],), "classify"

    def prepare(self, batch: dict, *, key, row_ids) -> dict:
        del key, row_ids
        first_BT = (batch["inputs_position"] == 0) & (batch["inputs_segmentation"] > 0)
        return {"targets": batch["labels"], "weights": first_BT.astype(jnp.float32)}

    def loss_sums(self, model, params, batch: dict, task: dict, *, dropout_rng, sample_rng,
                  step, train: bool) -> dict:
        del sample_rng, step
        logits_BTC = model.apply({"params": params}, batch["inputs"],
                                 segment_ids=batch["inputs_segmentation"],
                                 positions=batch["inputs_position"], deterministic=not train,
                                 rngs={"dropout": dropout_rng} if train else None,
                                 method="classify_positions")
        sums = losses.cross_entropy(logits_BTC, task["targets"], task["weights"],
                                    label_smoothing=self.label_smoothing if train else 0.0,
                                    z_loss=self.z_loss)
        sums.update(losses.confusion(logits_BTC, task["targets"], task["weights"]))
        return sums

    def evaluate(self, run, state, *, final: bool) -> tuple[dict, dict | None]:
        """At the end, the test split's loss, accuracy and per-class F1 (when it exists)."""
        data = run.config.data
        if not final or data.test_split not in run.dataset.splits:
            return {}, None
        from train import data as data_lib, evaluate
        batches, _ = data_lib.eval_batches(run.dataset, run.tokenizer, run.eval_pipeline,
                                           data.test_split)
        return {}, evaluate.loss_metrics(run.wrapper, state.eval_params, batches, self.label_names)
