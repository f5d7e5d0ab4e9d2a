"""Translate your own parallel text: a small encoder-decoder trained for 6 minutes of wall
clock on TSV files (source TAB target), tuned on real sentence pairs on a 2-core CPU.

    python -m train --config translate_small --workdir runs/mine \\
        --config.data_files=train.tsv,validation.tsv,test.tsv

(two files are train and test, one is split 90/5/5 by line hash: `local_translation`).
Training stops after `max_train_seconds` (360) or `num_train_steps`, whichever comes first;
the learning rate decays as rsqrt after its warm-up, so a run cut short by the clock on a
slower machine is as well trained as its steps allow, and the model exported and scored at
the end is the mean of the last `average_last_checkpoints` checkpoints (a checkpoint every
`checkpoint_every_steps`). The same command again resumes and trains up to 6 minutes more.
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.dataset = "local_translation"
    c.model = "transformer-tiny"
    c.model_overrides.d_model = 128
    c.model_overrides.num_heads = 4
    c.model_overrides.mlp_dim = 512
    c.model_overrides.num_encoder_layers = 2
    c.model_overrides.num_decoder_layers = 2
    c.model_overrides.dropout_rate = 0.1
    c.tokenizer = "sentencepiece"
    c.spm_model_type = "bpe"
    c.vocab_size = 4000
    c.max_source_length = 48
    c.max_target_length = 48
    c.max_decode_length = 48
    c.per_device_batch_size = 32
    c.max_train_seconds = 360.0
    c.num_train_steps = 100_000        # the clock stops the run first
    c.learning_rate = 3e-3
    c.warmup_steps = 300
    c.lr_decay = "rsqrt"
    c.label_smoothing = 0.1
    c.checkpoint_every_steps = 100
    c.keep_checkpoints = 5
    c.average_last_checkpoints = 5
    c.eval_every_steps = 100_000       # one evaluation, at the end
    c.num_eval_decode = 200
    c.num_test_decode = 1000
    c.metric = "both"
    return c
