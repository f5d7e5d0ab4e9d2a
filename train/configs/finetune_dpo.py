"""Preference-train a decoder-only model directory (GPT-2, Llama, Mistral, Qwen2, Gemma, or a
run's export) on (prompt, chosen, rejected) pairs: DPO, IPO or SimPO (`dpo.loss`).

    python -m train --config finetune_dpo --workdir runs/dpo \\
        --config.init_from=path/to/model --config.data_files=pairs.jsonl

`pairs.jsonl` holds one `{"prompt": ..., "chosen": ..., "rejected": ...}` object a line
(a bad line is skipped, counted and named with its file:line); one file is split 90/5/5 by
a hash of the prompt, three files are train/validation/test. The built-in
`--config.dataset=addition_preference` prefers each sum to a near miss.

The reference the loss compares with is the model the run starts from: with LoRA
(`--config.lora.rank=8`), the frozen base itself (adapters off: no second copy of the
weights), and the run exports PEFT adapters; in full fine-tuning, a frozen copy kept in
the train state (not in checkpoints: a resumed run reads `init_from` again), and the run
exports the whole model in its own model type. SimPO (`--config.dpo.loss=simpo`) needs no
reference.

Each evaluation prints the validation pairs' preference accuracy (`accuracy`: the share
whose chosen response has the higher reward), `reward_chosen`, `reward_rejected`,
`reward_margin` and the responses' log-probs. At step 0 the policy is its reference, so
the sigmoid loss is log 2 = 0.693 and every reward 0.
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.init_from = ""                    # required: the model directory to start from
    c.dataset = "local_preference"
    c.packing = False                   # a row holds one prompt and its two responses
    c.max_source_length = 64            # the prompt, EOS included
    c.max_target_length = 64            # each response, EOS included
    c.max_decode_length = 64
    c.per_device_batch_size = 8
    c.eval_per_device_batch_size = 8
    c.num_train_steps = 200
    c.learning_rate = 5e-6
    c.warmup_steps = 20
    c.lr_decay = "cosine"
    c.weight_decay = 0.0
    c.label_smoothing = 0.0
    c.grad_clip_norm = 1.0
    c.eval_every_steps = 50
    c.checkpoint_every_steps = 50
    c.num_eval_decode = 0
    c.num_test_decode = 0
    c.dpo.loss = "sigmoid"
    c.dpo.beta = 0.1
    return c
