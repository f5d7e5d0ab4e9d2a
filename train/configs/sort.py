"""The generated `sort` task with a byte tokenizer and the default tiny encoder-decoder.

    python -m train --config sort --workdir runs/sort

CPU-sized (2 cores, a few minutes); scored by exact match on the test split.
"""

from train.configs._symbols import symbol_task_config


def get_config():
    return symbol_task_config("sort")
