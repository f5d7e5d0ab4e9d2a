"""Masked LM (BERT's objective) for an encoder-only model with its masked-LM head: the
model reads each text with `mlm_rate` of its real, non-special tokens corrupted
(`train.masking`) and is scored at those positions only.

    objective = MaskedLM(mask_id=260, vocab_size=261, special_ids=(0, 1, 2, 3, 260))
    task = objective.prepare(batch, key=step_key, row_ids=rows)   # targets, weights, inputs

The masks are a pure function of the step's key and each row's global index, so a batch
split over devices masks exactly what one device does, and a resumed run draws the same
masks; evaluation masks each example by its index with a fixed key.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from models.errors import UserError
from train import chunked_loss
from train.masking import Masking, mask_tokens
from train.objectives.base import Objective


@dataclasses.dataclass(frozen=True)
class MaskedLM(Objective):
    """Masked LM (see the module docstring).

    Attributes:
        mask_id: the tokenizer's mask token.
        vocab_size: the model's vocabulary (random replacements are drawn from it).
        special_ids: ids never chosen for masking (the tokenizer's specials).
        masking: the corruption's probabilities.
        label_smoothing, z_loss: the training loss's (`train.losses.cross_entropy`).
        loss_chunks: 0, or the loss in this many slices of the sequence without the whole
            logits (`train.chunked_loss`).
    """

    name = "masked LM"
    takes_loss_chunks = True
    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...] = ()
    masking: Masking = Masking()
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    loss_chunks: int = 0

    @classmethod
    def build(cls, model_config, tokenizer, settings, *, model_name: str) -> MaskedLM:
        del model_name
        if tokenizer.mask_id is None:
            raise UserError(f"masked LM needs a mask token, and the tokenizer "
                            f"({tokenizer.identity[:40]}) has none (mask_id None)")
        return cls(mask_id=int(tokenizer.mask_id), vocab_size=model_config.vocab_size,
                   special_ids=tuple(sorted(int(i) for i in tokenizer.special_ids)),
                   masking=settings.masking, label_smoothing=settings.label_smoothing,
                   z_loss=settings.z_loss, loss_chunks=settings.loss_chunks)

    def pipeline_options(self) -> dict:
        return {"text_role": "sentence"}        # the tokenizer's model-input template

    def init_inputs(self, row: dict) -> tuple[tuple, str | None]:
        return (row["targets"],), None

    def prepare(self, batch: dict, *, key, row_ids) -> dict:
        tokens_BT = batch["targets"]
        maskable_BT = (batch["targets_segmentation"] > 0) & ~jnp.isin(
            tokens_BT, jnp.asarray(self.special_ids, tokens_BT.dtype))
        inputs_BT, chosen_BT = mask_tokens(key, tokens_BT, maskable_BT, row_ids,
                                           mask_id=self.mask_id, vocab_size=self.vocab_size,
                                           masking=self.masking)
        return {"targets": tokens_BT, "weights": chosen_BT.astype(jnp.float32),
                "inputs": inputs_BT}

    def loss_sums(self, model, params, batch: dict, task: dict, *, dropout_rng, sample_rng,
                  step, train: bool) -> dict:
        del sample_rng, step
        out = model.apply({"params": params}, task["inputs"],
                          segment_ids=batch["targets_segmentation"],
                          positions=batch["targets_position"], deterministic=not train,
                          rngs={"dropout": dropout_rng} if train else None,
                          method="encode" if self.loss_chunks else None)
        return chunked_loss.token_sums(
            model, params, out, task["targets"], task["weights"], chunks=self.loss_chunks,
            label_smoothing=self.label_smoothing if train else 0.0, z_loss=self.z_loss)
