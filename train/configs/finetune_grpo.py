"""GRPO: a decoder-only model directory (or a run's export) learns from its own completions
to prompts whose answers a reward checks (`grpo.*`, `train.objectives.grpo`).

    python -m train --config finetune_grpo --workdir runs/grpo \\
        --config.init_from=path/to/model --config.data_files=problems.jsonl

`problems.jsonl` holds one `{"prompt": ..., "answer": ...}` object a line, with any other
fields a reward reads (a `module:function` taking a `fields` keyword gets each line's
object); a bad line is skipped, counted and named with its file:line. The built-in
`--config.dataset=addition_prompts` asks "a+b=" with the sum as the answer. Each step draws
`grpo.num_generations` completions a prompt from the current parameters (per-row keys
from the step key: a resumed run draws the same ones), scores them with `grpo.reward`
(`exact_match` against the answer, `number`, or your `module:function`), and moves each
group toward its better completions, with a KL penalty (`grpo.beta`) to the model the run
started from: with LoRA (`--config.lora.rank=8`) its frozen base, else a frozen copy kept
beside the weights. Each evaluation draws one greedy completion a validation prompt:
`reward` is then, with exact_match, the greedy accuracy.
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.init_from = ""                    # required: the model directory to start from
    c.dataset = "local_prompts"
    c.packing = False                   # a row holds one prompt; its completions are drawn
    c.max_source_length = 64            # the prompt, EOS included
    c.max_target_length = 32            # the answer, EOS included (read by the reward)
    c.max_decode_length = 32
    c.per_device_batch_size = 4         # prompts; each draws grpo.num_generations
    c.eval_per_device_batch_size = 16
    c.num_train_steps = 200
    c.learning_rate = 1e-5
    c.warmup_steps = 10
    c.lr_decay = "constant"
    c.weight_decay = 0.0
    c.label_smoothing = 0.0
    c.grad_clip_norm = 1.0
    c.eval_every_steps = 50
    c.checkpoint_every_steps = 50
    c.num_eval_decode = 0
    c.num_test_decode = 0
    c.grpo.num_generations = 4
    c.grpo.max_new_tokens = 16
    c.grpo.beta = 0.04
    return c
