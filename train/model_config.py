"""The one boundary where an experiment config becomes a frozen model config: from a preset
(training from scratch) or from a model directory (`init_from`, fine-tuning)."""

from __future__ import annotations

import dataclasses

import models
from models.pretrained import RUNTIME_FIELDS, GenerationDefaults, read_config
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


def model_config(config, vocab_size: int) -> models.TransformerConfig:
    """`config.model` (a preset) with the tokenizer's vocabulary, lengths, dtype, overrides."""
    overrides = dict(config.model_overrides.to_dict()) if config.model_overrides else {}
    max_len = max(config.max_source_length, config.max_target_length,
                  config.max_decode_length + 1)
    preset_max_len = models.get_config(config.model).max_len
    return models.get_config(config.model, **{
        "vocab_size": vocab_size, "max_len": max(max_len, preset_max_len),
        "dtype": config.dtype, **overrides})


def check_trainable(cfg: models.TransformerConfig, name: str) -> None:
    """The trainer's objectives are next-token prediction (decoder-only) and translation
    (encoder-decoder); an encoder-only model is refused by name."""
    if cfg.architecture == "encoder_only":
        raise ValueError(f"model {name!r} is encoder-only: it trains with masked LM or "
                         "classification, which this trainer does not have yet")


def choose_model(config, vocab_size: int) -> ModelChoice:
    """The run's model: `config.init_from`'s (with runtime overrides only: dtype, dropout,
    scan_layers, remat) or the preset's. A directory's config is the one `models.load`
    gives: an encoder-decoder's start token (bos_id) is generation_config.json's
    decoder_start_token_id when it names one.

    Raises:
        ValueError: an override that would change a loaded model's shapes, data longer than
            the loaded model's `max_len`, or a tokenizer larger than its vocabulary.
    """
    if not config.init_from:
        cfg = model_config(config, vocab_size)
        check_trainable(cfg, config.model)
        return ModelChoice(cfg)
    overrides = dict(config.model_overrides.to_dict()) if config.model_overrides else {}
    fixed = sorted(set(overrides) - RUNTIME_FIELDS)
    if fixed:
        raise ValueError(f"model_overrides {fixed} would change the architecture of "
                         f"init_from={config.init_from!r}; only {sorted(RUNTIME_FIELDS)} "
                         "can be overridden when fine-tuning")
    family, cfg, hf = read_config(config.init_from, **{"dtype": config.dtype, **overrides})
    cfg, generation = with_generation(config.init_from, hf, cfg)
    check_trainable(cfg, config.init_from)
    need = max(config.max_source_length, config.max_target_length,
               config.max_decode_length + 1)
    if need > cfg.max_len:
        raise ValueError(f"max_source_length / max_target_length / max_decode_length + 1 = "
                         f"{need} exceed the max_len {cfg.max_len} of {config.init_from}")
    if vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} ids but the model in "
                         f"{config.init_from} only {cfg.vocab_size}")
    return ModelChoice(cfg, family.model_type, generation)
