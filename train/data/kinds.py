"""Dataset kinds and side roles: what differs between translation, text and classification
data, in one table that the builders, the datasets and the pipeline ask.

A dataset's `kind` is a name in `KINDS`; its `DataKind` says how its examples look and how
they become batches:

    kind = get("translation")
    kind.keys                    # ("inputs", "targets"): the built-in builders' features
    kind.batch_names             # ("inputs", "targets"): each side's arrays in a batch
    kind.max_lengths(cfg)        # (cfg.max_source_length, cfg.max_target_length)
    kind.roles()                 # (SOURCE_ROLE, TARGET_ROLE): how each side is tokenised

    get("text").roles("sentence")     # (SENTENCE_ROLE,): text an encoder-only model reads
    get("classification").label_key   # "label": the feature after the text side
    get("speech").audio_key           # "audio": an audio file's path, after the text side

    kind            sides: batch name, row width, role          labelled  chunked  reversible
    translation     inputs  max_source_length  source                 no        no       yes
                    targets max_target_length  target
    text            targets max_target_length  (text_role)            no        yes      no
    classification  inputs  max_source_length  sentence               yes       no       no
    speech          targets max_target_length  transcript             no        no       no
                    (+ audio: `inputs` are the clip's log-mel features, made on the host)
    preference      inputs  max_source_length  text (the prompt)      no        no       no
                    targets max_target_length  text (the chosen response)
                    rejected max_target_length text (the rejected response)
    chat            targets max_target_length  chat (scored: the assistant's ids)  no  no  no
    prompts         inputs  max_source_length  text (the prompt)      no        no       no
                    targets max_target_length  text (its answer, for the reward)

A role is how one side of an example is tokenised (see `train.data.pipeline.encode_side`):

    role      target side  a Hugging Face tokenizer's template  ends with
    source    no           yes                                  EOS (appended if missing)
    target    yes          yes                                  EOS (appended if missing)
    text      no           no                                   EOS (appended)
    sentence  no           every tokenizer's, nothing appended  the template's last id
    transcript yes         no; after `target_prefix`            EOS (appended)
    chat      no           the model's chat template            EOS (appended if missing)

Adding a kind is one `DataKind` here (and a builder that names it): the builders, the
datasets and the pipeline ask the table and compare no kind or role names.
"""

from __future__ import annotations

import dataclasses

from models.errors import UserError


@dataclasses.dataclass(frozen=True)
class Role:
    """How one side of an example becomes token ids.

    Attributes:
        name: "source", "target", "text" or "sentence" (`PipelineConfig.text_role` names
            one of `TEXT_ROLES`).
        target: encoded as the tokenizer's target side (`encode_batch(..., target=True)`:
            Marian's target.spm).
        template: a Hugging Face tokenizer applies its own template (`add_special_tokens`:
            BART's `<s> x </s>`, Marian's and T5's `x </s>`); the EOS is appended unless the
            template ends with it. Without `template` the pieces are followed by EOS.
        model_input: the tokenizer's model-input template alone, for every tokenizer (BERT's
            `[CLS] x [SEP]`, RoBERTa's `<s> x </s>`), nothing appended: the example ends
            with the template's last id.
        prefixed: the pipeline's `target_prefix` ids come first (Whisper's decoder prompt
            after its start token), then the pieces and EOS.
        chat: the side is a conversation (its messages as JSON) rendered by the model's
            chat template (`models.chat`), its first id (the template's start, which the
            model reads as its start token) dropped, EOS appended unless the template ends
            with it; only the assistant's ids are scored (the side's weights).
    """
    name: str
    target: bool = False
    template: bool = False
    model_input: bool = False
    prefixed: bool = False
    chat: bool = False


SOURCE_ROLE = Role("source", template=True)
TARGET_ROLE = Role("target", target=True, template=True)
TEXT_ROLE = Role("text")
SENTENCE_ROLE = Role("sentence", model_input=True)
TRANSCRIPT_ROLE = Role("transcript", target=True, prefixed=True)
CHAT_ROLE = Role("chat", chat=True)
ROLES = {r.name: r for r in (SOURCE_ROLE, TARGET_ROLE, TEXT_ROLE, SENTENCE_ROLE,
                             TRANSCRIPT_ROLE, CHAT_ROLE)}
TEXT_ROLES = (TEXT_ROLE.name, SENTENCE_ROLE.name)    # how a text dataset's side may be read


def role(name: str | Role) -> Role:
    """The role called `name` (a `Role` is returned as it is).

    Raises:
        UserError: an unknown name, listing the roles.
    """
    if isinstance(name, Role):
        return name
    if name not in ROLES:
        raise UserError(f"role {name!r} must be one of {sorted(ROLES)}")
    return ROLES[name]


@dataclasses.dataclass(frozen=True)
class Side:
    """One tokenised side of an example.

    Attributes:
        name: its arrays' name in a batch: `name`, `name_segmentation`, `name_position`.
        length: the `PipelineConfig` field that is its row width.
        role: how it is tokenised; None: as the pipeline's `text_role` says.
    """
    name: str
    length: str
    role: Role | None


@dataclasses.dataclass(frozen=True)
class DataKind:
    """What a kind of dataset holds and how the pipeline batches it.

    Attributes:
        name: the kind's name (`Dataset.kind`).
        keys: the features of the built-in builders of this kind, the sides first (then
            the label, when `labelled`).
        sides: the tokenised sides, in the order of `keys`.
        labelled: each example has a class label, the feature after the sides (`label_key`);
            batches carry `labels`.
        chunked: long examples are cut into chunks of the row width (each chunk a row
            item, none forced to end in EOS), so each shard of a split yields its own number
            of rows; otherwise each example is one item, dropped or truncated by
            `PipelineConfig.overlong` with its end token kept last.
        reversible: `reverse_translation` may swap its two sides.
        audio: each example has an audio clip: the feature after the sides (`audio_key`)
            is its file's path, the next one where it was named (`file:line`); batches
            carry the clip's log-mel features as `inputs` (`train.data.speech`).
    """
    name: str
    keys: tuple[str, ...]
    sides: tuple[Side, ...]
    labelled: bool = False
    chunked: bool = False
    reversible: bool = False
    audio: bool = False

    @property
    def batch_names(self) -> tuple[str, ...]:
        """Each side's name in a batch: what the model reads first is `inputs`."""
        return tuple(s.name for s in self.sides)

    @property
    def label_key(self) -> str:
        """The feature holding the label (the one after the sides)."""
        if not self.labelled:
            raise UserError(f"a {self.name} dataset has no labels")
        return self.keys[len(self.sides)]

    @property
    def audio_key(self) -> str:
        """The feature holding the audio file's path (the one after the sides)."""
        if not self.audio:
            raise UserError(f"a {self.name} dataset has no audio")
        return self.keys[len(self.sides)]

    def roles(self, text_role: str = TEXT_ROLE.name) -> tuple[Role, ...]:
        """How each side is tokenised; a side without its own role reads as `text_role`."""
        return tuple(s.role or role(text_role) for s in self.sides)

    def max_lengths(self, cfg) -> tuple[int, ...]:
        """Each side's row width in a `PipelineConfig` (EOS included)."""
        return tuple(getattr(cfg, s.length) for s in self.sides)


TRANSLATION = DataKind(
    "translation", ("inputs", "targets"),
    (Side("inputs", "max_source_length", SOURCE_ROLE),
     Side("targets", "max_target_length", TARGET_ROLE)),
    reversible=True)
TEXT = DataKind("text", ("text",), (Side("targets", "max_target_length", None),),
                chunked=True)
CLASSIFICATION = DataKind("classification", ("text", "label"),
                          (Side("inputs", "max_source_length", SENTENCE_ROLE),), labelled=True)
SPEECH = DataKind("speech", ("text", "audio", "origin"),
                  (Side("targets", "max_target_length", TRANSCRIPT_ROLE),), audio=True)
# A prompt and two responses to it, the first preferred (`train.objectives.preference`):
# each side is pieces then EOS; the objective drops the prompt's EOS and joins each
# response to it, so a row holds one pair (never packed).
PREFERENCE = DataKind("preference", ("prompt", "chosen", "rejected"),
                      (Side("inputs", "max_source_length", TEXT_ROLE),
                       Side("targets", "max_target_length", TEXT_ROLE),
                       Side("rejected", "max_target_length", TEXT_ROLE)))
# Conversations (`{"messages": [...]}`) in the model's chat template; batches carry
# `targets_weights`, 1 on the assistant's tokens.
CHAT = DataKind("chat", ("messages",), (Side("targets", "max_target_length", CHAT_ROLE),))
# Prompts and the answers a reward checks their completions against (GRPO,
# `train.objectives.grpo`): each side pieces then EOS, one prompt a row.
PROMPTS = DataKind("prompts", ("prompt", "answer"),
                   (Side("inputs", "max_source_length", TEXT_ROLE),
                    Side("targets", "max_target_length", TEXT_ROLE)))
KINDS = {k.name: k for k in (TRANSLATION, TEXT, CLASSIFICATION, SPEECH, PREFERENCE, CHAT,
                             PROMPTS)}


def get(name: str) -> DataKind:
    """The kind called `name`.

    Raises:
        UserError: an unknown name, listing the kinds.
    """
    if name not in KINDS:
        raise UserError(f"dataset kind {name!r} must be one of {sorted(KINDS)}")
    return KINDS[name]
