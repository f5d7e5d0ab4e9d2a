"""Sequence-level fine-tuning of an encoder-decoder: minimum risk training (or self-critical
REINFORCE) from a teacher-forced model, on your own parallel text or any translation
dataset.

    python -m train --config finetune_sequence --workdir runs/mrt \\
        --config.init_from=runs/default/model --config.dataset=toy_translation
    python -m train --config finetune_sequence --workdir runs/scst \\
        --config.init_from=path/to/opus-mt-en-de --config.dataset=local_translation \\
        --config.data_files=train.tsv,test.tsv --config.sequence.objective=scst

`init_from` is a run's export (WORKDIR/model) or any encoder-decoder model directory (Marian,
BART, T5); the run keeps its tokenizer and special ids, as finetune_translation does. Each
step draws `sequence.candidates` samples per source from the current parameters, scores
them against the reference with `sequence.reward` (sentence chrF here: on short sentences it
is smoother than sentence BLEU) and minimises their expected cost under p ** alpha
renormalised over the distinct candidates (`sequence.include_gold` adds the reference as a
candidate). `sequence.loss_weight` mixes in teacher forcing (0.3 of each target token's
loss here keeps the model near its references while it learns from its samples).
Training rows hold one example each (packing off). Logged each `log_every_steps`: the
candidates' mean `reward` and the `risk`; evaluations decode and score BLEU as
finetune_translation's do. The fine-tuned model is exported to WORKDIR/model.

What to expect: the reward rises over the first hundred steps on a model that already
translates (a model that does not, draws no candidate worth raising: start from a
teacher-forced run). Sampling K candidates of up to `max_new_tokens` tokens and scoring
them on the host makes a step several times a teacher-forced one; tests/
test_sequence_objectives.py runs a few steps of this config after a 6-step `copy` run.
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.init_from = ""                    # required: the model directory to start from
    c.dataset = "local_translation"
    c.packing = False                   # one example per row: its candidates, its reference
    c.max_source_length = 64
    c.max_target_length = 64
    c.max_decode_length = 64
    c.per_device_batch_size = 8
    c.num_train_steps = 500
    c.learning_rate = 1e-5
    c.warmup_steps = 20
    c.lr_decay = "constant"
    c.label_smoothing = 0.0
    c.grad_clip_norm = 1.0
    c.eval_every_steps = 100
    c.checkpoint_every_steps = 100
    c.num_eval_decode = 100
    c.num_test_decode = 500
    c.eval_per_device_batch_size = 16
    c.metric = "bleu"
    c.sequence.objective = "mrt"
    c.sequence.candidates = 8
    c.sequence.alpha = 0.005
    c.sequence.reward = "chrf"
    c.sequence.include_gold = False
    c.sequence.sampling = "sample"
    c.sequence.temperature = 1.0
    c.sequence.max_new_tokens = 64
    c.sequence.loss_weight = 0.7
    return c
