"""Transformer-base (Vaswani et al. 2017) on WMT14 English->German, for GPU/TPU machines.

    python -m train --config wmt14_ende_base --workdir runs/wmt14_ende_base

Needs a machine that can download wmt14_translate/de-en through TFDS (prepared once into the
TFDS data dir). A 32k shared sentencepiece vocabulary, packing to 256 tokens, rsqrt decay,
label smoothing 0.1, bfloat16 compute. The paper reports 27.3 BLEU (newstest2014) after
100k steps of 25k source + 25k target tokens on 8 P100s; expect a similar BLEU from sacrebleu
on detokenised output after a comparable number of tokens.
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.model = "transformer-base"
    c.dataset = "wmt14_translate/de-en"
    c.reverse_translation = True          # the TFDS pair is (de, en): read it as en -> de
    c.tokenizer = "sentencepiece"
    c.vocab_size = 32_000
    c.max_source_length = 256
    c.max_target_length = 256
    c.max_decode_length = 256
    c.dtype = "bfloat16"
    c.per_device_batch_size = 64
    c.num_train_steps = 100_000
    c.learning_rate = 7e-4
    c.lr_decay = "rsqrt"
    c.warmup_steps = 4000
    c.label_smoothing = 0.1
    c.eval_every_steps = 5000
    c.checkpoint_every_steps = 5000
    c.eval_per_device_batch_size = 32
    c.num_eval_decode = 3000
    c.num_test_decode = 3003
    c.metric = "bleu"
    c.data_workers = 4
    return c
