"""The parts of the run config: each a frozen group of keys that checks itself when made
(`train.config_checks.Part`), every key declared once with its default and its rule.

    OptimizerSettings(learning_rate=3e-3, lr_decay="cosine")   # the rest at their defaults
    OptimizerSettings(lr_decay="linear")   # UserError: lr_decay='linear' must be one of ...

`train.run_config.RunConfig` holds one of each and reads them from an experiment config;
each part of the trainer takes the part it reads (the optimiser `OptimizerSettings`, the
wrappers `ParallelSettings`, ...). Rules between keys of one part are its `check`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from models.errors import UserError
from train.config_checks import (
    Part,
    Rule,
    address,
    axis_rules,
    boolean,
    choice,
    dataset_name,
    fail,
    float_dtype,
    frozen,
    integer,
    mapping,
    mesh_shape,
    model_name,
    number,
    setting,
    string,
    subpart,
)
from train.masking import Masking
from train.objectives.grpo_settings import GrpoSettings
from train.objectives.preference_settings import PreferenceSettings
from train.objectives.scheduled_sampling import ScheduledSampling
from train.objectives.sequence_settings import SequenceSettings

__all__ = ["BatchSettings", "CheckpointSettings", "DataSettings", "EvalSettings",
           "GrpoSettings", "HostSettings", "LoopSettings", "LoraSettings", "ModelSettings",
           "ObjectiveSettings", "OptimizerSettings", "ParallelSettings", "PreferenceSettings",
           "ScheduledSampling", "SequenceSettings"]

SPLITS = ("train", "validation", "test")
SPM_MODEL_TYPES = ("unigram", "bpe", "char", "word")


@dataclasses.dataclass(frozen=True)
class LoraSettings(Part):
    """The `lora.*` keys: low-rank adaptation of `init_from` (Hu et al. 2021). With
    `rank` > 0 the directory's weights stay frozen (in `base_dtype`) and only adapters
    beside the `targets` train, with optimiser state for them alone (`models.lora`).

    Attributes:
        rank: r of every adapter (0: no adapters, every weight trains).
        alpha: the update's scale is alpha / rank.
        dropout: dropout on the adapters' input while training.
        targets: comma-separated projections, "[[stack.]block.]name" (`models.lora`):
            query, key, value, out, gate, up, down; self_attention.query,
            cross_attention.value, decoder.mlp.down, ...
        base_dtype: the frozen weights' storage dtype (the compute dtype is `dtype`).
        base_quant: "int8" or "int4": the frozen base's projection kernels quantized
            (`models.quantize`; QLoRA, Dettmers et al. 2023, with our schemes); the
            adapters train in float over it and export in PEFT's layout, for the float
            base. "none" (default): as `base_dtype` stores them.
        base_quant_group: int4's inputs per scale.
        export_merged: the run's export also writes WORKDIR/model, the adapters merged
            into the weights (always: WORKDIR/adapter, in PEFT's layout).
    """

    prefix = "lora."
    rank: int = setting(0, integer(0))
    alpha: float = setting(16.0, number("> 0", lambda v: v > 0))
    dropout: float = setting(0.0, number("in [0, 1)", lambda v: 0 <= v < 1))
    targets: str = setting("query,value", Rule(
        "comma-separated projection names, such as 'query,value'",
        lambda v: isinstance(v, str) and bool(v.strip(", "))))
    base_dtype: str = setting("bfloat16", float_dtype())
    base_quant: str = setting("none", choice("none", "int8", "int4"))
    base_quant_group: int = setting(128, integer(2))
    export_merged: bool = setting(False, boolean())

    def check(self) -> None:
        self.adapters()           # the targets' names, checked before any data work

    def adapters(self):
        """The `models.lora.LoraConfig` these keys describe (None when rank is 0)."""
        if not self.rank:
            return None
        from models.lora import LoraConfig
        try:
            return LoraConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                              targets=self.targets)
        except UserError as e:
            raise fail("lora.targets", self.targets, f": {e}", "") from None


@dataclasses.dataclass(frozen=True)
class ModelSettings(Part):
    """What model the run trains: a preset from `models.list_configs()` with
    `model_overrides` (any `TransformerConfig` field; vocab_size comes from the tokenizer
    and max_len from the longest sequence), or a model directory to fine-tune.

    Attributes:
        init_from: a model directory (Hugging Face layout, or a run's WORKDIR/model) whose
            config, weights and tokenizer the run starts from; `model`, `tokenizer` and
            `vocab_size` are then unused and model_overrides may only set runtime fields
            (dtype, dropout, scan_layers, remat).
        dtype: the compute dtype; parameters stay float32.
        lora: low-rank adapters of `init_from` instead of training every weight
            (`LoraSettings`).
    """

    model: str = setting("transformer-tiny", model_name())
    model_overrides: Mapping[str, Any] = setting(
        {}, mapping("a dict of TransformerConfig fields"), convert=frozen)
    init_from: str = setting("", string())
    dtype: str = setting("float32", float_dtype())
    lora: LoraSettings = subpart(
        LoraSettings, "a dict of rank, alpha, dropout, targets, base_dtype, base_quant, "
        "base_quant_group, export_merged")

    @property
    def name(self) -> str:
        """How messages name the model: the directory, or the preset."""
        return self.init_from or self.model

    def check(self) -> None:
        """init_from: a model directory whose config reads, and overrides that keep its
        architecture; refused by name before any data work."""
        path = self.init_from
        if self.lora.rank and not path:
            raise fail("lora.rank", self.lora.rank, "adapts a trained model: set init_from "
                       "to its directory (low-rank adapters beside random weights learn "
                       "nothing the model could not)")
        if not path:
            return
        if not os.path.isdir(path):
            raise fail("init_from", path, "does not exist" if not os.path.exists(path)
                       else "is not a directory (a model directory with config.json)")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise fail("init_from", path, "must be a model directory with config.json; it "
                       "has none")
        from models.pretrained import RUNTIME_FIELDS, read_config
        fixed = sorted(set(self.model_overrides) - RUNTIME_FIELDS)
        if fixed:
            raise fail("model_overrides", self.model_overrides,
                       f"may only set {sorted(RUNTIME_FIELDS)} when fine-tuning init_from="
                       f"{path!r}; {fixed} would change its architecture", ": ")
        try:
            read_config(path)
        except (ValueError, FileNotFoundError) as e:
            raise UserError(f"init_from={path!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class DataSettings(Part):
    """The dataset, its tokenizer and how examples become rows.

    Attributes:
        data_files: comma-separated paths, read by the local_* datasets only.
        data_dir: the TFDS data dir ("" = TFDS's default).
        tokenizer: "sentencepiece" (trained on the training split, `vocab_size` pieces of
            `spm_model_type`) or "byte".
        tokenizer_from: "", or a model directory whose tokenizer the run takes instead of
            making one (a draft for speculative decoding shares its model's tokens so).
        source_lang / target_lang: "", or a language code of a translation model's
            tokenizer (NLLB-200's eng_Latn, M2M-100's en, mBART-50's en_XX): sources and
            targets encoded with those languages' tokens as transformers' tokenizer
            encodes them with src_lang / tgt_lang, and the target's token forced first
            when the run decodes and in the export's generation_config.json.
        max_source_length / max_target_length: row widths, EOS included.
        overlong: translation examples longer than a row: "drop" or "truncate".
        data_workers: grain worker processes (0: threads only).
        eval_split / test_split: the splits evaluated during and after training.
    """

    dataset: str = setting("toy_translation", dataset_name())
    data_files: str = setting("", Rule("a string of comma-separated paths",
                                       lambda v: isinstance(v, str)))
    data_dir: str = setting("", string())
    reverse_translation: bool = setting(False, boolean())
    tokenizer: str = setting("sentencepiece", choice("sentencepiece", "byte"))
    tokenizer_from: str = setting("", string())
    source_lang: str = setting("", string())
    target_lang: str = setting("", string())
    vocab_size: int = setting(1024, integer(1))
    spm_model_type: str = setting("unigram", choice(*SPM_MODEL_TYPES))
    max_source_length: int = setting(64, integer(2))
    max_target_length: int = setting(64, integer(2))
    packing: bool = setting(True, boolean())
    overlong: str = setting("drop", choice("drop", "truncate"))
    data_workers: int = setting(0, integer(0))
    eval_split: str = setting("validation", choice(*SPLITS))
    test_split: str = setting("test", choice(*SPLITS))

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(p for p in self.data_files.split(",") if p)

    @property
    def kind(self) -> str:
        """The dataset's kind (a `train.data.kinds` name), from the dataset tables (no data
        is read)."""
        from train.data import dataset_kind
        return dataset_kind(self.dataset)

    def check(self) -> None:
        self._check_files()
        if self.tokenizer_from and not os.path.isdir(self.tokenizer_from):
            raise fail("tokenizer_from", self.tokenizer_from,
                       "is not a directory (a model directory with tokenizer files)")
        path = os.path.expanduser(self.data_dir)
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise fail("data_dir", self.data_dir, "is a file, not a directory")
        from train.data import kinds
        if self.reverse_translation and not kinds.get(self.kind).reversible:
            raise fail("reverse_translation", True,
                       f"needs a translation dataset; {self.dataset!r} is {self.kind}")
        for key in ("source_lang", "target_lang"):
            if getattr(self, key) and self.kind != "translation":
                raise fail(key, getattr(self, key), f"names a language of translation data; "
                           f"{self.dataset!r} is {self.kind}")

    def _check_files(self) -> None:
        """data_files: required by (and only read by) the local datasets; each a file."""
        from train.data import builders
        value, dataset, files = self.data_files, self.dataset, self.files
        if dataset not in builders.LOCAL:
            if files:
                raise fail("data_files", value, f"is only read by the local datasets "
                           f"({', '.join(sorted(builders.LOCAL))}), not dataset={dataset!r}")
            return
        if not files:
            raise fail("data_files", value, f"must name one or more files (comma-separated) "
                       f"for dataset={dataset!r}")
        for path in files:
            if os.path.isdir(path):
                raise fail("data_files", value, f"{path!r} is a directory, not a file", ": ")
            if not os.path.isfile(path):
                raise fail("data_files", value, f"{path!r} does not exist", ": ")
        try:
            builders.LOCAL[dataset].sources(files)      # how the files pair and split
        except ValueError as e:
            raise fail("data_files", value, str(e), ": ") from None


@dataclasses.dataclass(frozen=True)
class BatchSettings(Part):
    """Rows per device per step: training and evaluation (global = rows x devices)."""

    per_device_batch_size: int = setting(32, integer(1))
    eval_per_device_batch_size: int = setting(64, integer(1))


@dataclasses.dataclass(frozen=True)
class OptimizerSettings(Part):
    """adamw behind global-norm clipping (0: none), warmup then `lr_decay` (rsqrt, cosine
    or constant), and `grad_accum_steps` micro-batches per update (optax.MultiSteps)."""

    learning_rate: float = setting(2e-3, number("> 0", lambda v: v > 0))
    warmup_steps: int = setting(200, integer(0))
    lr_decay: str = setting("rsqrt", choice("rsqrt", "cosine", "constant"))
    adam_b1: float = setting(0.9, number("in [0, 1)", lambda v: 0 <= v < 1))
    adam_b2: float = setting(0.98, number("in [0, 1)", lambda v: 0 <= v < 1))
    adam_eps: float = setting(1e-9, number("> 0", lambda v: v > 0))
    weight_decay: float = setting(0.0, number(">= 0", lambda v: v >= 0))
    grad_clip_norm: float = setting(1.0, number(">= 0 (0: no clipping)", lambda v: v >= 0))
    grad_accum_steps: int = setting(1, integer(1))


@dataclasses.dataclass(frozen=True)
class ObjectiveSettings(Part):
    """What the objectives read (`train.objectives`): the loss's label smoothing and
    z-loss, and `loss_chunks` (0: the head makes the whole [B, T, V] logits; N: the head
    and the loss run over N slices of the sequence and recompute them in the backward
    pass, `train.chunked_loss`; next-token prediction and masked LM); masked LM's
    corruption (of the real, non-special tokens, `mlm_rate` are chosen;
    of those `mlm_mask_fraction` become the mask token, `mlm_random_fraction` a random one,
    the rest stay: BERT's 15% and 80/10/10); next-token prediction's scheduled sampling;
    sequence-level training (`sequence.*`: minimum risk training or self-critical
    REINFORCE, `train.objectives.sequence`); speech recognition's decoder prompt
    (`language`, `task`: "" is the checkpoint's generation_config.json default) and
    `freeze_encoder` (a Whisper's audio encoder, its convolutional front end included,
    gets no updates and no optimiser state; `train.objectives.speech`); preference
    training's loss and strength (`dpo.*`: DPO, IPO or SimPO,
    `train.objectives.preference`); GRPO's group, sampling, clip, KL and rewards (`grpo.*`,
    `train.objectives.grpo`); chat data's template (`chat_template`: a Jinja file
    instead of the model directory's own)."""

    label_smoothing: float = setting(0.1, number("in [0, 1)", lambda v: 0 <= v < 1))
    z_loss: float = setting(0.0, number(">= 0", lambda v: v >= 0))
    loss_chunks: int = setting(0, integer(0))
    mlm_rate: float = setting(Masking.rate, number("in (0, 1]", lambda v: 0 < v <= 1))
    mlm_mask_fraction: float = setting(Masking.mask_fraction,
                                       number("in [0, 1]", lambda v: 0 <= v <= 1))
    mlm_random_fraction: float = setting(Masking.random_fraction,
                                         number("in [0, 1]", lambda v: 0 <= v <= 1))
    scheduled_sampling: ScheduledSampling = subpart(
        ScheduledSampling, "a dict of enabled, schedule, max_rate, ramp_steps, k")
    sequence: SequenceSettings = subpart(
        SequenceSettings, "a dict of objective, candidates, alpha, reward, include_gold, "
        "sampling, temperature, top_k, max_new_tokens, loss_weight")
    dpo: PreferenceSettings = subpart(PreferenceSettings, "a dict of loss, beta, simpo_gamma")
    grpo: GrpoSettings = subpart(
        GrpoSettings, "a dict of num_generations, max_new_tokens, temperature, top_k, beta, "
        "epsilon, epsilon_high, loss, reward")
    chat_template: str = setting("", Rule(
        "'' (the model directory's own) or the path of a Jinja chat template file",
        lambda v: isinstance(v, str)))
    language: str = setting("", Rule(
        "'' (the checkpoint's default) or a language code or token, such as 'en' or "
        "'<|en|>'", lambda v: isinstance(v, str) and v == v.strip()))
    task: str = setting("", choice("", "transcribe", "translate"))
    freeze_encoder: bool = setting(False, boolean())

    def check(self) -> None:
        total = self.mlm_mask_fraction + self.mlm_random_fraction
        if total > 1:
            raise fail("mlm_mask_fraction", self.mlm_mask_fraction,
                       f"plus mlm_random_fraction={self.mlm_random_fraction} is {total:g}, "
                       "above 1")

    @property
    def masking(self) -> Masking:
        return Masking(self.mlm_rate, self.mlm_mask_fraction, self.mlm_random_fraction)


@dataclasses.dataclass(frozen=True)
class ParallelSettings(Part):
    """How the steps run over devices (`train.wrapper`): `pmap`, `shard_map`, or
    `sharded` over a (data, fsdp, tensor) `mesh_shape` (-1: the devices the others leave;
    FSDP over all by default) with `logical_axis_rules` (() = `models.axes.DEFAULT_RULES`;
    see the README's "Sharded training")."""

    parallel: str = setting("pmap", choice("pmap", "shard_map", "sharded"))
    mesh_shape: tuple[int, int, int] = setting((1, -1, 1), mesh_shape(),
                                               convert=lambda v: tuple(int(s) for s in v))
    logical_axis_rules: tuple = setting((), axis_rules(), convert=frozen)
    # The mesh's expert axis (`sharded` only): a mixture of experts' experts, and the batch,
    # split over this many devices beside mesh_shape's (data, fsdp, tensor).
    mesh_expert: int = setting(1, integer(1))

    @property
    def rules(self) -> tuple:
        from models.axes import DEFAULT_RULES
        return tuple(self.logical_axis_rules) or DEFAULT_RULES


@dataclasses.dataclass(frozen=True)
class HostSettings(Part):
    """Several hosts: `jax.distributed.initialize()` when `distributed`; the other three
    only with a coordinator address (host:port of process 0; "" = let JAX detect the
    cluster: TPU pod, SLURM, Open MPI, Kubernetes). `compile_cache`: `python -m train`
    keeps compiled executables in JAX's persistent compilation cache
    (`models.use_compile_cache`), so a restarted run does not compile them again."""

    distributed: bool = setting(False, boolean())
    coordinator_address: str = setting("", address())
    num_processes: int = setting(1, integer(1))
    process_id: int = setting(0, integer(0))
    compile_cache: bool = setting(True, boolean())

    def check(self) -> None:
        if self.process_id >= self.num_processes:
            raise fail("process_id", self.process_id,
                       f"must be in [0, num_processes={self.num_processes})")


@dataclasses.dataclass(frozen=True)
class CheckpointSettings(Part):
    """A checkpoint every `checkpoint_every_steps` (and at the end); the newest
    `keep_checkpoints` are kept. The model a run evaluates at its end and exports is the
    mean of the parameters of its newest `average_last_checkpoints` checkpoints (1: the
    last state alone; `train.checkpoint_average`); the checkpoints themselves, which a
    resumed run continues from, stay as trained."""

    checkpoint_every_steps: int = setting(500, integer(1))
    keep_checkpoints: int = setting(3, integer(1))
    average_last_checkpoints: int = setting(1, integer(1))

    def check(self) -> None:
        if self.average_last_checkpoints > self.keep_checkpoints:
            raise fail("average_last_checkpoints", self.average_last_checkpoints,
                       f"is above keep_checkpoints={self.keep_checkpoints}: only the newest "
                       "keep_checkpoints checkpoints are kept to average")


@dataclasses.dataclass(frozen=True)
class LoopSettings(Part):
    """The loop: its length (`num_train_steps`, and at most `max_train_seconds` of wall
    clock from the first step of each invocation: 0 is no limit), how often it logs and
    evaluates, and the seed of everything random (initialisation, dropout, masks,
    shuffling)."""

    num_train_steps: int = setting(1000, integer(0))
    max_train_seconds: float = setting(0.0, number(">= 0 (0: no limit)", lambda v: v >= 0))
    log_every_steps: int = setting(50, integer(1))
    eval_every_steps: int = setting(500, integer(1))
    seed: int = setting(0, integer(0))


@dataclasses.dataclass(frozen=True)
class EvalSettings(Part):
    """What an evaluation decodes and how it scores it.

    Attributes:
        num_eval_decode: validation examples decoded at each evaluation.
        num_test_decode: test examples decoded at the end (0 = none).
        beam_size / length_penalty: beam search's (GNMT's alpha: ((5 + length) / 6) **
            alpha). Fine-tuning (init_from), decoded evaluations follow the directory's
            generation_config.json (beams, length penalty, forced and banned ids, end ids);
            beam_size is used only when it names no beam count, length_penalty never.
        max_decode_length: new tokens per decoded example (and a bound on the model's
            max_len).
        show_examples: (source, reference, hypothesis) triples printed per evaluation.
        metric: exact_match, bleu or both.
    """

    num_eval_decode: int = setting(200, integer(0))
    num_test_decode: int = setting(1000, integer(0))
    beam_size: int = setting(4, integer(1))
    length_penalty: float = setting(0.6, number(">= 0", lambda v: v >= 0))
    max_decode_length: int = setting(64, integer(1))
    show_examples: int = setting(3, integer(0))
    metric: str = setting("exact_match", choice("exact_match", "bleu", "both"))
