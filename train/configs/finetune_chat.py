"""Chat fine-tuning: a decoder-only model directory (Llama, Qwen2, Gemma, GPT-2, ... with a
chat template) on your conversations, in the model's own template, scored on the
assistant's tokens only.

    python -m train --config finetune_chat --workdir runs/chat \\
        --config.init_from=path/to/model --config.data_files=chats.jsonl
    python -m decode --model runs/chat/model --chat "What is the capital of France?"

`chats.jsonl` holds one `{"messages": [{"role": "system" | "user" | "assistant" | "tool",
"content": "..."}, ...]}` object a line (a bad line is skipped, counted and named with its
file:line; a conversation needs an assistant message). Each is rendered with the
directory's chat template (`chat_template.jinja`, or tokenizer_config.json's
`chat_template`) as transformers' `apply_chat_template` renders it, token for token; a
model without one takes `--config.chat_template=FILE`. The loss covers what each assistant
message adds to the text (its content and the template's end of turn), nothing else;
packed rows never let one conversation attend to another. With `--config.lora.rank=8` only
adapters train, exported in PEFT's layout.
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.init_from = ""                    # required: the model directory to start from
    c.dataset = "local_chat"
    c.max_target_length = 512           # a conversation, rendered, EOS included
    c.max_source_length = 512
    c.max_decode_length = 256
    c.per_device_batch_size = 4
    c.num_train_steps = 500
    c.learning_rate = 2e-5
    c.warmup_steps = 50
    c.lr_decay = "cosine"
    c.weight_decay = 0.01
    c.label_smoothing = 0.0
    c.grad_clip_norm = 1.0
    c.eval_every_steps = 100
    c.checkpoint_every_steps = 100
    c.num_eval_decode = 0
    c.num_test_decode = 0
    return c
