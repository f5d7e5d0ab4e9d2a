"""The central test: forward, prefill and step are one function of the same weights.

For every family, attention kind, position kind and layer loop, a ragged batch is prefilled
(row 0 with 3 prompt tokens, row 1 with 6, the padding filled with junk that the next steps
must overwrite) and then stepped token by token; every logit must equal the teacher-forced
forward pass of the same sequence.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import fns, random_tokens, tiny

ATOL = 1e-5
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


def _check_parity(cfg):
    f = fns(cfg)
    params = f.init()
    T, prompt_lens = 10, np.array([3, 6])
    P = int(prompt_lens.max())
    tgt = random_tokens(1, (2, T), cfg.vocab_size)
    src = random_tokens(2, (2, 7), cfg.vocab_size).at[1, 4:].set(cfg.pad_id)
    full = f.forward(params, src, tgt) if cfg.is_encoder_decoder else f.forward(params, tgt)

    junk = random_tokens(3, (2, P), cfg.vocab_size)
    prompt = jnp.where(jnp.arange(P)[None, :] < prompt_lens[:, None], tgt[:, :P], junk)
    cache = f.init_cache(params, 2, 16, src=src)
    logits, cache = f.prefill(params, prompt, jnp.asarray(prompt_lens, jnp.int32), cache)
    np.testing.assert_array_equal(cache.lengths, prompt_lens)
    for b, n in enumerate(prompt_lens):
        np.testing.assert_allclose(logits[b, :n], full[b, :n], atol=ATOL, rtol=0)
    for i in range(T - P):
        positions = prompt_lens + i
        step_logits, cache = f.step(params, tgt[np.arange(2), positions], cache)
        np.testing.assert_allclose(
            step_logits, full[np.arange(2), positions], atol=ATOL, rtol=0,
            err_msg=f"step {i} at positions {positions}")
    np.testing.assert_array_equal(cache.lengths, prompt_lens + T - P)


# A covering design: in each family, every attention kind and every position kind runs
# both looped and scanned (6 cases per family instead of all 18 combinations).
COVER = [("mha", "sinusoidal", False), ("gqa", "learned", False), ("mqa", "rope", False),
         ("mha", "rope", True), ("gqa", "sinusoidal", True), ("mqa", "learned", True)]
CASES = [(arch, kv, pos, scan) for arch in ("decoder_only", "encoder_decoder")
         for kv, pos, scan in COVER]


@pytest.mark.parametrize(
    "arch,kv,positions,scan", CASES,
    ids=[f"{a}-{k}-{p}-{'scan' if s else 'loop'}" for a, k, p, s in CASES])
def test_forward_prefill_step_parity(arch, kv, positions, scan):
    _check_parity(tiny(arch, num_kv_heads=KV_HEADS[kv], positions=positions, scan_layers=scan))


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_parity_post_norm_swiglu_rmsnorm_untied(arch):
    _check_parity(tiny(arch, norm_position="post", norm="rmsnorm", activation="swiglu",
                       use_bias=False, tie_embeddings=False, share_embeddings=False,
                       scale_embeddings=True))


def test_chunked_prefill_equals_one_prefill():
    """Two prefills of 3 then 4 tokens leave the same cache and logits as one of 7."""
    f = fns(tiny(positions="rope", num_kv_heads=2))
    params = f.init()
    tokens = random_tokens(4, (2, 7), f.cfg.vocab_size)
    full, c1 = f.prefill(params, tokens, jnp.array([7, 7]), f.init_cache(params, 2, 12))
    a, c2 = f.prefill(params, tokens[:, :3], jnp.array([3, 3]), f.init_cache(params, 2, 12))
    b, c2 = f.prefill(params, tokens[:, 3:], jnp.array([4, 4]), c2)
    np.testing.assert_allclose(jnp.concatenate([a, b], 1), full, atol=ATOL, rtol=0)
    np.testing.assert_allclose(c2.k[:, :, :, :7], c1.k[:, :, :, :7], atol=ATOL, rtol=0)
