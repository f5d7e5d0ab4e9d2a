"""The objectives (`train.objectives`): the registry pairs each model with each kind of data
(and refuses what does not fit, naming both), and every registered objective keeps the
interface's contract: its init inputs initialise the model, its task scores the positions
it weights, and its loss sums are cross-entropy sums over those positions."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.chat import ChatTemplate
from models.pretrained import GenerationDefaults
from models.tokenizer import ByteTokenizer
from tests.helpers import tiny
from train.objectives import ENTRIES, Classification, MaskedLM, NextToken, entry_for, fit
from train.settings import ObjectiveSettings, ScheduledSampling

SETTINGS = ObjectiveSettings()
TOK = ByteTokenizer(mask=True)
W = 10


def _data(kind: str, labels=()):
    return types.SimpleNamespace(name=f"some_{kind}", kind=kind, label_names=tuple(labels))


def _config(architecture: str, **overrides):
    return tiny(architecture, vocab_size=TOK.vocab_size, **{"max_len": W, **overrides})


@pytest.mark.parametrize("architecture,labels,kind,expected", [
    ("encoder_decoder", 0, "translation", NextToken),
    ("decoder_only", 0, "text", NextToken),
    ("encoder_only", 0, "text", MaskedLM),
    ("encoder_only", 0, "classification", Classification),
    ("encoder_only", 2, "classification", Classification),
])
def test_each_model_and_data_kind_maps_to_its_objective(architecture, labels, kind, expected):
    cfg = _config(architecture, num_labels=labels)
    data = _data(kind, ("neg", "pos") if kind == "classification" else ())
    trained, objective = fit(cfg, data, TOK, SETTINGS, model_name="m")
    assert type(objective) is expected
    if expected is NextToken:     # translation's evaluations decode; a language model's not
        assert objective.decodes == (kind == "translation")
        assert objective.encoder_decoder == cfg.is_encoder_decoder
    if kind == "classification":  # a masked-LM model gets a head for the data's labels
        assert trained.num_labels == 2 and trained.label_names == ("neg", "pos")
        assert objective.label_names == ("neg", "pos")
    else:
        assert trained == cfg


@pytest.mark.parametrize("architecture,labels,kind,what", [
    ("decoder_only", 0, "translation", "decoder_only"),
    ("encoder_decoder", 0, "text", "encoder_decoder"),
    ("encoder_decoder", 0, "classification", "encoder_decoder"),
    ("decoder_only", 0, "classification", "decoder_only"),
    ("encoder_only", 0, "translation", "encoder_only"),
    ("encoder_only", 3, "text", "an encoder-only classifier, num_labels=3"),
])
def test_an_impossible_pair_is_refused_naming_the_model_and_the_data(architecture, labels,
                                                                     kind, what):
    cfg = _config(architecture, num_labels=labels)
    with pytest.raises(ValueError) as e:
        entry_for(cfg, kind, model_name="m", dataset_name="d")
    message = str(e.value)
    assert message.startswith(f"model 'm' ({what}) does not fit dataset 'd' ({kind}): ")
    # What each kind needs, from the table itself.
    assert ("translation needs an encoder-decoder (next token); text needs a decoder-only "
            "model (next token) or an encoder-only one (masked LM); classification needs an "
            "encoder-only one (classification)") in message


def test_what_an_objective_cannot_do_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model 'm' has num_labels=2, but dataset "
                                         r"'some_classification' has 3 labels"):
        fit(_config("encoder_only", num_labels=2), _data("classification", "abc"), TOK,
            SETTINGS, model_name="m")
    with pytest.raises(ValueError, match=r"model 'm' has no start token \(bos_id\)"):
        fit(_config("decoder_only", bos_id=None), _data("text"), TOK, SETTINGS,
            model_name="m")
    sampled = ObjectiveSettings(scheduled_sampling=ScheduledSampling(enabled=True))
    with pytest.raises(ValueError, match=r"scheduled_sampling.enabled=True needs a model "
                                         r"that predicts the next token; 'm' is encoder-only"):
        fit(_config("encoder_only"), _data("text"), TOK, sampled, model_name="m")
    assert fit(_config("decoder_only"), _data("text"), TOK, sampled,
               model_name="m")[1].scheduled_sampling.enabled


def test_each_objective_fixes_how_the_pipeline_reads_text():
    def options(architecture: str, kind: str) -> dict:
        _, objective = fit(_config(architecture), _data(kind, "ab"), TOK, SETTINGS,
                           model_name="m")
        return objective.pipeline_options()

    assert options("decoder_only", "text") == {}                   # pieces, then EOS
    assert options("encoder_only", "text") == {"text_role": "sentence"}
    assert options("encoder_only", "classification") == {"text_role": "sentence",
                                                         "label_names": ("a", "b")}


def _rows(cfg, rows: int = 4, sides: tuple[str, ...] = ()) -> dict:
    """Packed rows of two segments with padding, with every key any objective reads (with
    `sides` "rejected": unpacked preference pairs, the prompt in `inputs`)."""
    r = np.random.default_rng(0)
    out = {}
    for side in ("inputs", "targets"):
        tok = r.integers(4, TOK.vocab_size - 1, (rows, W)).astype(np.int32)
        seg = np.ones((rows, W), np.int32)
        pos = np.tile(np.arange(W, dtype=np.int32), (rows, 1))
        seg[:, 5:], pos[:, 5:] = 2, np.arange(W - 5)
        seg[:, -2:], pos[:, -2:], tok[:, -2:] = 0, 0, 0
        out.update({side: tok, f"{side}_segmentation": seg, f"{side}_position": pos})
    out["labels"] = r.integers(0, max(cfg.num_labels, 1), (rows, W)).astype(np.int32)
    if (not cfg.is_encoder_decoder and cfg.architecture != "encoder_only"
            and not {"rejected", "prompts"} & set(sides)):
        del out["inputs"], out["inputs_segmentation"], out["inputs_position"]
    if "prompts" in sides:                # one prompt a row, its answer in targets
        for side in ("inputs", "targets"):
            out[f"{side}_segmentation"] = np.minimum(out[f"{side}_segmentation"], 1)
            out[f"{side}_position"] = np.tile(np.arange(W, dtype=np.int32), (rows, 1))
            out[f"{side}_segmentation"][:, -2:] = out[f"{side}_position"][:, -2:] = 0
        return out
    if "rejected" in sides:               # one preference pair a row: a third side
        out["rejected"] = out["targets"][:, ::-1].copy()
        out["rejected_segmentation"] = out["targets_segmentation"].copy()
        for side in ("inputs", "targets", "rejected"):
            out[f"{side}_segmentation"] = np.minimum(out[f"{side}_segmentation"], 1)
            out[f"{side}_position"] = np.tile(np.arange(W, dtype=np.int32), (rows, 1))
            out[side][:, -2:] = 0
            out[f"{side}_segmentation"][:, -2:] = out[f"{side}_position"][:, -2:] = 0
        return out
    if "chat" in sides:                   # the assistant's tokens flagged
        out["targets_weights"] = (r.random((rows, W)) < 0.5).astype(np.float32)
    if cfg.audio is not None:             # a clip's features [mel, frames] instead of tokens
        del out["inputs_segmentation"], out["inputs_position"]
        out["inputs"] = r.normal(size=(rows, cfg.audio.num_mel_bins, cfg.audio.num_frames)
                                 ).astype(np.float32)
    return out


# An English-only Whisper's generation defaults: its prompt is start (2), <|notimestamps|>.
WHISPER_GENERATION = GenerationDefaults.from_dict(
    {"decoder_start_token_id": 2, "eos_token_id": 1, "no_timestamps_token_id": 7,
     "forced_decoder_ids": [[1, 7]]}, TOK.vocab_size)


def _entry_config(entry):
    """The model config and generation defaults an entry's contract test trains."""
    if entry.data_kind in ("preference", "prompts"):     # each response behind a prompt
        return _config(entry.architecture, max_len=2 * W + 16), None
    if entry.data_kind == "speech":                      # a Whisper-like audio model
        return _config(entry.architecture, share_embeddings=False,
                       audio=dict(num_mel_bins=4, max_source_positions=W // 2)
                       ), WHISPER_GENERATION
    return _config(entry.architecture, num_labels=2 if entry.classifier is not False
                   and entry.data_kind == "classification" else 0), None


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: f"{e.architecture}-{e.data_kind}")
def test_every_registered_objective_keeps_the_interface_contract(entry):
    cfg, generation = _entry_config(entry)
    preference = entry.data_kind in ("preference", "prompts")     # unsmoothed
    settings = ObjectiveSettings(label_smoothing=0.0) if preference else SETTINGS
    chat = ChatTemplate("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    cfg, objective = fit(cfg, _data(entry.data_kind, ("a", "b")), TOK, settings,
                         model_name="m", generation=generation, chat_template=chat)
    model = models.build(cfg)
    sides = {"preference": ("rejected",), "chat": ("chat",),
             "prompts": ("prompts",)}.get(entry.data_kind, ())
    batch = jax.tree.map(jnp.asarray, _rows(cfg, sides=sides))
    args, method = objective.init_inputs(batch)
    params = model.init(jax.random.key(0), *args, method=method)["params"]
    task = objective.prepare(batch, key=jax.random.key(1), row_ids=jnp.arange(4))
    assert task["targets"].shape == task["weights"].shape
    assert task["weights"].dtype == jnp.float32 and float(task["weights"].sum()) > 0
    keys = dict(dropout_rng=jax.random.key(2), sample_rng=jax.random.key(3), step=0)
    if objective.needs_reference_copy:          # the train state's copy of the start
        keys["reference"] = params
    for train in (True, False):
        sums = objective.loss_sums(model, params, batch, task, train=train, **keys)
        assert {"loss", "nll", "correct", "weight"} <= set(sums)
        # (GRPO evaluates one greedy completion a prompt, not its training group.)
        if train or entry.data_kind != "prompts":
            assert float(sums["weight"]) == float(task["weights"].sum())
        # (GRPO's loss is its advantages', which sum to zero over a group, plus a KL
        # that is zero at the start: it may be zero or below.)
        assert np.isfinite(float(sums["loss"]))
        assert float(sums["loss"]) > 0 or entry.data_kind == "prompts"
    assert objective == fit(cfg, _data(entry.data_kind, ("a", "b")), TOK, settings,
                            model_name="m", generation=generation,
                            chat_template=ChatTemplate(chat.source)
                            )[1]         # frozen values: equal when rebuilt
    hash(objective)
