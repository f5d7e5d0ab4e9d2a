"""Decoding a model with LoRA adapters: `decode.generate` (greedy) and `decode.beam_search`
on the base plus its adapters (joined params, `config.lora` set) give the tokens of the
merged model (`models.lora.merge`), so the prefill, the cached steps and the
cross-attention keys/values projected once per source all apply the adapters. On the tiny
random Llama and BART checkpoints of tests/pretrained_helpers.py, BART's layers scanned.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import decode
import models
from models import lora
from models.lora import LoraConfig
from tests import pretrained_helpers as ph
from tests.helpers import random_adapters

ckpt, seq2seq_ckpt, highest_precision = ph.ckpt, ph.seq2seq_ckpt, ph.highest_precision

N_NEW = 6
CASES = {   # name -> (checkpoint, encoder-decoder, scan_layers, adapted projections)
    "llama": ("llama-gqa-tied-llama3-head-dim", False, False, ("query", "value", "down")),
    "bart": ("bart", True, True, ("self_attention.value", "cross_attention.key",
                                  "cross_attention.value", "decoder.mlp.up")),
}


@pytest.mark.parametrize("name", CASES)
def test_adapted_decoding_equals_the_merged_models(name, ckpt, seq2seq_ckpt, highest_precision):
    checkpoint, seq2seq, scan, targets = CASES[name]
    c = (seq2seq_ckpt if seq2seq else ckpt)(checkpoint)
    pre = models.load(c.path, scan_layers=scan)
    cfg = pre.config.replace(lora=LoraConfig(rank=4, alpha=8, targets=targets))
    params = lora.join(pre.params, random_adapters(cfg, seed=11))
    merged_cfg, merged = lora.merge(cfg, params)
    if seq2seq:
        prompts, lengths = jnp.asarray(c.src), jnp.asarray(c.src_lens)
    else:
        prompts, lengths = jnp.asarray(c.tokens[:, :6]), jnp.asarray(ph.PROMPT_LENS, jnp.int32)
    runs = {}
    for which, (config, p) in {"adapted": (cfg, params), "merged": (merged_cfg, merged),
                               "base": (pre.config, pre.params)}.items():
        model = models.build(config)
        greedy = decode.generate(model, p, prompts, lengths, max_new_tokens=N_NEW,
                                 temperature=0.0, eos_id=None)
        beams = decode.beam_search(model, p, prompts, lengths, beam_size=3,
                                   max_new_tokens=N_NEW, eos_id=None)
        runs[which] = np.asarray(greedy.tokens), np.asarray(beams.tokens)
    for k in range(2):
        np.testing.assert_array_equal(runs["adapted"][k], runs["merged"][k])
    assert not np.array_equal(runs["adapted"][0], runs["base"][0])   # the adapters matter
