"""T5Gemma beyond the shared encoder-decoder suite (tests/test_pretrained_seq2seq.py runs
its parity, cache, round-trip, greedy and beam tests on the "t5gemma" case): the encoder's
two-sided window, the chunked attention and a scanned stack of both layer kinds, the
sub-configs that one config cannot hold, refused by name, and the 2B-2B preset at
transformers' count."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.kernels import attend
from models.masks import MaskSpec
from models.pretrained import FAMILIES
from tests import pretrained_helpers as ph
from tests.helpers import fns
from tests.pretrained_helpers import copy_dir, edit_config

seq2seq_ckpt = ph.seq2seq_ckpt
highest_precision = ph.highest_precision


def test_an_encoders_sliding_layer_sees_both_sides_in_every_implementation():
    """Without `causal` the window is two-sided, |k - q| <= W (transformers' bidirectional
    sliding window); the chunked attention computes what the materialised one does."""
    index = jnp.arange(9)[None]
    spec = MaskSpec(index, index, window=2, q_valid=jnp.arange(9)[None] < 7,
                    k_valid=jnp.arange(9)[None] < 7)
    distance = np.abs(np.arange(9)[:, None] - np.arange(9)[None, :])
    valid = np.arange(9) < 7
    np.testing.assert_array_equal(spec.materialize()[0],
                                  (distance <= 2) & valid[:, None] & valid[None, :])
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(1, 9, 4, 8)), jnp.float32) for _ in range(3))
    xla, _, _ = attend(q, k, v, spec, impl="xla", scale=0.3)
    chunked, _, _ = attend(q, k, v, spec, impl="chunked", scale=0.3, block=4)
    np.testing.assert_allclose(chunked, xla, atol=1e-6)


def test_chunked_attention_and_a_scanned_stack_give_transformers_logits(
        seq2seq_ckpt, highest_precision):
    c = seq2seq_ckpt("t5gemma")
    for options in (dict(attention_impl="chunked", attention_block=4),
                    dict(scan_layers=True, remat=True)):
        pre = models.load(c.path, **options)
        logits = fns(pre.config).forward(pre.params, jnp.asarray(c.src), jnp.asarray(c.tgt_in),
                                         src_lengths=jnp.asarray(c.src_lens))
        np.testing.assert_allclose(logits, c.logits, atol=1e-4, rtol=0, err_msg=str(options))


def _stack(stack: str, **fields):
    def edit(cfg):
        cfg[stack].update(fields)
    return edit


REFUSED = [
    (_stack("decoder", hidden_size=48, cross_attention_hidden_size=32),
     ["encoder's d_model", "32", "decoder's value 48"]),
    (_stack("decoder", sliding_window=5), ["encoder's sliding_window", "3", "5"]),
    (_stack("encoder", num_hidden_layers=3, layer_types=["sliding_attention"] * 3),
     ["encoder.num_hidden_layers", "3", "decoder's 2"]),
    (_stack("decoder", cross_attention_hidden_size=48),
     ["cross_attention_hidden_size", "48", "encoder's width 32"]),
    (lambda cfg: cfg.update(tie_word_embeddings=False), ["tie_word_embeddings", "False"]),
    (lambda cfg: cfg.update(decoder_start_token_id=0),
     ["decoder_start_token_id", "bos_token_id=2"]),
    (_stack("encoder", use_bidirectional_attention=True), ["use_bidirectional_attention"]),
]


@pytest.mark.parametrize("edit,words", REFUSED, ids=[
    "unbalanced", "windows", "depths", "cross-width", "untied", "start", "gemma-flag"])
def test_sub_configs_one_config_cannot_hold_are_refused_by_name(edit, words, seq2seq_ckpt,
                                                                tmp_path):
    path = edit_config(copy_dir(seq2seq_ckpt("t5gemma").path, tmp_path / "m"), edit)
    ph.assert_refused_by_name(path, words)


def test_a_t5gemma_preset_at_the_published_size_has_transformers_parameter_count():
    """google/t5gemma-2b-2b's shape (gemma-2-2b's fields in both sub-configs)."""
    torch, transformers = ph.torch, ph.transformers
    stack = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                 num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=256, max_position_embeddings=8192, sliding_window=4096,
                 query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                 rms_norm_eps=1e-6)
    published = transformers.T5GemmaConfig(encoder=dict(stack), decoder=dict(stack),
                                           vocab_size=256000)
    with torch.device("meta"):
        model = transformers.AutoModelForSeq2SeqLM.from_config(published)
    theirs = sum(p.numel() for p in model.parameters())
    cfg = models.get_config("t5gemma-2b-2b")
    assert FAMILIES["t5gemma"].config_from_hf(json.loads(published.to_json_string())) == cfg
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    shapes = jax.eval_shape(models.build(cfg).init, jax.random.key(0), tokens, tokens)
    assert sum(x.size for x in jax.tree.leaves(shapes["params"])) == theirs == 5_596_853_760


@pytest.mark.slow
def test_three_steps_over_an_fsdp2_tensor2_mesh_equal_one_device():
    """T5Gemma's layers (both kinds in both stacks, soft-caps, GQA, separate token
    tables), scanned, trained three steps with parameters split over fsdp and tensor: the
    parameters of three steps on one device."""
    import chex

    from tests import test_sharding as ts
    from tests.test_decode_sharded import T5GEMMA
    cfg = ts._variant("encoder_decoder", gqa=True, scan=True).replace(**T5GEMMA)
    sh, make_state = ts._sharded(cfg, (1, 2, 2))
    state = sh.init_state(make_state)
    for b in ts._batches(cfg):
        state, _ = sh.train_step(state, jax.tree.map(lambda x: x.reshape(4, -1, ts.W), b))
    chex.assert_trees_all_close(sh.host_state(state).params, ts._one_device(cfg), atol=2e-5)


PAIRS = [("the cat sat.", "el gato."), ("a dog ran.", "un perro."), ("the sea.", "el mar."),
         ("a red cat.", "un gato rojo.")] * 6


@pytest.mark.slow
def test_fine_tuning_a_t5gemma_directory_with_lora_exports_an_adapter_peft_applies(
        seq2seq_ckpt, data_dir, tmp_path):
    """`finetune_translation` from a T5Gemma directory (with a Gemma tokenizer) and LoRA:
    the run encodes with the directory's tokenizer, trains the adapters only, and exports
    them in PEFT's layout (W/adapter), which PEFT applies to the transformers model with
    our logits; the merged export is a t5gemma directory transformers loads."""
    import os

    import peft

    from train import configs
    from train.trainer import train_and_evaluate
    c = seq2seq_ckpt("t5gemma")
    path = copy_dir(c.path, tmp_path / "t5gemma")
    chars = list("▁abcdefghijklmnopqrstuvwxyz.")
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3,
             **{ch: i + 4 for i, ch in enumerate(chars)}}
    ph.transformers.GemmaTokenizer(vocab=vocab, merges=[]).save_pretrained(path)
    files = []
    for name, rows in (("train.tsv", PAIRS), ("test.tsv", PAIRS[:4])):
        (tmp_path / name).write_text("".join(f"{s}\t{t}\n" for s, t in rows))
        files.append(str(tmp_path / name))
    cfg = configs.get("finetune_translation")
    cfg.update(data_dir=data_dir, init_from=path, data_files=",".join(files),
               num_train_steps=3, warmup_steps=1, learning_rate=1e-2,
               per_device_batch_size=2, eval_per_device_batch_size=4, max_source_length=24,
               max_target_length=24, max_decode_length=6, eval_every_steps=1000,
               checkpoint_every_steps=1000, num_eval_decode=2, num_test_decode=2)
    cfg.lora.rank = 4
    cfg.lora.targets = "query,value"
    workdir = str(tmp_path / "ft")
    out = train_and_evaluate(cfg, workdir)
    adapter = os.path.join(workdir, "adapter")
    pre = models.load(path, adapter=adapter)
    assert pre.config.lora is not None and pre.model_type == "t5gemma"
    ours = fns(pre.config).forward(pre.params, jnp.asarray(c.src), jnp.asarray(c.tgt_in),
                                   src_lengths=jnp.asarray(c.src_lens))
    assert np.abs(np.asarray(ours) - c.logits).max() > 1e-4        # the adapters trained
    theirs = peft.PeftModel.from_pretrained(ph.hf_seq2seq_load(path), adapter).eval()
    np.testing.assert_allclose(ph.hf_seq2seq_logits(theirs, c.src, c.src_lens, c.tgt_in),
                               ours, atol=1e-4, rtol=0)
    merged = ph.hf_seq2seq_load(out["model"])
    assert type(merged).__name__ == "T5GemmaForConditionalGeneration"
    np.testing.assert_allclose(ph.hf_seq2seq_logits(merged, c.src, c.src_lens, c.tgt_in),
                               ours, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_the_serving_engine_and_beam_search_carry_both_stacks_kinds(highest_precision):
    """t5gemma-tiny, sources past the encoder's window: served and beam-1 decoding give
    each source's greedy tokens (`assert_every_decoder_gives_greedy`)."""
    cfg = models.get_config("t5gemma-tiny", vocab_size=64, max_len=48, sliding_window=3)
    ph.assert_every_decoder_gives_greedy(cfg, "t5gemma", seed=5, speculative=False)
