"""Speech recognition: a Whisper model fine-tuned on transcribed clips (`local_speech`), as
the field fine-tunes it (the Hugging Face recipe, OpenAI's prompt).

Each row is one clip: its log-mel features are the encoder's input (`inputs`, made on the
host by the pipeline) and its transcript the decoder's targets, behind the decoder prompt
that `decode.whisper.transcribe` gives the same model (`decoder_prompts`: the checkpoint's
generation_config.json with this run's `language` and `task`):

    prompt          <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>
    targets         <|en|> <|transcribe|> <|notimestamps|> hello  world  <|endoftext|>
    decoder input   <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|> hello world
    position        0      1      2      3      4      5
    weight          0      0      0      1      1      1

Scored positions: those whose input has reached the end of the prompt (position >= P - 1
for a prompt of P tokens), i.e. the transcript's tokens and the end token. The positions
predicting the language, the task and <|notimestamps|> are not scored: decoding forces
them (they are given, never predicted), so a loss there would only teach the model to
guess this data's one language and task, which would bias its language detection and
spends nothing on transcribing. An English-only checkpoint's prompt is
<|startoftranscript|> <|notimestamps|>: the first target, <|notimestamps|>, is unscored.

With `freeze_encoder` the encoder (its convolutional front end and its layers: the
parameters `src_embed` and `encoder`) is read under `lax.stop_gradient` here, and the
optimiser gives those parameters zero updates and no state (`train.state.make_optimizer`'s
`frozen`): they stay bit for bit as loaded while the decoder (its embeddings, layers,
cross-attention and head) trains, and the backward pass never enters the encoder.

Evaluations decode validation clips greedily with `decode.whisper.transcribe` and score
word and character error rates (`wer`, `cer`, jiwer's, on the texts as written: case and
punctuation count) beside the validation loss; the final one scores the test split too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from models.errors import UserError
from train.objectives.next_token import NextToken, shift_right

ENCODER_PARTS = ("src_embed", "encoder")      # a Whisper's parameters that freeze_encoder fixes


@dataclasses.dataclass(frozen=True)
class Speech(NextToken):
    """Teacher forcing of transcripts behind Whisper's prompt (see the module docstring).

    Attributes:
        prompt: the decoder prompt, its start token first.
        language, task: what the prompt was built with (None: the checkpoint's default);
            evaluation decodes with the same.
        freeze_encoder: the encoder's parameters get no gradient (nor, in the optimiser,
            updates or state).
        audio: the model's `AudioInput` (its mel bins and window).
    """

    name = "speech recognition"
    takes_scheduled_sampling = False
    reads_generation: ClassVar[bool] = True
    prompt: tuple[int, ...] = ()
    language: str | None = None
    task: str | None = None
    freeze_encoder: bool = False
    audio: Any = None

    @classmethod
    def build(cls, model_config, tokenizer, settings, *, model_name: str,
              generation=None) -> Speech:
        """Raises:
            UserError: a model without an audio encoder, without generation defaults (the
                prompt's tokens), or multilingual with no language given.
        """
        if model_config.audio is None:
            raise UserError(f"speech data need a Whisper model (an audio encoder-decoder) as "
                            f"init_from; model {model_name!r} reads tokens")
        if generation is None:
            raise UserError(f"model {model_name!r} has no generation defaults "
                            "(generation_config.json), where Whisper's decoder prompt "
                            "(language, task, <|notimestamps|>) comes from; fine-tune a "
                            "Whisper directory (init_from)")
        from decode.whisper import WhisperSettings, decoder_prompts, needs_detection
        whisper = WhisperSettings.from_generation(generation, model_config)
        language = settings.language or whisper.language or None
        task = settings.task or whisper.task or None
        if needs_detection(whisper, language, task):
            raise UserError(f"language='' but model {model_name!r} is multilingual and its "
                            "generation_config.json names no language: set language (such "
                            "as language=en), the language of the transcripts")
        prompt = tuple(int(t) for t in decoder_prompts(whisper, 1, language=language,
                                                       task=task)[0])
        if tokenizer.eos_id not in whisper.eos_ids:
            raise UserError(f"the tokenizer's end token {tokenizer.eos_id} is not one of the "
                            f"model's {list(whisper.eos_ids)}")
        return cls(bos_id=prompt[0], encoder_decoder=True,
                   label_smoothing=settings.label_smoothing, z_loss=settings.z_loss,
                   loss_chunks=settings.loss_chunks, decodes=True, prompt=prompt,
                   language=language, task=task,
                   freeze_encoder=settings.freeze_encoder, audio=model_config.audio)

    def pipeline_options(self) -> dict[str, Any]:
        """Transcripts behind the prompt (its start token is the decoder's BOS, added by
        `shift_right`); features in the model's window; one clip a row."""
        return {"target_prefix": self.prompt[1:], "audio": self.audio}

    def init_inputs(self, row: dict) -> tuple[tuple, str | None]:
        return (row["inputs"], row["targets"]), None

    def prepare(self, batch: dict, *, key, row_ids) -> dict:
        """Weights 1 at the transcript's tokens and the end token, 0 at the prompt's and at
        padding (see the module docstring)."""
        del key, row_ids
        scored = ((batch["targets_segmentation"] > 0)
                  & (batch["targets_position"] >= len(self.prompt) - 1))
        return {"targets": batch["targets"], "weights": scored.astype(jnp.float32)}

    def trained(self, params: dict) -> dict:
        """`params` with the encoder's parts behind `lax.stop_gradient` when frozen."""
        if not self.freeze_encoder:
            return params
        return {k: lax.stop_gradient(v) if k in ENCODER_PARTS else v for k, v in params.items()}

    def loss_sums(self, model, params, batch: dict, task: dict, *, dropout_rng, sample_rng,
                  step, train: bool) -> dict:
        """One teacher-forced pass over the rows' features. A row holds one clip and its
        transcript from position 0, so the decoder's causal mask alone keeps the padding
        after it out of sight (no segment ids: the audio encoder takes none)."""
        del sample_rng, step
        dec_in = shift_right(batch["targets"], batch["targets_position"],
                             batch["targets_segmentation"], self.bos_id)
        params = self.trained(params)
        out = model.apply({"params": params}, batch["inputs"], dec_in,
                          deterministic=not train,
                          rngs={"dropout": dropout_rng} if train else None,
                          method="hidden" if self.loss_chunks else None)
        return self.token_sums(model, params, out, task, train=train)

    def evaluate(self, run, state, *, final: bool) -> tuple[dict, dict | None]:
        """WER and CER of greedy transcriptions of `num_eval_decode` validation clips
        (`show_examples` reference / hypothesis pairs printed); at the end, of
        `num_test_decode` test clips."""
        from train.objectives import speech_eval
        settings, data, ds = run.config.evaluation, run.config.data, run.dataset
        testing = final and settings.num_test_decode and data.test_split in ds.splits
        if not (settings.num_eval_decode or testing):
            return {}, None
        params = run.wrapper.host_state(state).model_params     # a collective when sharded
        loaded = speech_eval.Loaded(run.model, jax.device_get(params), run.choice.config,
                                    run.choice.generation)

        def scored(split: str, n: int):
            return speech_eval.transcribed_scores(
                loaded, run.tokenizer, ds, split=split, n=n, language=self.language,
                task=self.task, max_new_tokens=settings.max_decode_length,
                batch_size=run.config.batch.eval_per_device_batch_size)

        val = {}
        if settings.num_eval_decode:
            val, pairs = scored(data.eval_split, settings.num_eval_decode)
            if run.lead:
                for ref, hyp in pairs[:settings.show_examples]:
                    print(f"  reference:  {ref}\n  hypothesis: {hyp}", flush=True)
        test = scored(data.test_split, settings.num_test_decode)[0] if testing else None
        return val, test
