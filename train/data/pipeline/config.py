"""How examples become batches (`PipelineConfig`) and which part of them this process
batches (`Shard`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.errors import UserError
from train.data import kinds


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How examples become batches.

    Attributes:
        per_device_batch_size: rows per device per step.
        max_source_length / max_target_length: row widths, EOS included (which side uses
            which: `train.data.kinds`).
        packing: several examples per row (with segment ids and positions); otherwise one.
        bucket_boundaries: without packing, batch widths are the smallest boundary that holds
            the batch's longest example (fewer distinct shapes = fewer compilations); empty
            pads every batch to the maximum length.
        overlong: examples of an unchunked kind (translation, classification) longer than
            the maximum: "drop" or "truncate" (keeping the end token last). Text examples
            are always cut into chunks of the maximum length.
        seed: shuffling seed; epoch e shuffles with (seed, e).
        pack_bins: open rows the first-fit packer tries before closing the fullest.
        num_threads / prefetch: grain read threads and prefetch buffer (batches).
        worker_count: grain worker processes (0: threads only).
        text_role: how a text example is tokenised (`kinds.TEXT_ROLES`): "text" (pieces
            then EOS: language modelling) or "sentence" (the tokenizer's model-input
            template: encoder-only models). Classification examples are always sentences.
        label_names: the run's class order for classification data (a model's label
            names); empty: the dataset's own order. A label not among them is an error.
        target_prefix: ids that begin every transcript (`kinds.TRANSCRIPT_ROLE`): Whisper's
            decoder prompt after its start token (language, task, <|notimestamps|>).
        audio: the model's `models.audio.AudioInput`: speech batches carry each clip's
            features in its window as `inputs` (None: the model reads no audio).
        chat_template: the `models.chat.ChatTemplate` that renders chat examples (None:
            the data hold no conversations).
    """
    per_device_batch_size: int
    max_source_length: int = 64
    max_target_length: int = 64
    packing: bool = True
    bucket_boundaries: tuple[int, ...] = ()
    overlong: str = "drop"
    seed: int = 0
    pack_bins: int = 8
    num_threads: int = 2
    prefetch: int = 4
    worker_count: int = 0
    text_role: str = kinds.TEXT_ROLE.name
    label_names: tuple[str, ...] = ()
    target_prefix: tuple[int, ...] = ()
    audio: Any = None
    chat_template: Any = None

    def __post_init__(self):
        if self.per_device_batch_size < 1:
            raise UserError(f"per_device_batch_size={self.per_device_batch_size} must be >= 1")
        for name in ("max_source_length", "max_target_length"):
            if getattr(self, name) < 2:
                raise UserError(f"{name}={getattr(self, name)} must be >= 2 (a token and EOS)")
        if self.overlong not in ("drop", "truncate"):
            raise UserError(f"overlong={self.overlong!r} must be 'drop' or 'truncate'")
        if self.text_role not in kinds.TEXT_ROLES:
            raise UserError(f"text_role={self.text_role!r} must be "
                             + " or ".join(map(repr, kinds.TEXT_ROLES)))
        if self.audio is not None and self.packing:
            raise UserError("packing=True: speech batches hold one clip a row (set "
                             "packing=False)")
        if list(self.bucket_boundaries) != sorted(set(self.bucket_boundaries)) or any(
                b < 2 for b in self.bucket_boundaries):
            raise UserError(f"bucket_boundaries={self.bucket_boundaries} must be increasing "
                             "and >= 2")


@dataclasses.dataclass(frozen=True)
class Shard:
    """This process's part of the data: shard `index` of `count`, batched for `devices`
    local devices. Training shards each global batch by rows, evaluation shards the split
    by example (see `train_source` and `eval_batches`).

    Attributes:
        index / count: which shard of how many (by default the process index and count).
        devices: local devices: a batch's arrays are `[devices, per_device_batch_size, W]`.
    """
    index: int
    count: int
    devices: int

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise UserError(f"shard_index={self.index} must be in [0, shard_count="
                             f"{self.count})")

    @classmethod
    def of(cls, index: int | None = None, count: int | None = None,
           devices: int | None = None) -> Shard:
        """A shard whose unset parts are this process's: `jax.process_index()` of
        `jax.process_count()`, `jax.local_device_count()` devices."""
        import jax
        return cls(jax.process_index() if index is None else index,
                   jax.process_count() if count is None else count,
                   jax.local_device_count() if devices is None else devices)

    @property
    def is_process(self) -> bool:
        """The shards are the processes of a multi-process run (`count ==
        jax.process_count() > 1`): agreeing on a shape is then a collective."""
        import jax
        return self.count == jax.process_count() > 1
