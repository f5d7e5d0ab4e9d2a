"""The one boundary where an experiment config becomes a frozen model config: from a preset
(training from scratch) or from a model directory (`init_from`, fine-tuning)."""

from __future__ import annotations

import dataclasses

import models
from models.errors import UserError
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


# What each architecture trains on (the dataset's kind) and with what objective.
FITS = {"encoder_decoder": ("translation",), "decoder_only": ("text",),
        "encoder_only": ("text", "classification")}
FITS_TEXT = ("translation needs an encoder-decoder, text a decoder-only model (next token) "
             "or an encoder-only one (masked LM), classification an encoder-only one")


def check_fits(cfg: models.TransformerConfig, name: str, dataset: str, kind: str) -> None:
    """Raises a UserError naming the model and the dataset when the model cannot train on
    data of this kind: see `FITS`; an encoder-only classifier needs classification data."""
    if kind not in FITS[cfg.architecture] or (
            cfg.architecture == "encoder_only" and kind == "text" and cfg.num_labels):
        what = (f"an encoder-only classifier, num_labels={cfg.num_labels}"
                if cfg.architecture == "encoder_only" and cfg.num_labels else cfg.architecture)
        raise UserError(f"model {name!r} ({what}) does not fit dataset {dataset!r} ({kind}): "
                         + FITS_TEXT)


def with_labels(cfg: models.TransformerConfig, name: str, labels: tuple[str, ...],
                dataset: str) -> models.TransformerConfig:
    """An encoder-only model set up for a classification dataset's `labels`: a masked-LM
    model (num_labels 0) becomes a classifier of them (a new head); a classifier must have
    as many labels as the data, and its own names (if any) fix the class order (the data's
    labels are mapped to them by name, see `train.data.pipeline.label_ids`).

    Raises:
        UserError: a label count that does not match num_labels, naming both.
    """
    if cfg.num_labels == 0:
        return cfg.replace(num_labels=len(labels), label_names=labels)
    if cfg.num_labels != len(labels):
        raise UserError(f"model {name!r} has num_labels={cfg.num_labels}, but dataset "
                         f"{dataset!r} has {len(labels)} labels {list(labels)[:10]}")
    return cfg if cfg.label_names else cfg.replace(label_names=labels)


def choose_model(config, vocab_size: int, kind: str = "", labels: tuple[str, ...] = ()
                 ) -> ModelChoice:
    """The run's model: `config.init_from`'s (with runtime overrides only: dtype, dropout,
    scan_layers, remat) or the preset's, checked against the dataset's `kind` (when given)
    and made a classifier of its `labels` (classification data; see `with_labels`). A
    directory's config is the one `models.load` gives: an encoder-decoder's start token
    (bos_id) is generation_config.json's decoder_start_token_id when it names one.

    Raises:
        UserError: an override that would change a loaded model's shapes, data longer than
            the loaded model's `max_len`, a tokenizer larger than its vocabulary, a model
            that does not fit the data, or a label count that differs from num_labels.
    """
    if not config.init_from:
        cfg = model_config(config, vocab_size)
        if kind == "classification" and cfg.architecture == "encoder_only":
            cfg = with_labels(cfg, config.model, labels, config.dataset)
        if kind:
            check_fits(cfg, config.model, config.dataset, kind)
        return ModelChoice(cfg)
    overrides = dict(config.model_overrides.to_dict()) if config.model_overrides else {}
    fixed = sorted(set(overrides) - RUNTIME_FIELDS)
    if fixed:
        raise UserError(f"model_overrides {fixed} would change the architecture of "
                         f"init_from={config.init_from!r}; only {sorted(RUNTIME_FIELDS)} "
                         "can be overridden when fine-tuning")
    family, cfg, hf = read_config(config.init_from, **{"dtype": config.dtype, **overrides})
    cfg, generation = with_generation(config.init_from, hf, cfg)
    if kind == "classification" and cfg.architecture == "encoder_only":
        cfg = with_labels(cfg, config.init_from, labels, config.dataset)
    if kind:
        check_fits(cfg, config.init_from, config.dataset, kind)
    need = max(config.max_source_length, config.max_target_length,
               config.max_decode_length + 1)
    if need > cfg.max_len:
        raise UserError(f"max_source_length / max_target_length / max_decode_length + 1 = "
                         f"{need} exceed the max_len {cfg.max_len} of {config.init_from}")
    if vocab_size > cfg.vocab_size:
        raise UserError(f"the tokenizer has {vocab_size} ids but the model in "
                         f"{config.init_from} only {cfg.vocab_size}")
    return ModelChoice(cfg, family.model_type, generation)
