"""Fine-tune an encoder-decoder model directory (Marian, BART, T5, or a run's export) on
your own parallel text, with the model's own tokenizer and special ids.

    python -m train --config finetune_translation --workdir runs/ft-mt \\
        --config.init_from=path/to/opus-mt-en-de --config.dataset=local_translation \\
        --config.data_files=train.tsv,test.tsv

The run starts from the directory's weights and config (its pad, end and decoder start
ids: Marian starts the decoder with its pad id), trains no tokenizer, and encodes each
source with the source side of the directory's tokenizer and each target with its target
side (Marian's source.spm and target.spm), each in the tokenizer's own template and ending
in the end token (BART's `<s> x </s>`, Marian's and T5's `x </s>`), exactly as transformers'
`tokenizer(source, text_target=target)` does. Examples are packed, the loss is label
smoothed, and a stopped run resumes exactly like any other. Decoded evaluations (BLEU)
use the directory's decoding defaults from generation_config.json: its beam count, length
penalty (with transformers' length normalisation), forced and banned ids, and end ids.
The fine-tuned model is exported to runs/ft-mt/model in the directory's own model type,
with its tokenizer and generation config, so `models.load`, `python -m decode --model
runs/ft-mt/model` and transformers all read it. A model of many languages (NLLB-200,
M2M-100, mBART-50) takes the pair by its tokenizer's codes, `--config.source_lang=eng_Latn
--config.target_lang=spa_Latn`: each side encoded as transformers' tokenizer does with
src_lang / tgt_lang, and the target's code forced first in evaluation and in the export.
A `.tsv` file holds source TAB target per
line; two files are train and test (the test file is the validation split too), three are
train/validation/test, one is split 90/5/5 by line hash.

What to expect: the loss falls from the first steps and BLEU rises from the starting
model's. Measured on a 2-core CPU shared with other jobs, with a tiny random MarianMTModel
(2+2 layers, d_model 32; source and target sentencepiece models of 32 and 34 pieces behind
one 49-id vocab.json; generation_config.json with 2 beams, pad banned, the end forced),
200 generated sentence pairs in train.tsv and 16 in test.tsv, at
--config.num_train_steps=300 --config.learning_rate=3e-3 --config.warmup_steps=20
--config.per_device_batch_size=8 --config.max_source_length=24
--config.max_target_length=24 --config.max_decode_length=24 --config.eval_every_steps=100:
300 steps in 33 s of training (42 s for the whole command); validation loss 4.28 at the
start (the same command at num_train_steps=0) and 0.72 at the end; BLEU 0.2 -> 50.7
greedy, 0.6 -> 48.5 with the directory's beam search (tests/test_finetune.py runs a
40-step version). opus-mt models at the defaults here want a GPU.
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.init_from = ""                    # required: the model directory to start from
    c.dataset = "local_translation"
    c.max_source_length = 128
    c.max_target_length = 128
    c.max_decode_length = 128
    c.per_device_batch_size = 8
    c.num_train_steps = 1000
    c.learning_rate = 5e-5
    c.warmup_steps = 100
    c.lr_decay = "cosine"
    c.weight_decay = 0.01
    c.label_smoothing = 0.1
    c.grad_clip_norm = 1.0
    c.eval_every_steps = 200
    c.checkpoint_every_steps = 200
    c.num_eval_decode = 100
    c.num_test_decode = 500
    c.eval_per_device_batch_size = 16
    c.metric = "bleu"
    c.beam_size = 4                     # only where generation_config.json names no beams
    return c
