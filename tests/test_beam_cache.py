"""The beam cache (`models.BeamKVCache`): beams that reorder through an ancestry table give
the logits of a `KVCache` whose rows are gathered by parent beam, step after step.

A `KVCache` of B * W rows follows beam search by `take_rows` (every layer's keys and values
copied by parent); a `BeamKVCache` moves only its table. Both are stepped with the same
tokens after the same random reorderings, for both generative families, relative
positions and a sliding window, under the xla and chunked implementations.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.cache import BeamKVCache
from tests.helpers import fns, random_tokens, tiny

ATOL = 1e-5
W = 3


def _start(f, params, prompts, lengths, cache_len):
    """(reference KVCache of B * W rows, BeamKVCache) after the decoder prompt."""
    B = prompts.shape[0]
    if f.cfg.is_encoder_decoder:
        one = f.init_cache(params, B, cache_len, src=prompts, src_lengths=lengths)
        many = f.model.apply({"params": params}, prompts, cache_len, W, src_lengths=lengths,
                             method="init_cache")
        start = jnp.full((B, 1), f.cfg.bos_id, jnp.int32)
        _, one = f.prefill(params, start, jnp.ones((B,), jnp.int32), one)
        starts = jnp.full((B * W, 1), f.cfg.bos_id, jnp.int32)
        _, many = f.prefill(params, starts, jnp.ones((B * W,), jnp.int32), many)
        return many, BeamKVCache.from_cache(one, W)
    one = f.init_cache(params, B, cache_len)
    _, one = f.prefill(params, prompts, lengths, one)
    return one.take_rows(jnp.repeat(jnp.arange(B), W)), BeamKVCache.from_cache(one, W)


CASES = {
    "decoder-rope-window": ("decoder_only", dict(positions="rope", num_kv_heads=2,
                                                 sliding_window=4)),
    "decoder-relative": ("decoder_only", dict(positions="relative", relative_buckets=8,
                                              relative_max_distance=12, scale_attention=False)),
    "encoder-decoder": ("encoder_decoder", dict(num_kv_heads=2)),
}


@pytest.mark.parametrize("impl", ["xla", "chunked"])
@pytest.mark.parametrize("case", list(CASES))
def test_reordering_the_table_equals_gathering_the_rows(case, impl):
    arch, extra = CASES[case]
    cfg = tiny(arch, attention_impl=impl, attention_block=4, **extra)
    f = fns(cfg)
    params = f.init()
    B, cache_len = 2, 14
    prompts = random_tokens(1, (B, 5), cfg.vocab_size)
    lengths = jnp.array([5, 3], jnp.int32)
    ref, beam = _start(f, params, prompts, lengths, cache_len)
    rng = np.random.default_rng(0)
    for step in range(7):
        parents_BW = jnp.asarray(rng.integers(0, W, (B, W)), jnp.int32)
        rows_R = (jnp.arange(B)[:, None] * W + parents_BW).reshape(-1)
        ref, beam = ref.take_rows(rows_R), beam.reorder(parents_BW)
        tokens_R = random_tokens(10 + step, (B * W,), cfg.vocab_size)
        want, ref = f.step(params, tokens_R, ref)
        got, beam = f.step(params, tokens_R, beam)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=f"step {step}")
        np.testing.assert_array_equal(beam.lengths, ref.lengths)


def test_the_table_moves_and_the_keys_do_not():
    """A reorder changes `origin` and `lengths` only; a step writes one slot per beam."""
    cfg = tiny(positions="rope")
    f = fns(cfg)
    params = f.init()
    _, beam = _start(f, params, random_tokens(2, (2, 4), 61), jnp.array([4, 2]), 10)
    moved = beam.reorder(jnp.array([[2, 2, 0], [1, 0, 0]], jnp.int32))
    assert all(a is b for a, b in zip(moved.k + moved.v, beam.k + beam.v, strict=True))
    np.testing.assert_array_equal(moved.origin[0, :2, :4], 0)         # the prompt: region 0
    np.testing.assert_array_equal(moved.origin[0, 1, 4:], 1)          # from here: its own
    stepped = jax.jit(lambda p, t, c: f.model.apply({"params": p}, t, c, method="step"))(
        params, random_tokens(3, (6,), 61), moved)[1]
    changed = np.argwhere(np.any(np.stack([np.asarray(a != b) for a, b in zip(
        stepped.k, moved.k, strict=True)]), axis=(0, 2, 4)))      # [layer, Bs, K, W*S, H]
    slots = {(int(b), int(s)) for b, s in changed}
    assert slots == {(0, w * 10 + 4) for w in range(W)} | {(1, w * 10 + 2) for w in range(W)}


def test_from_cache_needs_one_row_per_source():
    cfg = tiny("encoder_decoder")
    f = fns(cfg)
    params = f.init()
    src = random_tokens(4, (2, 5), 61)
    many = f.model.apply({"params": params}, src, 8, 2, method="init_cache")
    with pytest.raises(models.errors.UserError, match="one row per source"):
        BeamKVCache.from_cache(many, W)
