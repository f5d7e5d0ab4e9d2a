"""A decoder-only language model (gpt2-small shapes) on LM1B, for GPU/TPU machines.

    python -m train --config lm1b --workdir runs/lm1b

Needs the `tfds-prepare` extra (TFDS calls TensorFlow while preparing lm1b) and a download.
Reports validation loss and perplexity (LM1B has no validation split: its test split is used).
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.model = "gpt2-small"
    c.dataset = "lm1b"
    c.tokenizer = "sentencepiece"
    c.vocab_size = 32_000
    c.max_target_length = 128
    c.max_source_length = 128
    c.max_decode_length = 128
    c.dtype = "bfloat16"
    c.per_device_batch_size = 64
    c.num_train_steps = 100_000
    c.learning_rate = 1e-3
    c.lr_decay = "cosine"
    c.warmup_steps = 2000
    c.weight_decay = 0.1
    c.label_smoothing = 0.0
    c.eval_every_steps = 5000
    c.checkpoint_every_steps = 5000
    c.num_eval_decode = 0
    c.num_test_decode = 0
    c.data_workers = 4
    return c
