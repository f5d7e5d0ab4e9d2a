"""The central test: forward, prefill and step are one function of the same weights.

For every family, attention kind, position kind and layer loop, a ragged batch is prefilled
(row 0 with 3 prompt tokens, row 1 with 6, the padding filled with junk that the next steps
must overwrite) and then stepped token by token; every logit must equal the teacher-forced
forward pass of the same sequence.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import fns, random_tokens, tiny

ATOL = 1e-5
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


def _check_parity(cfg):
    f = fns(cfg)
    params = f.init()
    T, prompt_lens = 10, np.array([3, 6])
    P = int(prompt_lens.max())
    tgt = random_tokens(1, (2, T), cfg.vocab_size)
    # Row 1's source is 4 tokens then junk padding, masked by its length alone.
    src, src_lengths = random_tokens(2, (2, 7), cfg.vocab_size), jnp.array([7, 4])
    full = (f.forward(params, src, tgt, src_lengths=src_lengths) if cfg.is_encoder_decoder
            else f.forward(params, tgt))

    junk = random_tokens(3, (2, P), cfg.vocab_size)
    prompt = jnp.where(jnp.arange(P)[None, :] < prompt_lens[:, None], tgt[:, :P], junk)
    cache = f.init_cache(params, 2, 16, src=src, src_lengths=src_lengths)
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


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_parity_sliding_window_qkv_bias_exact_gelu_llama3_rope(arch):
    """The checkpoint variants: a window of 4 (shorter than the 10 tokens, so prefill and
    every step must apply it), biases on q/k/v only, erf GELU, Llama 3 scaled frequencies."""
    _check_parity(tiny(arch, positions="rope", num_kv_heads=2, sliding_window=4,
                       use_bias=False, qkv_bias=True, activation="gelu_exact",
                       rope_scaling=dict(factor=8.0, original_max_len=16)))


# The variants published encoder-decoders need (issue 15), each in both families: T5's
# relative bias (8 buckets with exact distances below 4 or 2, so 10 tokens reach the
# logarithmic buckets in prefill and in the steps) without the 1/sqrt(H) scale, BART's
# offset learned positions and embedding norm, Marian's sinusoid and logits bias.
SEQ2SEQ_VARIANTS = {
    "t5": dict(positions="relative", relative_buckets=8, relative_max_distance=12,
               scale_attention=False, norm="rmsnorm", use_bias=False, activation="geglu",
               scale_head_input=True, head_dim=12),
    "t5-untied": dict(positions="relative", relative_buckets=8, relative_max_distance=12,
                      scale_attention=False, norm="rmsnorm", use_bias=False,
                      activation="relu", tie_embeddings=False),
    "bart": dict(positions="learned", position_offset=2, embedding_norm=True,
                 norm_position="post", activation="gelu_exact", logits_bias=True,
                 mlp_dropout_rate=0.1),
    "marian": dict(positions="sinusoidal_paper", norm_position="post", activation="silu",
                   logits_bias=True, scale_embeddings=True, share_embeddings=False,
                   d_model=36),
}
# Every variant in the encoder-decoder (the checkpoints' family), T5's relative bias also
# in a decoder-only stack (causal buckets without an encoder); scanned where marked.
VARIANT_CASES = [("encoder_decoder", name, name in ("t5", "marian"))
                 for name in SEQ2SEQ_VARIANTS] + [("decoder_only", "t5", False)]


@pytest.mark.parametrize("arch,name,scan", VARIANT_CASES,
                         ids=[f"{a}-{n}-{'scan' if s else 'loop'}" for a, n, s in VARIANT_CASES])
def test_parity_of_the_checkpoint_variants(arch, name, scan):
    _check_parity(tiny(arch, scan_layers=scan, **SEQ2SEQ_VARIANTS[name]))


@pytest.mark.parametrize("name", ["t5"])
def test_a_packed_row_equals_its_examples_alone(name):
    """Two examples packed into one row (segment ids, per-segment positions) give the
    logits each gives alone: relative positions restart with each segment (offset learned
    positions: tests/test_encoder_only.py)."""
    f = fns(tiny("encoder_decoder", **SEQ2SEQ_VARIANTS[name]))
    params = f.init()
    src_a, src_b = random_tokens(5, (1, 4), 61), random_tokens(6, (1, 6), 61)
    tgt_a, tgt_b = random_tokens(7, (1, 7), 61), random_tokens(8, (1, 5), 61)
    seg = lambda n, m: jnp.array([[1] * n + [2] * m + [0]])              # noqa: E731
    pos = lambda n, m: jnp.array([list(range(n)) + list(range(m)) + [0]])  # noqa: E731
    src = jnp.concatenate([src_a, src_b, jnp.zeros((1, 1), jnp.int32)], 1)
    tgt = jnp.concatenate([tgt_a, tgt_b, jnp.zeros((1, 1), jnp.int32)], 1)
    packed = f.forward(params, src, tgt, src_segment_ids=seg(4, 6), tgt_segment_ids=seg(7, 5),
                       src_positions=pos(4, 6), tgt_positions=pos(7, 5))
    np.testing.assert_allclose(packed[0, :7], f.forward(params, src_a, tgt_a)[0], atol=ATOL,
                               rtol=0)
    np.testing.assert_allclose(packed[0, 7:12], f.forward(params, src_b, tgt_b)[0],
                               atol=ATOL, rtol=0)


def test_the_source_padding_is_masked_by_lengths_not_by_its_tokens():
    f = fns(tiny("encoder_decoder"))
    params = f.init()
    tgt = random_tokens(1, (2, 5), f.cfg.vocab_size)
    lengths = jnp.array([7, 4])
    a = f.forward(params, random_tokens(2, (2, 7), 61), tgt, src_lengths=lengths)
    b = f.forward(params, random_tokens(2, (2, 7), 61).at[:, 4:].set(0), tgt,
                  src_lengths=lengths)
    np.testing.assert_allclose(a[1], b[1], atol=ATOL, rtol=0)         # row 1: 4 real tokens
    assert not np.allclose(a[0], b[0], atol=1e-3)                      # row 0: all 7 real


def test_chunked_prefill_equals_one_prefill():
    """Two prefills of 3 then 4 tokens leave the same cache and logits as one of 7."""
    f = fns(tiny(positions="rope", num_kv_heads=2))
    params = f.init()
    tokens = random_tokens(4, (2, 7), f.cfg.vocab_size)
    full, c1 = f.prefill(params, tokens, jnp.array([7, 7]), f.init_cache(params, 2, 12))
    a, c2 = f.prefill(params, tokens[:, :3], jnp.array([3, 3]), f.init_cache(params, 2, 12))
    b, c2 = f.prefill(params, tokens[:, 3:], jnp.array([4, 4]), c2)
    np.testing.assert_allclose(jnp.concatenate([a, b], 1), full, atol=ATOL, rtol=0)
    for k2, k1 in zip(c2.k, c1.k, strict=True):                 # per layer [B, K, S, H]
        np.testing.assert_allclose(k2[:, :, :7], k1[:, :, :7], atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [3, 4, 16])
@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_prefill_in_chunks_equals_one_prefill_then_steps_continue(chunk, impl):
    """A ragged batch (10 and 4 real tokens of a width-10 prompt) prefilled `chunk` tokens
    at a time gives each row's next-token logits and a cache the steps continue from as
    after one prefill; the cache (12 slots) is shorter than the padded chunks (12 or 16)."""
    cfg = tiny(positions="rope", num_kv_heads=2, sliding_window=5, attention_impl=impl,
               attention_block=4)
    f = fns(cfg)
    params = f.init()
    tokens = random_tokens(9, (2, 12), cfg.vocab_size)
    full = f.forward(params, tokens)
    lengths = jnp.array([10, 4], jnp.int32)
    prompt = jnp.where(jnp.arange(10)[None, :] < lengths[:, None], tokens[:, :10], 0)
    logits, cache = jax.jit(functools.partial(models.prefill_in_chunks, f.model, chunk=chunk))(
        params, prompt, lengths, f.init_cache(params, 2, 12))
    np.testing.assert_array_equal(cache.lengths, lengths)
    np.testing.assert_allclose(logits, full[np.arange(2), lengths - 1], atol=ATOL, rtol=0)
    for i in range(2):
        step_logits, cache = f.step(params, tokens[np.arange(2), lengths + i], cache)
        np.testing.assert_allclose(step_logits, full[np.arange(2), lengths + i], atol=ATOL,
                                   rtol=0)
