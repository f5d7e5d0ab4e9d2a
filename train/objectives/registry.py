"""Which objective a model trains with on which data: the one table that pairs a model's
architecture with a dataset's kind.

    entry = entry_for(model_config, "translation", model_name="transformer-tiny",
                      dataset_name="toy_translation")          # NextToken, decoded
    cfg, objective = fit(model_config, dataset, tokenizer, settings, model_name=...)

    architecture      data kind        objective
    encoder_decoder   translation      next token, scored by decoding at evaluations
    decoder_only      text             next token
    encoder_only      text             masked LM (a model without a classifier head)
    encoder_only      classification   classification (a masked-LM model gets a head)
    encoder_decoder   speech           speech recognition (a Whisper: audio encoder)
    decoder_only      preference       preference (DPO, IPO or SimPO: `dpo.*`)
    decoder_only      chat             next token on the assistant's tokens, in the
                                       model's chat template
    decoder_only      prompts          GRPO on its own completions (`grpo.*`)
    with sequence.objective "mrt" or "scst":
    encoder_decoder   translation      sequence level (`train.objectives.sequence`)

An impossible pair is refused naming both. A new objective is a module of its own (a
subclass of `train.objectives.base.Objective`) and one line in `ENTRIES`. Dataset kinds are
the strings `train.data.Dataset.kind` holds; this table is where the trainer compares them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.errors import UserError
from train.objectives.base import Objective
from train.objectives.classification import Classification
from train.objectives.grpo import Grpo
from train.objectives.masked_lm import MaskedLM
from train.objectives.next_token import NextToken
from train.objectives.preference import Preference
from train.objectives.sequence import SequenceLevel
from train.objectives.speech import Speech


@dataclasses.dataclass(frozen=True)
class Entry:
    """One pairing of a model with a data kind.

    Attributes:
        architecture: the model's `TransformerConfig.architecture`.
        data_kind: the dataset's kind (`train.data.Dataset.kind`).
        objective: the objective's class.
        classifier: the model must have a classifier head (True), must not (False), or
            either (None).
        model_text: how the refusal message names the models of this entry.
        options: keyword arguments of `objective.build`.
        sequence_level: the entry of runs with `sequence.objective` set (sequence-level
            training), instead of those without.
    """

    architecture: str
    data_kind: str
    objective: type[Objective]
    classifier: bool | None = None
    model_text: str = ""
    options: tuple[tuple[str, Any], ...] = ()
    sequence_level: bool = False

    def fits(self, model_config, data_kind: str, sequence_level: bool = False) -> bool:
        return (model_config.architecture == self.architecture
                and data_kind == self.data_kind and sequence_level == self.sequence_level
                and self.classifier in (None, bool(model_config.num_labels)))

    def build(self, model_config, tokenizer, settings, *, model_name: str,
              generation=None, chat_template=None, dataset=None) -> Objective:
        extra = {"generation": generation} if self.objective.reads_generation else {}
        if self.objective.reads_chat_template and dict(self.options).get("chat"):
            extra["chat_template"] = chat_template
        if self.objective.reads_dataset:
            extra["dataset"] = dataset
        return self.objective.build(model_config, tokenizer, settings, model_name=model_name,
                                    **dict(self.options), **extra)


ENTRIES: tuple[Entry, ...] = (
    Entry("encoder_decoder", "translation", NextToken, model_text="an encoder-decoder",
          options=(("decodes", True),)),
    Entry("decoder_only", "text", NextToken, model_text="a decoder-only model"),
    Entry("encoder_only", "text", MaskedLM, classifier=False,
          model_text="an encoder-only one"),
    Entry("encoder_only", "classification", Classification,
          model_text="an encoder-only one"),
    Entry("encoder_decoder", "translation", SequenceLevel, model_text="an encoder-decoder",
          options=(("decodes", True),), sequence_level=True),
    Entry("encoder_decoder", "speech", Speech,
          model_text="a Whisper model (an audio encoder-decoder)"),
    Entry("decoder_only", "preference", Preference, model_text="a decoder-only model"),
    Entry("decoder_only", "chat", NextToken, model_text="a decoder-only model",
          options=(("chat", True),)),
    Entry("decoder_only", "prompts", Grpo, model_text="a decoder-only model"),
)


def _fits_text(sequence_level: bool = False) -> str:
    """What each data kind needs, from `ENTRIES`: "translation needs an encoder-decoder
    (next token); text needs a decoder-only model (next token) or ..."."""
    kinds: dict[str, list[str]] = {}
    for e in ENTRIES:
        if e.sequence_level != sequence_level:
            continue
        kinds.setdefault(e.data_kind, []).append(f"{e.model_text} ({e.objective.name})")
    return "; ".join(f"{kind} needs {' or '.join(needs)}" for kind, needs in kinds.items())


def entry_for(model_config, data_kind: str, *, model_name: str, dataset_name: str,
              sequence_level: bool = False) -> Entry:
    """The entry that trains a model of `model_config` on data of `data_kind` (with
    `sequence_level`: the sequence-level one).

    Raises:
        UserError: no entry does, naming the model and the dataset with what each is.
    """
    for entry in ENTRIES:
        if entry.fits(model_config, data_kind, sequence_level):
            return entry
    what = model_config.architecture
    if what == "encoder_only" and model_config.num_labels:
        what = f"an encoder-only classifier, num_labels={model_config.num_labels}"
    needs = _fits_text(sequence_level)
    if sequence_level:
        needs = f"sequence-level training: {needs}"
    raise UserError(f"model {model_name!r} ({what}) does not fit dataset {dataset_name!r} "
                    f"({data_kind}): {needs}")


def fit(model_config, dataset, tokenizer, settings, *, model_name: str, generation=None,
        chat_template=None):
    """(the model config the run trains, its objective) for a model and the run's dataset.

    Args:
        model_config: the chosen model's `TransformerConfig` (`train.model_config`).
        dataset: the run's `train.data.Dataset` (its name, kind and label names).
        tokenizer: the run's tokenizer.
        settings: the `train.run_config.ObjectiveSettings`.
        generation: the model directory's decoding defaults (`ModelChoice.generation`),
            for an objective that `reads_generation` (Whisper's prompt).
        chat_template: the model's chat template, for chat data.

    Raises:
        UserError: the model does not fit the data, or lacks what the objective needs.
    """
    entry = entry_for(model_config, dataset.kind, model_name=model_name,
                      dataset_name=dataset.name, sequence_level=settings.sequence.enabled)
    cfg = entry.objective.adapt_model(model_config, tuple(dataset.label_names),
                                      model_name=model_name, dataset_name=dataset.name)
    entry.objective.check_settings(settings, cfg, model_name=model_name)
    return cfg, entry.build(cfg, tokenizer, settings, model_name=model_name,
                            generation=generation, chat_template=chat_template,
                            dataset=dataset)
