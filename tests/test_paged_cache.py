"""`models.PagedKVCache`: the model's cache interface over a pool of pages.

Prefill in chunks and cached steps through scattered, out-of-order pages give the full
forward pass's logits (both stack layouts, and an encoder-decoder's cross-attention
regions); a position without a page is not written, and another row's pages are never
touched.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.errors import UserError
from models.paged_cache import PagedKVCache

TABLE = [[7, 2, 5, 10], [0, 9, 3, 1]]           # 10 = no page


@pytest.mark.parametrize("scan_layers", [False, True])
def test_chunks_and_steps_over_scattered_pages_give_the_forward_logits(scan_layers):
    cfg = models.get_config("gpt-tiny", vocab_size=100, max_len=16, scan_layers=scan_layers)
    model = models.build(cfg)
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 3, 100)
    params = model.init(jax.random.key(1), tokens)["params"]
    full = model.apply({"params": params}, tokens)
    cache = PagedKVCache.create(cfg, rows=2, num_pages=10, page_size=4, pages_per_row=4)
    cache = cache.replace(page_table=jnp.array(TABLE, jnp.int32))
    v = {"params": params}
    first, cache = model.apply(v, tokens[:, :6], jnp.array([6, 5]), cache, method="prefill")
    chex.assert_trees_all_close(first[0], full[0, :6], atol=1e-5)
    chex.assert_trees_all_close(first[1, :5], full[1, :5], atol=1e-5)
    block = jnp.stack([tokens[0, 6:10], tokens[1, 5:9]])
    second, cache = model.apply(v, block, jnp.array([4, 4]), cache, method="prefill")
    chex.assert_trees_all_close(second[0], full[0, 6:10], atol=1e-5)
    chex.assert_trees_all_close(second[1], full[1, 5:9], atol=1e-5)
    step, cache = model.apply(v, jnp.array([tokens[0, 10], tokens[1, 9]]), cache,
                              method="step")
    chex.assert_trees_all_close(step, jnp.stack([full[0, 10], full[1, 9]]), atol=1e-5)
    assert cache.lengths.tolist() == [11, 10]


def test_an_encoder_decoders_rows_read_their_own_cross_regions():
    cfg = models.get_config("transformer-tiny", vocab_size=100, max_len=16)
    model = models.build(cfg)
    src = jax.random.randint(jax.random.key(0), (2, 7), 3, 100)
    tgt = jax.random.randint(jax.random.key(1), (2, 6), 3, 100)
    params = model.init(jax.random.key(2), src, tgt)["params"]
    v = {"params": params}
    lengths = jnp.array([7, 4])
    full = model.apply(v, src, tgt, src_lengths=lengths)
    encoded = model.apply(v, src, lengths=lengths, method="encode")
    cross_k, cross_v = model.apply(v, encoded, method=lambda m, x: m.cross_kv(x))
    cache = PagedKVCache.create(cfg, rows=3, num_pages=10, page_size=4, pages_per_row=4,
                                source_len=16)
    # Sources into rows 2 and 0 (in that order); row 1 keeps an empty region.
    cache = cache.set_cross(jnp.array([2, 0]), cross_k, cross_v,
                            jnp.arange(7)[None, :] < lengths[:, None])
    cache = cache.replace(page_table=jnp.array([TABLE[1], [10] * 4, TABLE[0]], jnp.int32))
    rows = jnp.stack([tgt[1], tgt[1], tgt[0]])
    logits, cache = model.apply(v, rows, jnp.array([6, 0, 6]), cache, method="prefill")
    chex.assert_trees_all_close(logits[2], full[0], atol=1e-5)
    chex.assert_trees_all_close(logits[0], full[1], atol=1e-5)
    assert not np.asarray(cache.cross_mask[1]).any()


def test_positions_without_a_page_are_not_written():
    cfg = models.get_config("gpt-tiny", vocab_size=100, max_len=16)
    cache = PagedKVCache.create(cfg, rows=2, num_pages=3, page_size=4, pages_per_row=4)
    cache = cache.replace(page_table=jnp.array([[1, 3, 3, 3], [3, 3, 3, 3]], jnp.int32))
    k = jnp.ones((2, 8, cfg.num_kv_heads, cfg.head_dim))
    written = cache.write(0, k, 2 * k, jnp.broadcast_to(jnp.arange(8), (2, 8)))
    touched = np.asarray(written.k[0]).any(axis=(1, 2, 3))
    assert touched.tolist() == [False, True, False]     # row 0's one page; row 1 has none
    assert np.asarray(written.v[0][1]).max() == 2.0


def test_sizes_are_checked_by_name():
    cfg = models.get_config("gpt-tiny", vocab_size=100, max_len=16)
    with pytest.raises(UserError, match="num_pages"):
        PagedKVCache.create(cfg, rows=2, num_pages=0, page_size=4, pages_per_row=4)
    with pytest.raises(UserError, match="pages_per_row=5 of page_size=4 reach past"):
        PagedKVCache.create(cfg, rows=2, num_pages=8, page_size=4, pages_per_row=5)
