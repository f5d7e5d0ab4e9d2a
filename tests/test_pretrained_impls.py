"""A loaded checkpoint gives transformers' logits under chunked attention too.

The other pretrained tests run `attention_impl="auto"`, which is the materialised `xla`
core at these sizes. Here each family's checkpoint is loaded with `attention_impl=
"chunked"` and blocks of 4 (T is 10, so every sequence spans three query and key blocks,
the last one partial), and must give the same logits as transformers: a sliding window and
GQA (Mistral), learned positions (GPT-2), T5's relative bias computed per block in the
encoder, the decoder and across a cache, BART's cross-attention over a padded source, and
BERT's bidirectional padding mask.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests import pretrained_helpers as ph
from tests.helpers import fns
from tests.pretrained_helpers import ATOL, B

ckpt, seq2seq_ckpt, encoder_ckpt = ph.ckpt, ph.seq2seq_ckpt, ph.encoder_ckpt
highest_precision = ph.highest_precision
CHUNKED = dict(attention_impl="chunked", attention_block=4)


@pytest.mark.parametrize("name", ["mistral-gqa-window-4", "gpt2-tied"])
def test_decoder_under_chunked_attention_gives_transformers_logits(name, ckpt,
                                                                  highest_precision):
    c = ckpt(name)
    pre = models.load(c.path, **CHUNKED)
    assert (pre.config.attention_impl, pre.config.attention_block) == ("chunked", 4)
    f, params = fns(pre.config), pre.params
    np.testing.assert_allclose(f.forward(params, jnp.asarray(c.tokens)), c.logits, atol=ATOL,
                               rtol=0)

    ph.assert_ragged_prefill_then_steps(f, params, c)


@pytest.mark.parametrize("name", ["bart", "t5-v1.1"])
def test_encoder_decoder_under_chunked_attention_gives_transformers_logits(
        name, seq2seq_ckpt, highest_precision):
    c = seq2seq_ckpt(name)
    pre = models.load(c.path, **CHUNKED)
    f, tgt = fns(pre.config), jnp.asarray(c.tgt_in)
    src, lens = jnp.asarray(c.src), jnp.asarray(c.src_lens)
    assert int(lens.min()) < src.shape[1]          # a padded source row
    logits = f.forward(pre.params, src, tgt, src_lengths=lens)
    np.testing.assert_allclose(logits, c.logits, atol=ATOL, rtol=0)

    prefill = 6                                    # two blocks, then steps over the cache
    cache = f.init_cache(pre.params, B, 16, src=src, src_lengths=lens)
    logits, cache = f.prefill(pre.params, tgt[:, :prefill],
                              jnp.full((B,), prefill, jnp.int32), cache)
    np.testing.assert_allclose(logits, c.logits[:, :prefill], atol=ATOL, rtol=0)
    for i in range(prefill, tgt.shape[1]):
        step_logits, cache = f.step(pre.params, tgt[:, i], cache)
        np.testing.assert_allclose(step_logits, c.logits[:, i], atol=ATOL, rtol=0,
                                   err_msg=f"step at position {i}")


def test_encoder_only_under_chunked_attention_gives_transformers_logits(encoder_ckpt,
                                                                       highest_precision):
    c = encoder_ckpt("bert-mlm")
    pre = models.load(c.path, **CHUNKED)
    logits = np.asarray(fns(pre.config).forward(pre.params, jnp.asarray(c.tokens),
                                                lengths=jnp.asarray(c.lengths),
                                                token_types=jnp.asarray(c.token_types)))
    assert min(c.lengths) < logits.shape[1]        # a padded row
    for b, n in enumerate(c.lengths):
        np.testing.assert_allclose(logits[b, :n], c.logits[b, :n], atol=ATOL, rtol=0,
                                   err_msg=f"row {b}")
