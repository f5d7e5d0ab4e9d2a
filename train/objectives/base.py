"""What an objective is: everything that differs between next-token prediction, masked LM,
classification and the objectives to come, behind one interface. The train step, the
wrappers and the loop are the same for all of them.

An objective is a frozen dataclass made once per run (`train.objectives.registry.fit`
picks its class from the model and the dataset's kind, `build` makes it). It answers:

    before the run    check_settings(settings, model_config)  refuse what it cannot train
                      adapt_model(model_config, labels)       the model it trains (a new
                                                              classifier head, say)
                      build(model_config, tokenizer, settings) the objective itself
    the data          pipeline_options()       PipelineConfig fields: the text role
                                               ("text" or "sentence") and label order
    the model         init_inputs(row)         (arguments, method) of `model.init`
    each step         prepare(batch, key=, row_ids=)   {"targets", "weights"[, "inputs"]}
    (traced)          loss_sums(model, params, batch, task, ...)   token-loss sums
    evaluation        evaluate(run, state, final=)    (more validation metrics, the test
                                                       split's metrics or None)

The loss sums are `train.losses.cross_entropy`'s (`loss`, `nll`, `z_loss`, `correct`,
`weight`, plus any counts of the objective's own, summable over devices): the step
normalises the gradient by the global weight, so every objective's loss is its sum over
weighted positions divided by their count over all devices.

A new objective is one module with a subclass of `Objective` and one line in
`train.objectives.registry.ENTRIES`.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import jax

from models.errors import UserError


class Objective(abc.ABC):
    """The interface (see the module docstring). Subclasses are frozen dataclasses, so an
    objective is hashable and closes over nothing that changes.

    Attributes:
        name: how the objective is named in messages and logs.
        takes_scheduled_sampling: the objective can feed the model's own predictions
            (`scheduled_sampling.enabled`).
        takes_loss_chunks: the objective scores every position over the vocabulary and
            can do it in slices (`loss_chunks`, `train.chunked_loss`).
        reads_generation: `build` takes the model directory's decoding defaults
            (`generation=`, a `GenerationDefaults` or None from scratch).
        reads_chat_template: `build` takes the model's chat template (`chat_template=`,
            a `models.chat.ChatTemplate` or None).
        reads_dataset: `build` takes the run's `train.data.Dataset` (`dataset=`: GRPO's
            rewards read each prompt line's fields).
    """

    name: ClassVar[str]
    takes_scheduled_sampling: ClassVar[bool] = False
    takes_loss_chunks: ClassVar[bool] = False
    reads_generation: ClassVar[bool] = False
    reads_chat_template: ClassVar[bool] = False
    reads_dataset: ClassVar[bool] = False

    @classmethod
    def check_settings(cls, settings, model_config, *, model_name: str) -> None:
        """Refuses settings this objective cannot honour (`settings` is a
        `train.run_config.ObjectiveSettings`).

        Raises:
            UserError: naming the key, its value and why.
        """
        if settings.scheduled_sampling.enabled and not cls.takes_scheduled_sampling:
            what = model_config.architecture.replace("_", "-")
            raise UserError(f"scheduled_sampling.enabled=True needs a model that predicts "
                            f"the next token; {model_name!r} is {what}")
        if settings.loss_chunks and not cls.takes_loss_chunks:
            raise UserError(f"loss_chunks={settings.loss_chunks} slices a loss over the "
                            f"vocabulary at every position, which the {cls.name} objective "
                            "does not compute; leave it 0")

    @classmethod
    def adapt_model(cls, model_config, labels: tuple[str, ...], *, model_name: str,
                    dataset_name: str):
        """The model config this objective trains on data with `labels` (the same config
        unless the objective adds to it)."""
        del labels, model_name, dataset_name
        return model_config

    @classmethod
    @abc.abstractmethod
    def build(cls, model_config, tokenizer, settings, *, model_name: str, **options
              ) -> Objective:
        """The objective for a model (its `TransformerConfig`), the run's tokenizer and the
        objective settings; `options` come from the registry entry.

        Raises:
            UserError: the model or tokenizer lacks what the objective needs (named).
        """

    @property
    def needs_reference_copy(self) -> bool:
        """The train state keeps a frozen copy of the model as the run started
        (`TrainState.reference`), which `loss_sums` then gets as `reference=`."""
        return False

    def pipeline_options(self) -> dict[str, Any]:
        """The `train.data.PipelineConfig` fields this objective fixes (none: text is
        pieces then EOS, as language modelling reads it)."""
        return {}

    @abc.abstractmethod
    def init_inputs(self, row: dict) -> tuple[tuple, str | None]:
        """(positional arguments, method) of `model.init` from one device's rows."""

    @abc.abstractmethod
    def prepare(self, batch: dict, *, key: jax.Array, row_ids: jax.Array) -> dict:
        """What the loss compares with, and where: `targets` and `weights` (float32) of
        equal shape, plus any input the objective makes (masked LM's corrupted `inputs`).

        Args:
            key: the step's key for the objective's draws (masks).
            row_ids: each row's global index, so a device split draws what one device does.
        """

    @abc.abstractmethod
    def loss_sums(self, model, params, batch: dict, task: dict, *, dropout_rng: jax.Array,
                  sample_rng: jax.Array, step, train: bool) -> dict:
        """Loss sums over this device's rows (see the module docstring).

        Args:
            task: `prepare`'s result.
            dropout_rng: the dropout key (unused when not `train`).
            sample_rng: a key of the objective's own (scheduled sampling's draws).
            step: the optimiser step (a traced int).
            train: training (dropout, label smoothing) or evaluation.
        """

    def evaluate(self, run, state, *, final: bool) -> tuple[dict, dict | None]:
        """What an evaluation scores beyond the validation loss: (metrics added to the
        validation ones, the test split's metrics or None). `final` is the evaluation at
        the end of the run.

        Args:
            run: the `train.setup.Run` (its config, data, tokenizer, model, wrapper).
            state: the train state on devices.
        """
        del run, state, final
        return {}, None
