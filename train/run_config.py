"""The run config, read once at the edge: an ml_collections `ConfigDict` in, frozen typed
parts out, each checked when it is made.

    run = RunConfig.from_config(configs.get("default"))   # or a UserError naming the key
    run.optimizer.learning_rate, run.data.dataset, run.parallel.mesh_shape, ...
    base_config()                                         # every key with its default

Every key is declared once, as a field of one part (`train.settings`) with its default and
its rule (`train.config_checks.setting`); `base_config()` (which every file in
`train/configs/` starts from) is made from those fields, so the keys, their defaults and
their rules cannot drift apart. Rules between keys of one part live with that part
(`Part.check`); the two that span parts (the tokenizer's size, and the model fitting the
dataset) are `RunConfig.check`'s. Each part of the trainer receives the part it reads:
the optimiser `OptimizerSettings`, the wrappers `ParallelSettings`, the pipeline
`DataSettings` and `BatchSettings`, the objective `ObjectiveSettings`, evaluation
`EvalSettings`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from typing import Any

import ml_collections

from train.config_checks import Part, fail
from train.settings import (
    BatchSettings,
    CheckpointSettings,
    DataSettings,
    EvalSettings,
    HostSettings,
    LoopSettings,
    ModelSettings,
    ObjectiveSettings,
    OptimizerSettings,
    ParallelSettings,
)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every part of a run's config, checked (see the module docstring). The parts are
    read in the order of these fields (a mistake in an earlier one is reported first).

    Attributes:
        model, data, batch, optimizer, objective, parallel, hosts, checkpoints, loop,
            evaluation: the parts (`PARTS`).
        experiment: the config as given, as JSON (what checkpoints keep of it).
    """

    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    batch: BatchSettings = dataclasses.field(default_factory=BatchSettings)
    optimizer: OptimizerSettings = dataclasses.field(default_factory=OptimizerSettings)
    objective: ObjectiveSettings = dataclasses.field(default_factory=ObjectiveSettings)
    parallel: ParallelSettings = dataclasses.field(default_factory=ParallelSettings)
    hosts: HostSettings = dataclasses.field(default_factory=HostSettings)
    checkpoints: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
    loop: LoopSettings = dataclasses.field(default_factory=LoopSettings)
    evaluation: EvalSettings = dataclasses.field(default_factory=EvalSettings)
    experiment: str = "{}"

    def __post_init__(self):
        self.check()

    @classmethod
    def from_config(cls, config) -> RunConfig:
        """The typed parts of an experiment config; reads no data and builds nothing.

        Args:
            config: an `ml_collections.ConfigDict` (or a plain mapping) with the keys of
                `base_config()`.

        Raises:
            UserError: an unknown key (with the closest known one), a missing key, or a
                value that breaks its rule, naming the key, the value and the rule (the
                first one found).
        """
        if hasattr(config, "to_dict"):
            values, experiment = config.to_dict(), config.to_json()
        else:
            values = dict(config)
            experiment = json.dumps(values, sort_keys=True, default=str)
        _refuse_unknown(values)
        parts = {name: part.from_mapping(values) for name, part in PARTS.items()}
        return cls(**parts, experiment=experiment)

    @property
    def needed_max_len(self) -> int:
        """The positions the run's longest sequence needs: the rows, and a decoded output
        (or a sequence-level candidate) behind its start token."""
        from train.data import kinds
        sequence = self.objective.sequence
        candidate = sequence.max_new_tokens + 1 if sequence.enabled else 0
        # A preference pair's response is read behind its prompt (the prompt's EOS dropped).
        joined = (self.data.max_source_length + self.data.max_target_length - 1
                  if self.data.kind == kinds.PREFERENCE.name else
                  self.data.max_source_length + self.objective.grpo.max_new_tokens
                  if self.data.kind == kinds.PROMPTS.name else 0)
        return max(self.data.max_source_length, self.data.max_target_length,
                   self.evaluation.max_decode_length + 1, candidate, joined)

    def check(self) -> None:
        """The rules between parts: the tokenizer's size, one example per row for
        sequence-level training, and a model (the preset with its overrides) that builds
        and has an objective for the dataset's kind.

        Raises:
            UserError: naming the key, its value and the rule.
        """
        from train.data.tokenizer import MIN_SENTENCEPIECE_VOCAB
        model, data = self.model, self.data
        if (not model.init_from and data.tokenizer == "sentencepiece"
                and data.vocab_size < MIN_SENTENCEPIECE_VOCAB):
            raise fail("vocab_size", data.vocab_size,
                       f"must be >= {MIN_SENTENCEPIECE_VOCAB} for tokenizer='sentencepiece' "
                       "(256 byte-fallback pieces and the specials); use tokenizer='byte' "
                       "for fewer ids")
        if self.objective.sequence.enabled and data.packing:
            raise fail("packing", True, f"must be False for sequence.objective="
                       f"{self.objective.sequence.objective!r}: each row's source draws "
                       "candidates against its one reference")
        if (self.objective.sequence.enabled and self.objective.sequence.sampling == "beam"
                and self.parallel.parallel == "shard_map"):
            raise fail("sequence.sampling", "beam", "runs beam search inside the train step, "
                       "which parallel='shard_map' cannot trace (its loop's carry does not "
                       "vary over the devices); use parallel='pmap' or 'sharded'")
        self._check_speech()
        self._check_preference()
        if not model.init_from:     # a directory's own config was read by ModelSettings
            self._check_preset()

    def _check_speech(self) -> None:
        """Speech data hold one clip a row; the speech keys are read with speech data only."""
        from train.data import kinds
        objective, data = self.objective, self.data
        if kinds.get(data.kind).audio:
            if data.packing:
                raise fail("packing", True, f"must be False for dataset={data.dataset!r}: "
                           "each row holds one clip's features")
            return
        for key, unset in (("freeze_encoder", False), ("language", ""), ("task", "")):
            if getattr(objective, key) != unset:
                raise fail(key, getattr(objective, key), "is read by speech recognition "
                           f"only (dataset='local_speech'), not dataset={data.dataset!r}")

    def _check_preference(self) -> None:
        """A preference pair, or a GRPO prompt, is one row; the `dpo.*` and `grpo.*` keys
        are read with their data only."""
        from train.data import kinds
        data = self.data
        for kind, part, what, names in (
                (kinds.PREFERENCE, "dpo", "one prompt with its two responses",
                 "'local_preference' or 'addition_preference'"),
                (kinds.PROMPTS, "grpo", "one prompt, whose completions are drawn",
                 "'local_prompts' or 'addition_prompts'")):
            settings = getattr(self.objective, part)
            if data.kind == kind.name:
                if data.packing:
                    raise fail("packing", True, f"must be False for dataset="
                               f"{data.dataset!r}: each row holds {what}")
                continue
            for field in dataclasses.fields(settings):
                if getattr(settings, field.name) != field.default:
                    raise fail(f"{part}.{field.name}", getattr(settings, field.name),
                               f"is read with {kind.name} data only (dataset={names}), "
                               f"not dataset={data.dataset!r}")

    def _check_preset(self) -> None:
        from models.config import check_keys
        from models.tokenizer import ByteTokenizer
        from train.model_config import preset_config
        from train.objectives import registry
        model, data = self.model, self.data
        overrides = dict(model.model_overrides)
        try:
            check_keys(overrides)
            # The tokenizer's size is known only later; the rules it enters (special ids
            # below it) hold for both of ours.
            vocab = (data.vocab_size if data.tokenizer == "sentencepiece"
                     else ByteTokenizer().vocab_size)
            cfg = preset_config(model, vocab, max_len=self.needed_max_len)
        except (ValueError, TypeError) as e:
            raise fail("model_overrides", overrides, f"{e} (model={model.model!r})",
                       ": ") from None
        try:
            entry = registry.entry_for(cfg, data.kind, model_name=model.model,
                                       dataset_name=data.dataset,
                                       sequence_level=self.objective.sequence.enabled)
        except ValueError as e:
            raise fail("model", model.model, f"({e})") from None
        entry.objective.check_settings(self.objective, cfg, model_name=model.model)


# {attribute of RunConfig: its part's class}: every part, in the order the config is read.
PARTS: dict[str, type[Part]] = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)
                                if f.default_factory is not dataclasses.MISSING}
RULES = {key: rule for part in PARTS.values() for key, rule in part.key_rules().items()}


def _nested() -> dict[str, type[Part]]:
    return {name: sub for part in PARTS.values() for name, sub in part.nested().items()}


def _refuse_unknown(values: Mapping[str, Any]) -> None:
    """Refuses a key no part declares, naming the closest known one."""
    nested = _nested()
    given = {}
    for key, value in values.items():
        given[key] = value
        if key in nested and isinstance(value, Mapping):
            given.update({f"{key}.{k}": v for k, v in value.items()})
    for key, value in given.items():
        if key not in RULES:
            near = difflib.get_close_matches(key, list(RULES), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise fail(key, value, "is not a config key (the keys are those of "
                       f"train/configs/_base.py){hint}")


def base_config() -> ml_collections.ConfigDict:
    """Every key with its default, made from the parts' fields: what each config file in
    `train/configs/` starts from."""
    def config_dict(defaults: dict) -> ml_collections.ConfigDict:
        c = ml_collections.ConfigDict()
        for key, value in defaults.items():
            c[key] = config_dict(dict(value)) if isinstance(value, Mapping) else value
        return c

    return config_dict({k: v for part in PARTS.values() for k, v in part.defaults().items()})


def check_config(config) -> RunConfig:
    """`RunConfig.from_config(config)`: every value of an experiment config checked."""
    return RunConfig.from_config(config)
