"""Fine-tuning a model directory: a tiny random GPT-2 made by transformers, with its own
byte-level BPE tokenizer, trained with `init_from` on local text; its export decodes and
loads back into transformers with the same logits."""

import os

import jax
import numpy as np
import pytest

import decode.__main__ as decode_cli
import models
from tests.train_helpers import tiny_train_config
from train.trainer import train_and_evaluate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WORDS = "the cat sat on a mat and saw one dog run to its home by the sea".split()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2 and a byte-level BPE tokenizer trained in memory, saved as a hub
    checkpoint would be; and a text file to fine-tune on."""
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    root = tmp_path_factory.mktemp("finetune")
    lines = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5 + i % 6))
             for i in range(200)]
    backend = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<unk>")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    model_dir = root / "gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    book = root / "book.txt"
    book.write_text("\n".join(lines) + "\n")
    return str(model_dir), str(book)


def _finetune_config(data_dir, gpt2_dir, steps):
    model_dir, book = gpt2_dir
    c = tiny_train_config(data_dir, init_from=model_dir, dataset="local_text",
                          data_files=book, num_train_steps=steps, learning_rate=3e-3,
                          lr_decay="constant", warmup_steps=1, label_smoothing=0.0,
                          max_source_length=32, max_target_length=32, max_decode_length=32,
                          eval_per_device_batch_size=8, checkpoint_every_steps=1000)
    c.model_overrides = type(c.model_overrides)()        # the directory's model, as it is
    return c


def test_finetuning_lowers_the_loss_and_the_export_decodes_and_loads_in_transformers(
        data_dir, gpt2_dir, tmp_path, capsys):
    untouched = train_and_evaluate(_finetune_config(data_dir, gpt2_dir, 0),
                                   str(tmp_path / "zero"))
    tuned = train_and_evaluate(_finetune_config(data_dir, gpt2_dir, 12), str(tmp_path / "ft"))
    assert tuned["validation"]["loss"] < untouched["validation"]["loss"] - 0.5
    # The export: the directory's own type and tokenizer, new weights.
    export = tuned["model"]
    pre = models.load(export)
    assert pre.model_type == "gpt2" and pre.tokenizer is not None
    assert pre.tokenizer.encode("the cat") == models.load(gpt2_dir[0]).tokenizer.encode("the cat")
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager")
    ids = np.array([pre.tokenizer.encode("the cat sat on a mat")])
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(pre.model.apply({"params": pre.params}, ids))
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    capsys.readouterr()
    assert decode_cli.main(["--model", export, "--max-new-tokens", "6", "the cat", "a dog"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert len(out) == 3 and out[2] == "" and all(set(line) <= set("abcdefghijklmnopqrstuvwxyz ")
                                                   for line in out[:2])
    assert os.path.exists(os.path.join(export, "tokenizer.json"))
