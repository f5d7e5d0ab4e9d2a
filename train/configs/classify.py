"""Sentence classification with an encoder-only model, from scratch on the built-in
toy_classification task (`finetune_classify` starts from a model directory instead).

    python -m train --config classify --workdir runs/classify

toy_classification asks whether a generated sentence's verb agrees in number with its
subject ("the dogs see a cat ." against "the dogs sees a cat ."): grammatical or
ungrammatical, 50/50, with no single word that gives the label away. The model is a
`bert-tiny` shrunk to D 64, 2 layers, reading sentencepiece BPE pieces wrapped in
`<s> ... </s>`, the classifier reading `<s>`'s state; examples are packed, each labelled at
its first position. The run evaluates loss, accuracy and each label's F1 (and their mean,
macro_f1) on validation, and on the test split at the end, and exports a classifier that
`python -m decode --model runs/classify/model --classify "the dogs sees a cat ."` reads.

Measured on 2 CPU cores: validation accuracy 0.518 at step 200 (the agreement is found
between steps 200 and 300), then test accuracy 0.992 and macro F1 0.992 after 400 steps,
in 22 s of training (33 s for the whole command, data and tokenizer included).
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.model = "bert-tiny"
    c.model_overrides.d_model = 64
    c.model_overrides.num_heads = 2
    c.model_overrides.mlp_dim = 256
    c.model_overrides.dropout_rate = 0.0
    c.model_overrides.attention_dropout_rate = 0.0
    c.dataset = "toy_classification"
    c.tokenizer = "sentencepiece"
    c.spm_model_type = "bpe"
    c.vocab_size = 1024
    c.max_source_length = 64
    c.max_target_length = 64
    c.max_decode_length = 63
    c.per_device_batch_size = 32
    c.num_train_steps = 400
    c.learning_rate = 3e-3
    c.warmup_steps = 40
    c.lr_decay = "cosine"
    c.weight_decay = 0.01
    c.label_smoothing = 0.0
    c.eval_every_steps = 200
    c.checkpoint_every_steps = 200
    c.log_every_steps = 50
    c.num_eval_decode = 0
    c.num_test_decode = 0
    return c
