"""Masked-LM pretraining of an encoder-only model (BERT's objective): on the built-in
toy_text sentences, or on your own text.

    python -m train --config mlm --workdir runs/mlm
    python -m train --config mlm --workdir runs/mlm-mine \\
        --config.dataset=local_text --config.data_files=book.txt
    python -m decode --model runs/mlm/model --fill-mask "the [MASK] sees a cat ."

Each step chooses mlm_rate (15%) of the real, non-special tokens of every row; of those
mlm_mask_fraction (80%) become [MASK], mlm_random_fraction (10%) a random token, the rest
stay. The loss is the cross-entropy at the chosen tokens only, over their global count, and
the choice is a pure function of the step's key and each row's global index (a resumed run,
and 1 or 4 devices, draw the same masks). Evaluation masks every validation example the
same way each time, so its masked-token loss and accuracy are comparable across
evaluations. The model is a `bert-tiny` shrunk to D 128, 2 layers, reading sentencepiece
BPE pieces (with a [MASK] piece) in `<s> ... </s>`; the export reads `--fill-mask` and is
what `--config classify --config.init_from=runs/mlm/model` fine-tunes.

Measured on 2 CPU cores: the validation masked-token loss falls from 6.93 (chance over
1024 pieces) to 3.20 at step 300 and 3.04 at step 600 (masked-token accuracy 0.229 and
0.245: the toy grammar draws its nouns and adjectives freely, so a masked one is a guess
among many; a masked verb or determiner is not), in 79 s of training (90 s for the whole
command, data and tokenizer included).
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.model = "bert-tiny"
    c.model_overrides.dropout_rate = 0.0
    c.model_overrides.attention_dropout_rate = 0.0
    c.dataset = "toy_text"
    c.tokenizer = "sentencepiece"
    c.spm_model_type = "bpe"
    c.vocab_size = 1024
    c.max_source_length = 64
    c.max_target_length = 64
    c.max_decode_length = 63
    c.per_device_batch_size = 32
    c.num_train_steps = 600
    c.learning_rate = 2e-3
    c.warmup_steps = 60
    c.lr_decay = "cosine"
    c.weight_decay = 0.01
    c.label_smoothing = 0.0
    c.eval_every_steps = 300
    c.checkpoint_every_steps = 300
    c.log_every_steps = 50
    c.num_eval_decode = 0
    c.num_test_decode = 0
    return c
