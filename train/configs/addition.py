"""The generated `addition` task with a byte tokenizer and a tiny encoder-decoder.

    python -m train --config addition --workdir runs/addition

CPU-sized (2 cores, a few minutes); scored by exact match on the test split.
"""

from train.configs.default import get_config as default_config


def get_config():
    c = default_config()
    c.dataset = "addition"
    c.tokenizer = "byte"
    c.max_source_length = 16
    c.max_target_length = 12
    c.max_decode_length = 12
    c.metric = "exact_match"
    c.num_train_steps = 2000
    return c
