"""Next-token prediction by teacher forcing, for both generative families: the decoder
reads the targets shifted right behind BOS (restarting at every packed segment) and is
scored at every real target token. Scheduled sampling (`scheduled_sampling`) is its option:
a second decoder pass where a scheduled fraction of the gold inputs is replaced by the first
pass's predictions (rate 0 is teacher forcing).

    objective = NextToken(bos_id=2, encoder_decoder=True, label_smoothing=0.1)
    task = objective.prepare(batch, key=key, row_ids=rows)     # targets, weights
    sums = objective.loss_sums(model, params, batch, task, dropout_rng=k1, sample_rng=k2,
                               step=step, train=True)

With `decodes` (translation: the data have references), each evaluation also decodes
validation examples (greedy, and beam search) and scores them by exact match and BLEU, and
the final one the test split (`train.evaluate`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
from jax import lax

from models.errors import UserError
from train import chunked_loss
from train.objectives import moe_terms
from train.objectives.base import Objective
from train.objectives.scheduled_sampling import ScheduledSampling, mix_predictions


def shift_right(targets_BT, positions_BT, segmentation_BT, bos_id: int):
    """Decoder inputs: each segment's targets moved one right behind BOS (packing aware).

        targets       [a1 a2 EOS b1 EOS 0]
        positions     [ 0  1  2   0  1  0]
        decoder input [BOS a1 a2 BOS b1 0]
    """
    shifted = jnp.pad(targets_BT, ((0, 0), (1, 0)))[:, :-1]
    inputs = jnp.where(positions_BT == 0, bos_id, shifted)
    return jnp.where(segmentation_BT > 0, inputs, 0)


def forward(model, params, batch, decoder_inputs, *, dropout_rng, deterministic: bool,
            mutable=False, method=None):
    """Teacher-forced logits `[B, T, V]` for either generative family, segments respected;
    with `mutable` collections (`moe_terms.COLLECTIONS`), (logits, those collections).
    `method="hidden"`: the last hidden states `[B, T, D]` instead of the logits."""
    rngs = None if deterministic else {"dropout": dropout_rng}
    if model.config.is_encoder_decoder:
        return model.apply({"params": params}, batch["inputs"], decoder_inputs,
                           src_segment_ids=batch["inputs_segmentation"],
                           tgt_segment_ids=batch["targets_segmentation"],
                           src_positions=batch["inputs_position"],
                           tgt_positions=batch["targets_position"],
                           deterministic=deterministic, rngs=rngs, mutable=mutable,
                           method=method)
    return model.apply({"params": params}, decoder_inputs,
                       segment_ids=batch["targets_segmentation"],
                       positions=batch["targets_position"], deterministic=deterministic,
                       rngs=rngs, mutable=mutable, method=method)


@dataclasses.dataclass(frozen=True)
class NextToken(Objective):
    """Teacher forcing (see the module docstring).

    Attributes:
        bos_id: the start token every segment's decoder input begins with.
        encoder_decoder: the model reads `inputs` (sources) too.
        label_smoothing, z_loss: the training loss's (`train.losses.cross_entropy`).
        loss_chunks: 0, or the loss in this many slices of the sequence without the whole
            logits (`train.chunked_loss`; scheduled sampling's first pass, which has no
            gradient, still makes them).
        scheduled_sampling: the second pass's schedule (off by default).
        decodes: evaluations decode and score against references (translation).
        chat_template: chat data's template (`models.chat.ChatTemplate`): the pipeline
            renders the conversations with it, the rows carry `targets_weights` (1 on the
            assistant's tokens) and only those are scored; `bos_id` is then the
            template's start (`train.data.pipeline.chat_start_id`). None: text.
    """

    name = "next token"
    takes_scheduled_sampling = True
    takes_loss_chunks = True
    bos_id: int
    encoder_decoder: bool = False
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    loss_chunks: int = 0
    scheduled_sampling: ScheduledSampling = dataclasses.field(
        default_factory=ScheduledSampling)
    decodes: bool = False
    chat_template: Any = None
    reads_chat_template: ClassVar[bool] = True

    @classmethod
    def build(cls, model_config, tokenizer, settings, *, model_name: str,
              decodes: bool = False, chat: bool = False, chat_template=None) -> NextToken:
        if chat:
            if chat_template is None:
                raise UserError(f"model {model_name!r} has no chat template (its directory's "
                                "chat_template.jinja or tokenizer_config.json chat_template): "
                                "give one with chat_template=FILE")
            from train.data.pipeline.tokens import chat_start_id
            return cls(bos_id=chat_start_id(chat_template, tokenizer),
                       label_smoothing=settings.label_smoothing, z_loss=settings.z_loss,
                       loss_chunks=settings.loss_chunks,
                       scheduled_sampling=settings.scheduled_sampling,
                       chat_template=chat_template)
        if model_config.audio is not None:
            raise UserError(f"model {model_name!r} reads audio (a Whisper model): fine-tune "
                            "it on transcribed clips, dataset='local_speech'")
        if model_config.bos_id is None:
            raise UserError(f"model {model_name!r} has no start token (bos_id), which "
                            "teacher forcing puts first in every sequence")
        return cls(bos_id=int(model_config.bos_id),
                   encoder_decoder=model_config.is_encoder_decoder,
                   label_smoothing=settings.label_smoothing, z_loss=settings.z_loss,
                   loss_chunks=settings.loss_chunks,
                   scheduled_sampling=settings.scheduled_sampling, decodes=decodes)

    def pipeline_options(self) -> dict:
        return {"chat_template": self.chat_template} if self.chat_template is not None else {}

    def init_inputs(self, row: dict) -> tuple[tuple, str | None]:
        if self.encoder_decoder:
            return (row["inputs"], row["targets"]), None
        return (row["targets"],), None

    def prepare(self, batch: dict, *, key, row_ids) -> dict:
        """Every real target token scored; chat rows only where `targets_weights` is 1."""
        del key, row_ids
        weights = (batch["targets_segmentation"] > 0).astype(jnp.float32)
        if "targets_weights" in batch:
            weights = weights * batch["targets_weights"]
        return {"targets": batch["targets"], "weights": weights}

    def loss_sums(self, model, params, batch: dict, task: dict, *, dropout_rng, sample_rng,
                  step, train: bool) -> dict:
        """One teacher-forced pass (two under scheduled sampling while training)."""
        positions, segmentation = batch["targets_position"], batch["targets_segmentation"]
        dec_in = shift_right(batch["targets"], positions, segmentation, self.bos_id)
        if self.scheduled_sampling.enabled and train:
            first = forward(model, params, batch, dec_in, dropout_rng=dropout_rng,
                            deterministic=False)
            dec_in = mix_predictions(dec_in, lax.stop_gradient(first), positions,
                                     segmentation, rate=self.scheduled_sampling.rate(step),
                                     rng=sample_rng)
        routed = moe_terms.collects(model.config)
        out = forward(model, params, batch, dec_in, dropout_rng=dropout_rng,
                      deterministic=not train,
                      mutable=moe_terms.COLLECTIONS if routed else False,
                      method="hidden" if self.loss_chunks else None)
        out, router = out if routed else (out, None)
        sums = self.token_sums(model, params, out, task, train=train)
        if routed:                # a mixture of experts: its router's terms (moe_terms)
            sums = moe_terms.add_router_terms(sums, model.config, router, task["weights"],
                                              train=train)
        return sums

    def token_sums(self, model, params, out, task: dict, *, train: bool) -> dict:
        """The token loss's sums of `out`: the logits, or with `loss_chunks` the last
        hidden states, which the head scores slice by slice (`train.chunked_loss`)."""
        return chunked_loss.token_sums(
            model, params, out, task["targets"], task["weights"], chunks=self.loss_chunks,
            label_smoothing=self.label_smoothing if train else 0.0, z_loss=self.z_loss)

    def evaluate(self, run, state, *, final: bool) -> tuple[dict, dict | None]:
        """Decoded scores: greedy (and beam search, on up to 100 examples) on
        `num_eval_decode` validation examples, with `show_examples` triples printed; at the
        end greedy and beam search (`beam_*`) on `num_test_decode` test examples. Nothing
        without `decodes`."""
        settings, data, ds = run.config.evaluation, run.config.data, run.dataset
        validating = self.decodes and settings.num_eval_decode
        testing = (final and self.decodes and settings.num_test_decode
                   and data.test_split in ds.splits)
        if not (validating or testing):
            return {}, None
        from train import evaluate
        host_params = run.wrapper.host_state(state).model_params    # a collective when sharded

        def decoded(split: str, n: int, beam: bool):
            return evaluate.decoded_metrics(
                run.model, host_params, run.tokenizer, ds, split=split, n=n,
                request=evaluate.decode_request(settings, run.choice, beam=beam),
                metric=settings.metric, max_source_length=data.max_source_length)

        val = {}
        if validating:
            greedy, triples = decoded(data.eval_split, settings.num_eval_decode, False)
            val.update(greedy)
            if evaluate.decode_request(settings, run.choice, beam=True).strategy == "beam":
                beam, _ = decoded(data.eval_split, min(settings.num_eval_decode, 100), True)
                val.update({f"beam_{k}": v for k, v in beam.items()})
            if run.lead:
                for s, r, h in triples[:settings.show_examples]:
                    print(f"  source:     {s}\n  reference:  {r}\n  hypothesis: {h}",
                          flush=True)
        test = None
        if testing:
            test = decoded(data.test_split, settings.num_test_decode, False)[0]
            if evaluate.decode_request(settings, run.choice, beam=True).strategy == "beam":
                beam, _ = decoded(data.test_split, settings.num_test_decode, True)
                test.update({f"beam_{k}": v for k, v in beam.items()})
        return val, test

