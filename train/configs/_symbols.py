"""The shared shape of the generated symbol-task configs (copy, reverse, sort, addition)."""

from train.configs.default import get_config as default_config


def symbol_task_config(task: str, max_source_length: int = 24, max_target_length: int = 24):
    """The default model on `task`, with bytes as tokens, scored by exact match."""
    c = default_config()
    c.dataset = task
    c.tokenizer = "byte"
    c.max_source_length = max_source_length
    c.max_target_length = max_target_length
    c.max_decode_length = max_target_length
    c.metric = "exact_match"
    c.num_train_steps = 2000
    return c
