"""The typed run config (`train.run_config`, `train.settings`, `train.config_checks`): the
parts are the one place where keys, defaults and rules live, `base_config()` is made from
them, each part checks itself when made, and the config is read once into frozen parts."""

import dataclasses
import json

import ml_collections
import pytest

from train import configs
from train.config_checks import Part, integer, setting
from train.configs._base import base_config
from train.run_config import PARTS, RULES, RunConfig
from train.settings import (
    CheckpointSettings,
    DataSettings,
    HostSettings,
    LoopSettings,
    ModelSettings,
    ObjectiveSettings,
    OptimizerSettings,
    ParallelSettings,
    ScheduledSampling,
)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "model_overrides":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def test_the_defaults_build_and_base_config_is_made_of_the_parts_fields():
    run = RunConfig()
    base = base_config().to_dict()
    # Every key has a rule, and no other (scheduled_sampling, lora, sequence, dpo: the dict
    # and each of its keys).
    assert set(_flat(base)) | {"scheduled_sampling", "lora", "sequence", "dpo",
                               "grpo"} == set(RULES)
    for name, part in PARTS.items():
        made = getattr(run, name)
        for field in dataclasses.fields(part):
            value = getattr(made, field.name)
            if isinstance(value, Part):             # scheduled_sampling: a part of its own
                assert base[field.name] == dataclasses.asdict(value)
            elif field.name == "model_overrides":
                assert base[field.name] == dict(value) == {}
            else:
                assert base[field.name] == value, field.name
    # Reading base_config() gives the defaults back: the two are one.
    read = RunConfig.from_config(base_config())
    assert {n: getattr(read, n) for n in PARTS} == {n: getattr(run, n) for n in PARTS}


def test_a_part_added_to_the_table_reaches_base_config_with_its_default(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Extra(Part):
        extra_steps: int = setting(7, integer(1))

    monkeypatch.setitem(PARTS, "extra", Extra)
    assert base_config().extra_steps == 7
    with pytest.raises(ValueError, match=r"^extra_steps=0 must be an int >= 1$"):
        Extra(extra_steps=0)


@pytest.mark.parametrize("make,message", [
    (lambda: LoopSettings(num_train_steps=-1), "num_train_steps=-1 must be an int >= 0"),
    (lambda: LoopSettings(max_train_seconds=-0.5),
     "max_train_seconds=-0.5 must be a number >= 0 (0: no limit)"),
    (lambda: CheckpointSettings(average_last_checkpoints=5),
     "average_last_checkpoints=5 is above keep_checkpoints=3"),
    (lambda: OptimizerSettings(lr_decay="linear"),
     "lr_decay='linear' must be one of 'rsqrt', 'cosine', 'constant'"),
    (lambda: OptimizerSettings(learning_rate=float("nan")),
     "learning_rate=nan must be a number > 0"),
    (lambda: ObjectiveSettings(mlm_random_fraction=0.3),
     "mlm_mask_fraction=0.8 plus mlm_random_fraction=0.3 is 1.1, above 1"),
    (lambda: ScheduledSampling(schedule="exponential", k=2.0),
     "scheduled_sampling.k=2.0 must be in (0, 1) for the exponential schedule"),
    (lambda: ScheduledSampling(enabled="yes"),
     "scheduled_sampling.enabled='yes' must be a bool (true or false)"),
    (lambda: HostSettings(process_id=1), "process_id=1 must be in [0, num_processes=1)"),
    (lambda: HostSettings(coordinator_address="host0"),
     "coordinator_address='host0' must be '' or host:port (port in [1, 65535])"),
    (lambda: ParallelSettings(mesh_shape=(1, -1, -1)),
     "mesh_shape=(1, -1, -1) must be three sizes (data, fsdp, tensor), each >= 1 or one of "
     "them -1"),
    (lambda: DataSettings(data_files="book.txt"),
     "data_files='book.txt' is only read by the local datasets (local_chat, "
     "local_classification, local_preference, local_prompts, local_speech, local_text, "
     "local_translation), not "
     "dataset='toy_translation'"),
    (lambda: ModelSettings(model="gpt-huge"), "model='gpt-huge' must be one of "),
    (lambda: ModelSettings(init_from="/no/such/model"),
     "init_from='/no/such/model' does not exist"),
])
def test_each_part_refuses_a_bad_value_when_made_naming_key_value_and_rule(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value).startswith(message), str(e.value)


def test_parts_are_frozen_and_keep_immutable_values():
    parallel = ParallelSettings(parallel="sharded", mesh_shape=[1, 4, 1],
                                logical_axis_rules=[["batch", ["data", "fsdp"]]])
    assert parallel.mesh_shape == (1, 4, 1)
    assert parallel.logical_axis_rules == (("batch", ("data", "fsdp")),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        parallel.parallel = "pmap"
    model = ModelSettings(model_overrides={"d_model": 64})
    with pytest.raises(TypeError):
        model.model_overrides["d_model"] = 32
    assert ModelSettings().model_overrides == {} and ParallelSettings().rules  # the defaults


def test_the_config_is_read_once_into_parts_and_kept_as_given_for_checkpoints():
    config = configs.get("default")
    config.scheduled_sampling.enabled = True
    run = RunConfig.from_config(config)
    assert run.optimizer.learning_rate == config.learning_rate == 3e-3
    assert run.objective.scheduled_sampling.enabled is True
    assert run.objective.masking.rate == config.mlm_rate
    assert run.model.model_overrides == config.model_overrides.to_dict()
    assert run.needed_max_len == max(config.max_source_length, config.max_target_length,
                                     config.max_decode_length + 1)
    assert json.loads(run.experiment) == json.loads(config.to_json())
    plain = RunConfig.from_config(config.to_dict())              # a plain mapping reads too
    assert plain.optimizer == run.optimizer and plain.data == run.data


def test_unknown_keys_are_refused_with_the_closest_known_one():
    config = configs.get("default").to_dict()
    config["scheduled_sampling"]["enabeld"] = True
    with pytest.raises(ValueError, match=r"^scheduled_sampling.enabeld=True is not a config "
                                         r"key .*; did you mean 'scheduled_sampling.enabled'\?$"):
        RunConfig.from_config(ml_collections.ConfigDict(config))
    config = configs.get("default").to_dict()
    config["warmup"] = 10
    with pytest.raises(ValueError, match=r"^warmup=10 is not a config key .*; did you mean "
                                         r"'warmup_steps'\?$"):
        RunConfig.from_config(config)


def test_rules_between_parts_are_checked_when_the_whole_is_made():
    with pytest.raises(ValueError, match=r"^vocab_size=100 must be >= 300 for "
                                         r"tokenizer='sentencepiece'"):
        RunConfig(data=DataSettings(vocab_size=100))
    RunConfig(data=DataSettings(vocab_size=100, tokenizer="byte"))
    with pytest.raises(ValueError, match=r"^model='gpt-tiny' \(model 'gpt-tiny' "
                                         r"\(decoder_only\) does not fit dataset "
                                         r"'toy_translation' \(translation\): "):
        RunConfig(model=ModelSettings(model="gpt-tiny"))
    with pytest.raises(ValueError, match=r"^scheduled_sampling.enabled=True needs a model "
                                         r"that predicts the next token; 'bert-tiny' is "
                                         r"encoder-only$"):
        RunConfig(model=ModelSettings(model="bert-tiny"),
                  data=DataSettings(dataset="toy_text"),
                  objective=ObjectiveSettings(
                      scheduled_sampling=ScheduledSampling(enabled=True)))
