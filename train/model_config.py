"""The one boundary where an experiment config becomes a frozen model config."""

from __future__ import annotations

import models


def model_config(config, vocab_size: int) -> models.TransformerConfig:
    """`config.model` (a preset) with the tokenizer's vocabulary, lengths, dtype, overrides."""
    overrides = dict(config.model_overrides.to_dict()) if config.model_overrides else {}
    max_len = max(config.max_source_length, config.max_target_length,
                  config.max_decode_length + 1)
    preset_max_len = models.get_config(config.model).max_len
    return models.get_config(config.model, **{
        "vocab_size": vocab_size, "max_len": max(max_len, preset_max_len),
        "dtype": config.dtype, **overrides})
