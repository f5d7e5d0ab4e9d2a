"""Fine-tune a model directory with low-rank adapters (LoRA): the weights stay frozen in
bfloat16, and only small adapters beside the attention and MLP projections train, with
optimiser state for them alone. For a model whose full fine-tuning does not fit one device
(float32 weights, gradients and two adam moments: 16 bytes a parameter).

    python -m train --config finetune_lora --workdir runs/lora \\
        --config.init_from=path/to/llama --config.dataset=local_text \\
        --config.data_files=book.txt [--config.lora.rank=16] [--config.lora.targets=query,value]

Any generative model directory works (decoder-only with local_text, an encoder-decoder with
--config.dataset=local_translation and tab-separated pairs). The run exports runs/lora/adapter
in PEFT's layout (`peft.PeftModel.from_pretrained(model, "runs/lora/adapter")` reads it),
naming init_from as its base; `--config.lora.export_merged=true` also writes runs/lora/model,
the adapters merged. Decode without merging:

    python -m decode --model runs/lora/adapter "Once upon a time"      # base from the adapter
    python -m decode --model path/to/llama --adapter runs/lora/adapter "Once upon a time"

Targets: "self_attention" and "mlp" (every projection of both, QLoRA's choice) by default;
name single projections as query, key, value, out, gate, up, down, or scoped ones as
cross_attention.value, decoder.mlp.down (see models/lora.py). The learning rate is higher than
full fine-tuning's (2e-4 against 5e-5): the adapters start at zero and are few.

What to expect: see the README's "Fine-tuning large models" (a tiny random Llama made in the
example, its loss falling, the adapters decoding and loading in PEFT).
"""

from train.configs.finetune_lm import get_config as finetune_lm


def get_config():
    c = finetune_lm()
    c.lora.rank = 16
    c.lora.alpha = 32.0
    c.lora.dropout = 0.05
    c.lora.targets = "self_attention,mlp"
    c.lora.base_dtype = "bfloat16"
    c.learning_rate = 2e-4
    c.weight_decay = 0.0
    return c
