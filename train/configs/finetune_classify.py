"""Fine-tune an encoder-only model directory (BERT, RoBERTa, or a run's `mlm` / `classify`
export) to classify your own labelled text, with the model's own tokenizer.

    python -m train --config finetune_classify --workdir runs/ft-cls \\
        --config.init_from=path/to/bert --config.data_files=train.tsv,dev.tsv,test.tsv

Each line of a `.tsv` file is `text<TAB>label`; labels are names, or integers 0..C-1
(one file is split 90/5/5 by hash, three are train/validation/test; malformed lines are
counted and reported). Each text is read as the tokenizer's model input (BERT's `[CLS] x
[SEP]`, RoBERTa's `<s> x </s>`) and the classifier reads the first token. A masked-LM (or
base-model) directory gets a new classifier of the data's labels, in sorted order, and a
warning names the head it replaces; a classifier directory must have as many labels as
the data (an error names both counts), and its own label names fix the class order (a
data label it does not name is an error). Evaluation reports loss, accuracy and each
label's F1; the export keeps the label names (config.json's id2label), so `python -m
decode --model runs/ft-cls/model --classify "some text"` prints them, and transformers'
BertForSequenceClassification loads it.

What to expect: tests/test_train_encoder_runs.py fine-tunes a 1-layer masked-LM export on
three labels for 2 steps (a few seconds); bert-base at these settings wants a GPU.
"""

from train.configs._base import base_config


def get_config():
    c = base_config()
    c.init_from = ""                    # required: the model directory to start from
    c.dataset = "local_classification"
    c.max_source_length = 128
    c.max_target_length = 128
    c.max_decode_length = 127
    c.per_device_batch_size = 16
    c.num_train_steps = 1000
    c.learning_rate = 3e-5
    c.warmup_steps = 100
    c.lr_decay = "cosine"
    c.weight_decay = 0.01
    c.label_smoothing = 0.0
    c.eval_every_steps = 200
    c.checkpoint_every_steps = 200
    c.num_eval_decode = 0
    c.num_test_decode = 0
    return c
