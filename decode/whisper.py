"""Transcription with a Whisper model as its checkpoint intends, greedy or beam search: the
decoder prompt, the suppressed tokens and the beam settings of its generation_config.json,
the same tokens as transformers' `generate` (short-form, no timestamps).

    pre = models.load("whisper-tiny")
    feats, _ = models.audio_features.log_mel_features([wave])      # [1, 80, 3000]
    out = decode.whisper.transcribe(pre, feats, language="en")
    pre.tokenizer.decode(out.tokens[0, :out.lengths[0]])

The decoder prompt is <|startoftranscript|>, the language, the task, <|notimestamps|>,
built as transformers builds it (`decoder_prompts`): a language given ("en" or "<|en|>")
or, for a multilingual model, detected per row (the argmax over the language tokens of the
logits after <|startoftranscript|>); a task given ("transcribe" / "translate") or
transcribe when a language is given; otherwise the checkpoint's `forced_decoder_ids`. Then
greedy decoding (`decode.loop`, the cross-attention keys/values computed once): the
`begin_suppress_tokens` are banned at the first new token, the `suppress_tokens` at every
one, until an end token, `max_length` new tokens, or the decoder's last position.

With `num_beams` > 1 (given, or the file's), beam search as transformers runs it
(`decode.beam_steps`): the same prompt, the suppressed tokens removed from each step's
log-probs (the begin-suppressed ones from the first), finished beams scored log-prob /
length ** length_penalty (length: the new tokens, the end token included), and the file's
`early_stopping` rule (transformers' default False: a source stops once its W finished
beams all score at least the best alive one at its current length). The best beam is
returned:

    out = decode.whisper.transcribe(pre, feats, language="en", num_beams=4)

Refused by name: timestamps (`return_timestamps`) and audio longer than one window (the
features are one 30 s window each; `models.audio_features` refuses longer audio).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from decode.beam_steps import beam_init, beam_loop, finalize, stopping_rule
from decode.loop import decode_loop, initial_state
from decode.model_fns import model_step_fn, output_pad_id
from decode.processors import Constraints, SamplingParams, Strategy
from models import BeamKVCache
from models.audio import check_features
from models.errors import UserError, is_int
from models.numerics import REMOVED_LOGIT

TASKS = ("transcribe", "translate")


@dataclasses.dataclass(frozen=True)
class WhisperSettings:
    """A Whisper checkpoint's decoding defaults (generation_config.json).

    Attributes:
        start_id: decoder_start_token_id (<|startoftranscript|>).
        eos_ids: the end tokens.
        lang_to_id: (("<|en|>", 50259), ...) of a multilingual model; () for English-only.
        task_to_id: (("transcribe", 50360), ("translate", 50359)) or ().
        no_timestamps_id: <|notimestamps|>, or None.
        suppress: suppress_tokens, never generated.
        begin_suppress: begin_suppress_tokens, not generated as the first new token.
        forced_decoder_ids: ((1, id or None), (2, id), ...), the older prompt form.
        max_length: the new tokens (448), within the decoder's positions
            (max_target_positions, prompt included).
        language, task: the file's defaults, or None.
        num_beams: beams (1: greedy, transformers' default).
        length_penalty: alpha of beam search's log-prob / length ** alpha (1.0).
        early_stopping: transformers' beam stopping rule: False (its default), True or
            "never" (`decode.beam_steps.EARLY_STOPPING`).
    """

    start_id: int
    eos_ids: tuple[int, ...]
    lang_to_id: tuple[tuple[str, int], ...] = ()
    task_to_id: tuple[tuple[str, int], ...] = ()
    no_timestamps_id: int | None = None
    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()
    forced_decoder_ids: tuple[tuple[int, int | None], ...] = ()
    max_length: int = 448
    language: str | None = None
    task: str | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    @classmethod
    def from_generation(cls, generation, config) -> WhisperSettings:
        """From a loaded model's `GenerationDefaults` (its `raw` fields) and config."""
        raw = dict(getattr(generation, "raw", None) or {})
        if raw.get("return_timestamps"):
            raise UserError("generation_config.json sets return_timestamps: timestamps are "
                            "not supported")
        eos = raw.get("eos_token_id", config.eos_id)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            start_id=raw.get("decoder_start_token_id", config.bos_id), eos_ids=eos_ids,
            lang_to_id=tuple(sorted((raw.get("lang_to_id") or {}).items())),
            task_to_id=tuple(sorted((raw.get("task_to_id") or {}).items())),
            no_timestamps_id=raw.get("no_timestamps_token_id"),
            suppress=tuple(raw.get("suppress_tokens") or ()),
            begin_suppress=tuple(raw.get("begin_suppress_tokens") or ()),
            forced_decoder_ids=tuple(tuple(p) for p in raw.get("forced_decoder_ids") or ()),
            max_length=raw.get("max_length") or config.max_len,
            language=raw.get("language"), task=raw.get("task"),
            num_beams=raw.get("num_beams") or 1,
            length_penalty=1.0 if raw.get("length_penalty") is None else raw["length_penalty"],
            early_stopping=(False if raw.get("early_stopping") is None
                            else raw["early_stopping"]))


def language_id(settings: WhisperSettings, language: str) -> int:
    """The token of a language code ("en") or token ("<|en|>")."""
    table = dict(settings.lang_to_id)
    if not table:
        raise UserError(f"language={language!r}, but this model is English-only (its "
                        "generation config has no lang_to_id)")
    token = language if language.startswith("<|") else f"<|{language.lower()}|>"
    if token not in table:
        raise UserError(f"language={language!r} is not one of this model's languages "
                        f"(codes such as {sorted(t[2:-2] for t in table)[:12]})")
    return table[token]


def _start(settings: WhisperSettings, language, task) -> list:
    """The prompt before language detection: the start token and, when neither a language
    nor a task is given, the checkpoint's forced_decoder_ids (a None language: detect)."""
    init = [settings.start_id]
    if language is None and task is None:
        for position, token in settings.forced_decoder_ids:
            if position != len(init):
                raise UserError(f"forced_decoder_ids {settings.forced_decoder_ids} do not "
                                "follow Whisper's prompt (positions 1, 2, ...)")
            init.append(token)
    return init


def needs_detection(settings: WhisperSettings, language, task) -> bool:
    """Whether each row's language is detected: a multilingual model given no language
    whose prompt names none."""
    init = _start(settings, language, task)
    return language is None and bool(settings.lang_to_id) and (len(init) <= 1
                                                                or init[1] is None)


def decoder_prompts(settings: WhisperSettings, batch: int, *, language=None, task=None,
                    detected=None) -> np.ndarray:
    """int32[B, P]: each row's decoder prompt (see the module docstring); `detected` the
    rows' language tokens where `needs_detection`."""
    if task is not None and task not in TASKS:
        raise UserError(f"task={task!r} is not one of {TASKS}")
    tasks = dict(settings.task_to_id)
    if task is not None and task not in tasks:
        raise UserError(f"task={task!r}, but this model's generation config has no task "
                        "tokens (task_to_id)")
    init = _start(settings, language, task)
    if language is not None:
        lang_ids = [language_id(settings, language)] * batch
    elif needs_detection(settings, language, task):
        if detected is None:
            raise ValueError("needs_detection: give the detected language tokens")
        lang_ids = [int(x) for x in detected]
    else:
        lang_ids = None
    rows = []
    for b in range(batch):
        row = list(init)
        if lang_ids is not None:
            if len(row) > 1:
                row[1] = lang_ids[b]
            else:
                row.append(lang_ids[b])
        if task is not None:
            row = [tasks[task] if t in tasks.values() else t for t in row]
            if tasks[task] not in row:
                row.append(tasks[task])
        elif language is not None and tasks and not any(t in tasks.values() for t in row):
            row.append(tasks["transcribe"])
        if settings.no_timestamps_id is not None and row[-1] != settings.no_timestamps_id:
            row.append(settings.no_timestamps_id)
        rows.append([t for t in row if t is not None])
    return np.asarray(rows, np.int32)


@functools.partial(jax.jit, static_argnames=("model",))
def _first_logits(model, params, features_BMF, start_id):
    cache = model.apply({"params": params}, features_BMF, 1, method="init_cache")
    B = features_BMF.shape[0]
    logits, _ = model.apply({"params": params}, jnp.full((B, 1), start_id, jnp.int32),
                            jnp.ones((B,), jnp.int32), cache, jnp.zeros((B,), jnp.int32),
                            method="prefill")
    return logits


def detect_language(model, params, features_BMF, settings: WhisperSettings) -> np.ndarray:
    """int32[B]: each row's language token, the argmax over the language tokens of the
    logits after <|startoftranscript|>."""
    logits_BV = np.asarray(_first_logits(model, params, jnp.asarray(features_BMF),
                                         settings.start_id))
    ids = np.asarray(sorted(i for _, i in settings.lang_to_id), np.int64)
    return ids[np.argmax(logits_BV[:, ids], axis=1)].astype(np.int32)


@flax.struct.dataclass
class WhisperOutput:
    """prompts: int32[B, P] the decoder prompts; tokens: int32[B, N] the new tokens (pad
    after each row's end token); lengths: int32[B] the new tokens up to and including the
    end token."""

    prompts: Int[Array, "B P"]
    tokens: Int[Array, "B N"]
    lengths: Int[Array, " B"]


def _prefill(model, params, features_BMF, prompts_BP, cache_len: int):
    """(logits_BV of the first new token, the cache): the encoder's cross-attention keys
    and values projected once, then every row's decoder prompt (all P tokens long)."""
    B, P = prompts_BP.shape
    v = {"params": params}
    cache = model.apply(v, features_BMF, cache_len, method="init_cache")
    lengths_B = jnp.full((B,), P, jnp.int32)
    return model.apply(v, prompts_BP, lengths_B, cache, lengths_B - 1, method="prefill")


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "eos_ids"))
def _greedy(model, params, features_BMF, prompts_BP, *, banned_V, begin_V, max_new_tokens,
            eos_ids):
    B, P = prompts_BP.shape
    logits_BV, cache = _prefill(model, params, features_BMF, prompts_BP, P + max_new_tokens)
    logits_BV = jnp.where(begin_V[None, :], REMOVED_LOGIT, logits_BV)
    V = logits_BV.shape[-1]
    constraints = dataclasses.replace(Constraints.none(V, B), banned=banned_V)
    zeros_B = jnp.zeros((B,), jnp.float32)
    sampling = SamplingParams(temperature=zeros_B, top_k=jnp.zeros((B,), jnp.int32),
                              top_p=zeros_B + 1, min_p=zeros_B, repetition_penalty=zeros_B + 1)
    state = decode_loop(model_step_fn(model, params),
                        initial_state(logits_BV, cache, jax.random.key(0), max_new_tokens),
                        eos_ids=eos_ids, pad_id=output_pad_id(model.config), params=sampling,
                        strategy=Strategy(), constraints=constraints)
    return state.tokens, state.lengths


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "max_new_tokens", "eos_ids",
                                             "stopping"))
def _beam(model, params, features_BMF, prompts_BP, *, banned_V, begin_V, alpha, beam_size,
          max_new_tokens, eos_ids, stopping):
    """Beam search as transformers runs it for Whisper: the suppressed tokens removed from
    each step's log-probs (the begin-suppressed ones from the first), scores log-prob /
    length ** alpha over the new tokens, `stopping` its early_stopping rule. The prompt is
    prefilled once per row and shared by its beams (`models.BeamKVCache`), as are the
    cross-attention keys and values. Returns the best beam's (tokens_BN, lengths_B)."""
    B, P = prompts_BP.shape
    W = beam_size
    logits_BV, cache = _prefill(model, params, features_BMF, prompts_BP, P + max_new_tokens)
    constraints = dataclasses.replace(Constraints.none(logits_BV.shape[-1], B * W),
                                      banned=banned_V, banned_first=begin_V)
    state = beam_init(jnp.repeat(logits_BV, W, axis=0), BeamKVCache.from_cache(cache, W), W,
                      max_new_tokens)
    state = beam_loop(model_step_fn(model, params), state, alpha=alpha, eos_ids=eos_ids,
                      normalization="hf", constraints=constraints, stopping=stopping)
    tokens_BWN, _, lengths_BW = finalize(state, alpha, output_pad_id(model.config), "hf")
    return tokens_BWN[:, 0], lengths_BW[:, 0]


def _mask(ids, vocab: int, name: str) -> jnp.ndarray:
    ids = np.asarray(ids, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise UserError(f"{name} {ids.tolist()} has ids outside [0, vocab_size={vocab})")
    out = np.zeros((vocab,), bool)
    out[ids] = True
    return jnp.asarray(out)


def transcribe(pre, features, *, language: str | None = None, task: str | None = None,
               max_new_tokens: int | None = None, num_beams: int | None = None,
               length_penalty: float | None = None, return_timestamps: bool = False,
               settings: WhisperSettings | None = None) -> WhisperOutput:
    """Greedy decoding or beam search of a batch of feature windows (see the module
    docstring).

    Args:
        pre: a loaded Whisper (`models.load`): its model, params, config and generation.
        features: float32 [B, mel, frames], one window per row (`log_mel_features`).
        language, task: as transformers' `generate` takes them (None: the file's defaults,
            else forced_decoder_ids or detection).
        max_new_tokens: default `settings.max_length` (as transformers counts it).
        num_beams: 1 greedy, more beam search (default `settings.num_beams`, the file's,
            else 1); the best beam is returned.
        length_penalty: beam search's alpha (default `settings.length_penalty`).
        settings: default `WhisperSettings.from_generation(pre.generation, pre.config)`.
    """
    if return_timestamps:
        raise UserError("return_timestamps=True: timestamps are not supported")
    cfg = pre.config
    if cfg.audio is None:
        raise UserError("transcribe needs a model with an audio encoder (config.audio)")
    features = jnp.asarray(features)
    check_features(cfg.audio, features)
    settings = settings or WhisperSettings.from_generation(pre.generation, cfg)
    language = settings.language if language is None else language
    task = settings.task if task is None else task
    B = features.shape[0]
    detected = (detect_language(pre.model, pre.params, features, settings)
                if needs_detection(settings, language, task) else None)
    prompts = decoder_prompts(settings, B, language=language, task=task, detected=detected)
    P = prompts.shape[1]
    room = cfg.max_len - P
    if max_new_tokens is None:      # max_length counts new tokens past the prompt (to its
        # first max_len // 2 - 1 tokens), within the decoder's positions: as transformers
        max_new_tokens = min(settings.max_length + min(cfg.max_len // 2 - 1, P),
                             cfg.max_len) - P
    if not 0 < max_new_tokens <= room:
        raise UserError(f"max_new_tokens={max_new_tokens} must be in [1, {room}]: the decoder "
                        f"holds max_target_positions={cfg.max_len} tokens, the prompt {P}")
    V = cfg.vocab_size
    beams = settings.num_beams if num_beams is None else num_beams
    if not is_int(beams) or not 1 <= beams <= V:
        raise UserError(f"num_beams={beams!r} must be an int in [1, vocab_size={V}]")
    common = dict(banned_V=_mask(settings.suppress, V, "suppress_tokens"),
                  begin_V=_mask(settings.begin_suppress, V, "begin_suppress_tokens"),
                  max_new_tokens=max_new_tokens, eos_ids=settings.eos_ids or None)
    if beams == 1:
        tokens, lengths = _greedy(pre.model, pre.params, features, jnp.asarray(prompts),
                                  **common)
    else:
        tokens, lengths = _beam(
            pre.model, pre.params, features, jnp.asarray(prompts), **common,
            alpha=_alpha(settings.length_penalty if length_penalty is None
                         else length_penalty),
            beam_size=int(beams), stopping=stopping_rule(settings.early_stopping))
    return WhisperOutput(jnp.asarray(prompts), tokens, lengths)


def _alpha(length_penalty) -> jnp.ndarray:
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or \
            not np.isfinite(length_penalty):
        raise UserError(f"length_penalty={length_penalty!r} must be a finite number")
    return jnp.float32(length_penalty)
