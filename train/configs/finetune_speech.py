"""Fine-tune a Whisper model directory on your own transcribed audio.

    python -m train --config finetune_speech --workdir runs/ft-speech \\
        --config.init_from=path/to/whisper-tiny --config.language=en \\
        --config.data_files=train.tsv,validation.tsv

Each `.tsv` line is `audio_path<TAB>transcript`, the path relative to the TSV's folder (WAV,
FLAC or what else libsndfile reads; read as 16 kHz mono, at most 30 s a clip). Two files
are train and validation (which is the test split too), three train, validation, test; a
bad line or clip stops the run naming its file and line (`train.data.speech`).

The run starts from the directory's weights, tokenizer and generation_config.json. Each
transcript becomes the decoder's targets behind Whisper's prompt (<|startoftranscript|>,
the language, the task, <|notimestamps|>; `language` and `task` "" take the checkpoint's
defaults, and a multilingual checkpoint needs a language), scored from the first
transcript token to <|endoftext|> (`train.objectives.speech` says which positions and
why). One clip a row (`packing` must stay False); the features (log-mel, 30 s windows)
are computed on the host for each batch. `freeze_encoder=True` trains the decoder alone:
the audio encoder, front end included, keeps its weights bit for bit and has no optimiser
state. Evaluations report the validation loss beside greedy transcriptions' word and
character error rates (`wer`, `cer`, jiwer's; texts as written), and print a few
reference / hypothesis pairs. The export (WORKDIR/model) is a Whisper directory again:
`models.load` and `decode.whisper.transcribe` read it, and so does transformers.

What to expect, measured on a 2-core CPU shared with other jobs: a tiny random Whisper
(1 + 1 layers, d_model 32, 16 mel bins, a 1.28 s window; the README's Whisper section
builds it) on the six espeak-ng clips of tests/data/speech (validation.tsv repeats three
training clips, so this measures fitting, not generalisation), one device, at
--config.num_train_steps=200 --config.learning_rate=3e-3 --config.warmup_steps=10
--config.per_device_batch_size=3 --config.eval_per_device_batch_size=3
--config.max_target_length=16 --config.max_decode_length=12 --config.eval_every_steps=100:
validation loss 5.70 at step 0 (WER 1.0), 0.57 at step 100 and 0.19 at step 200, WER and
CER 0 from step 100 on; 44 s of training (55 s for the command). With freeze_encoder=True
(the random encoder kept) the same run trains in 31 s and reaches a loss of 0.60 but WER
1.0: a frozen encoder must already hear. Real checkpoints (whisper-tiny and up, a learning
rate of 1e-5 as in the Hugging Face recipe) want a GPU. Runs under `parallel=pmap` (the
default), `shard_map` and `sharded`: checked by hand on the tiny model to give the same
losses and WER with a frozen encoder, and to resume exactly.
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.init_from = ""                    # required: a Whisper model directory
    c.dataset = "local_speech"
    c.language = ""                     # "" = the checkpoint's default; e.g. "en", "fr"
    c.task = ""                         # "" = the checkpoint's default; or "transcribe"
    c.freeze_encoder = False
    c.packing = False                   # one clip a row
    c.max_target_length = 128           # prompt + transcript tokens + <|endoftext|>
    c.max_source_length = 2             # unread: the encoder reads features, not tokens
    c.max_decode_length = 128
    c.per_device_batch_size = 8
    c.eval_per_device_batch_size = 8
    c.num_train_steps = 2000
    c.learning_rate = 1e-5
    c.warmup_steps = 200
    c.lr_decay = "cosine"
    c.weight_decay = 0.0
    c.label_smoothing = 0.0
    c.grad_clip_norm = 1.0
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 500
    c.num_eval_decode = 200
    c.num_test_decode = 500
    c.show_examples = 3
    return c
