"""The one boundary where the run's model settings become a frozen model config: from a
preset (training from scratch) or from a model directory (`init_from`, fine-tuning).

    choice = choose_model(run.model, tokenizer.vocab_size, max_len=run.needed_max_len)
    choice.config                   # a TransformerConfig

What the data add to the model (a classifier's labels) is the objective's business
(`train.objectives.registry.fit`).
"""

from __future__ import annotations

import dataclasses

import models
from models.errors import UserError
from models.pretrained import GenerationDefaults, read_config
from models.pretrained.generation import with_generation


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """What a run trains: its config, and for a fine-tuned model where it came from.

    Attributes:
        config: the model's `TransformerConfig`.
        model_type: the model directory's type, kept when the run exports (None: the first
            type that expresses the config).
        generation: the directory's decoding defaults (None from scratch).
    """

    config: models.TransformerConfig
    model_type: str | None = None
    generation: GenerationDefaults | None = None


def preset_config(settings, vocab_size: int, *, max_len: int) -> models.TransformerConfig:
    """`settings.model` (a preset) with the tokenizer's vocabulary, the compute dtype and
    `settings.model_overrides`; `max_len` at least the positions the run needs.

    Args:
        settings: a `train.run_config.ModelSettings`.
        max_len: the positions the run's longest sequence needs (the preset's own max_len
            when larger).
    """
    preset_max_len = models.get_config(settings.model).max_len
    return models.get_config(settings.model, **{
        "vocab_size": vocab_size, "max_len": max(max_len, preset_max_len),
        "dtype": settings.dtype, **dict(settings.model_overrides)})


def model_config(experiment, vocab_size: int) -> models.TransformerConfig:
    """The model of an experiment config as checkpoints wrote it before they stored the
    model config (the whole experiment as the config item): its preset, overrides, dtype
    and lengths, with `vocab_size`."""
    overrides = experiment.model_overrides
    settings = _PresetKeys(experiment.model, overrides.to_dict() if overrides else {},
                           experiment.dtype)
    max_len = max(experiment.max_source_length, experiment.max_target_length,
                  experiment.max_decode_length + 1)
    return preset_config(settings, vocab_size, max_len=max_len)


@dataclasses.dataclass(frozen=True)
class _PresetKeys:
    """The model keys `preset_config` reads, from an older checkpoint's experiment."""

    model: str
    model_overrides: dict
    dtype: str


def choose_model(settings, vocab_size: int, *, max_len: int) -> ModelChoice:
    """The run's model: `settings.init_from`'s (with its runtime overrides: dtype, dropout,
    scan_layers, remat; and the adapters `settings.lora` describes) or the preset's
    (`preset_config`). A directory's config is the one
    `models.load` gives: an encoder-decoder's start token (bos_id) is
    generation_config.json's decoder_start_token_id when it names one.

    Args:
        settings: a `train.run_config.ModelSettings` (checked: a directory's overrides
            keep its architecture).
        max_len: the positions the run's longest sequence needs.

    Raises:
        UserError: data longer than the loaded model's `max_len`, or a tokenizer larger
            than its vocabulary.
    """
    if not settings.init_from:
        return ModelChoice(preset_config(settings, vocab_size, max_len=max_len))
    path = settings.init_from
    family, cfg, hf = read_config(path, **{"dtype": settings.dtype,
                                           **dict(settings.model_overrides)})
    cfg, generation = with_generation(path, hf, cfg)
    lora = settings.lora.adapters()
    if lora is not None:              # adapters of its projections; the weights stay frozen
        cfg = cfg.replace(lora=lora)
    if max_len > cfg.max_len:
        raise UserError(f"max_source_length / max_target_length / max_decode_length + 1 = "
                         f"{max_len} exceed the max_len {cfg.max_len} of {path}")
    if vocab_size > cfg.vocab_size:
        raise UserError(f"the tokenizer has {vocab_size} ids but the model in {path} only "
                         f"{cfg.vocab_size}")
    return ModelChoice(cfg, family.model_type, generation)
