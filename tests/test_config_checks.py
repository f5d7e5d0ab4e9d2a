"""The run config (`train.run_config`): every key of train/configs/_base.py has a rule, and
each broken rule is an error naming the key, the value and the rule, found before any data
is prepared."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import pytest

import models
from train import configs
from train.configs._base import base_config
from train.run_config import RULES, check_config


def _config(name="default", **changes):
    """`name`'s config with `changes` ("a.b" for nested keys), past ConfigDict's type checks."""
    d = configs.get(name).to_dict()
    for key, value in changes.items():
        *outer, last = key.split(".")
        node = d
        for k in outer:
            node = node[k]
        node[last] = value
    return ml_collections.ConfigDict(d)


def _error(config) -> str:
    with pytest.raises(ValueError) as e:
        check_config(config)
    return str(e.value)


def test_every_key_of_the_base_config_has_a_rule():
    base = base_config().to_dict()
    keys = set(base) | {f"{part}.{k}" for part in ("scheduled_sampling", "lora", "sequence",
                                                    "dpo", "grpo")
                        for k in base[part]}
    assert set(RULES) == keys


@pytest.mark.parametrize("name", configs.names())
def test_the_shipped_configs_pass(name, tmp_path):
    config = configs.get(name)
    if name == "finetune_lora":       # adapters of the user's model directory
        assert _error(config).startswith("lora.rank=16 adapts a trained model: set init_from")
    elif name.startswith("finetune_") or name == "translate_small":  # the user's files
        assert _error(config) == ("data_files='' must name one or more files "
                                  f"(comma-separated) for dataset={config.dataset!r}")
        if name == "translate_small":     # needs nothing else
            (tmp_path / "pairs.tsv").write_text("Open\tÖffnen\n")
            config.data_files = str(tmp_path / "pairs.tsv")
            check_config(config)
    elif name == "draft":             # it reads the default run's model directory
        config.tokenizer_from = str(tmp_path / "absent")
        assert _error(config) == (f"tokenizer_from={config.tokenizer_from!r} is not a "
                                  "directory (a model directory with tokenizer files)")
        config.tokenizer_from = str(tmp_path)
        check_config(config)
    else:
        check_config(config)


# (key, bad value, the rule the message states). Each message is "key=repr(value) <rule>".
CASES = [
    ("num_train_steps", -1, "must be an int >= 0"),
    ("num_train_steps", 2.5, "must be an int >= 0"),
    ("num_train_steps", True, "must be an int >= 0"),
    ("log_every_steps", 0, "must be an int >= 1"),
    ("eval_every_steps", 0, "must be an int >= 1"),
    ("checkpoint_every_steps", -5, "must be an int >= 1"),
    ("keep_checkpoints", 0, "must be an int >= 1"),
    ("average_last_checkpoints", 0, "must be an int >= 1"),
    ("average_last_checkpoints", 4, "is above keep_checkpoints=3"),
    ("max_train_seconds", -1, "must be a number >= 0 (0: no limit)"),
    ("max_train_seconds", "6m", "must be a number >= 0 (0: no limit)"),
    ("learning_rate", 0.0, "must be a number > 0"),
    ("learning_rate", -1e-3, "must be a number > 0"),
    ("learning_rate", "fast", "must be a number > 0"),
    ("learning_rate", float("nan"), "must be a number > 0"),
    ("warmup_steps", -1, "must be an int >= 0"),
    ("label_smoothing", 1.0, "must be a number in [0, 1)"),
    ("label_smoothing", -0.1, "must be a number in [0, 1)"),
    ("per_device_batch_size", 0, "must be an int >= 1"),
    ("eval_per_device_batch_size", 0, "must be an int >= 1"),
    ("grad_accum_steps", 0, "must be an int >= 1"),
    ("max_source_length", 1, "must be an int >= 2"),
    ("max_target_length", "64", "must be an int >= 2"),
    ("max_decode_length", 0, "must be an int >= 1"),
    ("lr_decay", "linear", "must be one of 'rsqrt', 'cosine', 'constant'"),
    ("tokenizer", "bpe", "must be one of 'sentencepiece', 'byte'"),
    ("parallel", "jit", "must be one of 'pmap', 'shard_map'"),
    ("metric", "rouge", "must be one of 'exact_match', 'bleu', 'both'"),
    ("overlong", "clip", "must be one of 'drop', 'truncate'"),
    ("spm_model_type", "wordpiece", "must be one of 'unigram', 'bpe', 'char', 'word'"),
    ("eval_split", "dev", "must be one of 'train', 'validation', 'test'"),
    ("test_split", 3, "must be one of 'train', 'validation', 'test'"),
    ("dataset", "wmt99", "must be one of "),
    ("dataset", 5, "must be one of "),
    ("model", "gpt-huge", "must be one of "),
    ("dtype", "int8", "must be a float dtype name"),
    ("dtype", "bf16", "must be a float dtype name"),
    ("scheduled_sampling.schedule", "cosine",
     "must be one of 'linear', 'exponential', 'inverse_sigmoid'"),
    ("scheduled_sampling.enabled", "yes", "must be a bool"),
    ("scheduled_sampling.max_rate", 1.5, "must be a number in [0, 1]"),
    ("scheduled_sampling.ramp_steps", 0, "must be an int >= 1"),
    ("scheduled_sampling.k", 0.0, "must be a number > 0"),
    ("sequence.objective", "rl", "must be one of 'none', 'mrt', 'scst'"),
    ("sequence.candidates", 0, "must be an int >= 1"),
    ("sequence.alpha", 0.0, "must be a number > 0"),
    ("sequence.reward", "rouge", "must be 'bleu', 'chrf' or 'module:function'"),
    ("sequence.sampling", "nucleus", "must be one of 'sample', 'beam'"),
    ("sequence.max_new_tokens", 0, "must be an int >= 1"),
    ("sequence.loss_weight", 2.0, "must be a number in [0, 1]"),
    ("sequence", "mrt", "must be a dict of objective, candidates"),
    ("packing", "no", "must be a bool"),
    ("reverse_translation", 1, "must be a bool"),
    ("distributed", "true", "must be a bool"),
    ("vocab_size", 0, "must be an int >= 1"),
    ("vocab_size", 100, "must be >= 300 for tokenizer='sentencepiece'"),
    ("data_workers", -1, "must be an int >= 0"),
    ("adam_b1", 1.0, "must be a number in [0, 1)"),
    ("adam_b2", -0.5, "must be a number in [0, 1)"),
    ("adam_eps", 0.0, "must be a number > 0"),
    ("weight_decay", -0.1, "must be a number >= 0"),
    ("grad_clip_norm", -1.0, "must be a number >= 0"),
    ("z_loss", -1e-4, "must be a number >= 0"),
    ("seed", -1, "must be an int >= 0"),
    ("num_eval_decode", -1, "must be an int >= 0"),
    ("num_test_decode", -1, "must be an int >= 0"),
    ("beam_size", 0, "must be an int >= 1"),
    ("length_penalty", -0.6, "must be a number >= 0"),
    ("show_examples", -1, "must be an int >= 0"),
    ("coordinator_address", "host0", "must be '' or host:port"),
    ("coordinator_address", "host0:99999", "must be '' or host:port"),
    ("num_processes", 0, "must be an int >= 1"),
    ("mesh_expert", 0, "must be an int >= 1"),
    ("process_id", -1, "must be an int >= 0"),
    ("process_id", 1, "must be in [0, num_processes=1)"),
    ("data_files", 7, "must be a string of comma-separated paths"),
    ("data_files", "book.txt", "is only read by the local datasets"),
    ("data_dir", 0, "must be a string"),
    ("init_from", None, "must be a string"),
    ("init_from", "/no/such/model", "does not exist"),
    ("model_overrides", "d_model=64", "must be a dict of TransformerConfig fields"),
    ("model_overrides", {"d_model": "64"}, "TransformerConfig.d_model='64' must be a positive int"),
    ("model_overrides", {"use_bias": "no"}, "TransformerConfig.use_bias='no' must be bool"),
    ("model_overrides", {"d_modle": 64}, "unknown TransformerConfig field(s) ['d_modle']"),
    ("model_overrides", {"num_heads": 3}, "is not divisible by num_heads=3"),
    ("model", "gpt-tiny", "does not fit dataset 'toy_translation' (translation)"),
    ("reverse_translation", True, "needs a translation dataset"),
    ("scheduled_sampling", "on", "must be a dict of enabled, schedule"),
]


@pytest.mark.parametrize("key,value,rule", CASES, ids=[f"{k}={v!r}" for k, v, _ in CASES])
def test_each_broken_rule_names_key_value_and_rule(key, value, rule):
    changes = {key: value}
    if key == "reverse_translation" and value is True:
        changes.update(dataset="tiny_shakespeare", model="gpt-tiny")   # a text dataset
    message = _error(_config(**changes))
    assert message.startswith(f"{key}={value!r}"), message
    assert rule in message, message


def test_schedule_parameters_follow_the_chosen_schedule():
    assert _error(_config(**{"scheduled_sampling.schedule": "exponential",
                             "scheduled_sampling.k": 2.0})) == (
        "scheduled_sampling.k=2.0 must be in (0, 1) for the exponential schedule")
    assert _error(_config(**{"scheduled_sampling.schedule": "inverse_sigmoid",
                             "scheduled_sampling.k": 0.999})) == (
        "scheduled_sampling.k=0.999 must be >= 1 for the inverse_sigmoid schedule")
    check_config(_config(**{"scheduled_sampling.schedule": "inverse_sigmoid",
                            "scheduled_sampling.k": 5.0}))


def test_unknown_and_missing_keys_are_named():
    config = _config(num_train_step=5)
    assert _error(config) == ("num_train_step=5 is not a config key (the keys are those of "
                              "train/configs/_base.py); did you mean 'num_train_steps'?")
    config = configs.get("default")
    del config["keep_checkpoints"]
    assert "the config has no key 'keep_checkpoints'" in _error(config)


def test_data_files_must_be_files_that_exist(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("a line\n")
    text = dict(dataset="local_text", model="gpt-tiny")
    check_config(_config(data_files=str(book), **text))
    assert _error(_config(data_files=str(tmp_path), **text)) == (
        f"data_files={str(tmp_path)!r}: {str(tmp_path)!r} is a directory, not a file")
    files = f"{book},{tmp_path / 'gone.txt'}"
    assert _error(_config(data_files=files, **text)) == (
        f"data_files={files!r}: {str(tmp_path / 'gone.txt')!r} does not exist")
    assert _error(_config(data_files="", **text)) == (
        "data_files='' must name one or more files (comma-separated) for "
        "dataset='local_text'")
    four = ",".join([str(book)] * 4)
    assert "got 4 data sources" in _error(_config(data_files=four, **text))
    src = tmp_path / "a.en"
    src.write_text("one\n")
    message = _error(_config(dataset="local_translation", data_files=str(src)))
    assert message.startswith(f"data_files={str(src)!r}: ") and "needs a line-aligned" in message
    assert _error(_config(data_dir=str(book))) == (
        f"data_dir={str(book)!r} is a file, not a directory")


def test_init_from_must_be_a_model_directory(tmp_path):
    assert _error(_config(init_from=str(tmp_path), model_overrides={})) == (
        f"init_from={str(tmp_path)!r} must be a model directory with config.json; it has none")
    (tmp_path / "config.json").write_text("{}")            # its config is read, too
    assert _error(_config(init_from=str(tmp_path), model_overrides={})) == (
        f"init_from={str(tmp_path)!r}: {tmp_path}: model_type None is not supported; "
        f"supported: {', '.join(sorted(models.pretrained.FAMILIES))}")
    models.save(str(tmp_path), models.get_config("gpt-tiny", num_layers=1),
                jax.jit(models.build(models.get_config("gpt-tiny", num_layers=1)).init)(
                    jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"])
    check_config(_config(init_from=str(tmp_path), model_overrides={}))
    message = _error(_config(init_from=str(tmp_path), model_overrides={"d_model": 64}))
    assert re.match(r"model_overrides=\{'d_model': 64\}: may only set \[.*'dropout_rate'", message)


def test_an_encoder_only_model_trains_on_text_or_classification_and_nothing_else():
    from train import configs
    from train.run_config import check_config
    config = configs.get("default")
    config.model = "bert-tiny"
    with pytest.raises(ValueError, match=r"model='bert-tiny' .*\(encoder_only\) does not fit "
                                         r"dataset 'toy_translation' \(translation\)"):
        check_config(config)
    config.dataset = "tiny_shakespeare"
    check_config(config)                                   # masked LM on text
    config.model_overrides = {"num_labels": 2}
    with pytest.raises(ValueError, match=r"encoder-only classifier, num_labels=2\) does not "
                                         r"fit dataset 'tiny_shakespeare' \(text\)"):
        check_config(config)
    config.model_overrides = {}
    config.scheduled_sampling.enabled = True
    with pytest.raises(ValueError, match=r"scheduled_sampling.enabled=True needs a model that "
                                         r"predicts the next token; 'bert-tiny' is encoder-only"):
        check_config(config)
    config.scheduled_sampling.enabled = False
    config.mlm_random_fraction = 0.3
    with pytest.raises(ValueError, match=r"mlm_mask_fraction=0.8 plus mlm_random_fraction=0.3 "
                                         r"is 1.1, above 1"):
        check_config(config)
