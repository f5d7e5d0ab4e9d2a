"""Bad inputs to the models' entry points raise errors that name the value and the limit."""

import jax.numpy as jnp
import pytest

import models
from tests.helpers import fns, random_tokens, tiny


@pytest.fixture(scope="module")
def dec():
    f = fns(tiny())
    return f, f.init()


@pytest.fixture(scope="module")
def encdec():
    f = fns(tiny("encoder_decoder"))
    return f, f.init()


def _apply(f, params, *args, **kw):
    return f.model.apply({"params": params}, *args, **kw)


def test_token_ids_outside_the_vocabulary(dec, encdec):
    f, p = dec
    with pytest.raises(ValueError, match=r"tokens holds token id 61 outside \[0, vocab_size=61\)"):
        _apply(f, p, jnp.array([[3, 61]]))
    with pytest.raises(ValueError, match=r"token id -1 outside"):
        _apply(f, p, jnp.array([[3, -1]]))
    f, p = encdec
    with pytest.raises(ValueError, match=r"src holds token id 99"):
        _apply(f, p, jnp.array([[3, 99]]), jnp.array([[2, 3]]))
    with pytest.raises(ValueError, match=r"tgt_in holds token id 70"):
        _apply(f, p, jnp.array([[3, 4]]), jnp.array([[2, 70]]))


def test_sequences_longer_than_max_len(dec, encdec):
    f, p = dec
    with pytest.raises(ValueError, match=r"tokens has length 25, beyond the limit 24"):
        _apply(f, p, random_tokens(0, (1, 25), 61))
    f, p = encdec
    with pytest.raises(ValueError, match=r"src has length 30, beyond the limit 24"):
        _apply(f, p, random_tokens(0, (1, 30), 61), random_tokens(0, (1, 3), 61))


def test_rank_and_dtype_mismatches(dec, encdec):
    f, p = dec
    with pytest.raises(ValueError,
                       match=r"tokens must be int\[B, T\] \(rank 2\), got shape \(5,\)"):
        _apply(f, p, jnp.arange(5))
    with pytest.raises(ValueError, match=r"tokens must have an integer dtype, got float32"):
        _apply(f, p, jnp.ones((1, 5)))
    with pytest.raises(ValueError,
                       match=r"segment_ids has shape \(1, 4\), but tokens has shape \(1, 5\)"):
        _apply(f, p, random_tokens(0, (1, 5), 61), segment_ids=jnp.ones((1, 4), jnp.int32))
    f, p = encdec
    with pytest.raises(ValueError, match=r"batch sizes differ: src \(2, 4\), tgt_in \(1, 3\)"):
        _apply(f, p, random_tokens(0, (2, 4), 61), random_tokens(0, (1, 3), 61))
    with pytest.raises(ValueError, match="src_segment_ids and tgt_segment_ids"):
        _apply(f, p, random_tokens(0, (1, 4), 61), random_tokens(0, (1, 3), 61),
               src_segment_ids=jnp.ones((1, 4), jnp.int32))


def test_cache_misuse(dec, encdec):
    f, p = dec
    cache = models.KVCache.create(f.cfg, 2, 8)
    with pytest.raises(ValueError,
                       match=r"cache full: row 1 would reach 9 tokens, beyond the cache length 8"):
        _apply(f, p, random_tokens(0, (2, 9), 61)[:, :8], jnp.array([8, 8]),
               cache.replace(lengths=jnp.array([0, 1])), method="prefill")
    with pytest.raises(ValueError, match=r"tokens has length 9, beyond the limit 8"):
        _apply(f, p, random_tokens(0, (2, 9), 61), jnp.array([9, 9]), cache, method="prefill")
    with pytest.raises(ValueError, match=r"batch sizes differ"):
        _apply(f, p, random_tokens(0, (3, 4), 61), jnp.array([4, 4, 4]), cache, method="prefill")
    with pytest.raises(ValueError, match=r"lengths\[1\]=5 must be in \[0, tokens width 4\]"):
        _apply(f, p, random_tokens(0, (2, 4), 61), jnp.array([4, 5]), cache, method="prefill")
    with pytest.raises(ValueError, match=r"lengths\[0\]=-1 must be in \[0, tokens width 4\]"):
        _apply(f, p, random_tokens(0, (2, 4), 61), jnp.array([-1, 2]), cache, method="prefill")
    with pytest.raises(ValueError, match=r"lengths must be int\[B\]"):
        _apply(f, p, random_tokens(0, (2, 4), 61), 4, cache, method="prefill")
    full = cache.replace(lengths=jnp.array([8, 3]))
    with pytest.raises(ValueError, match=r"cache full: row 0 would reach 9"):
        _apply(f, p, jnp.array([3, 4]), full, method="step")
    with pytest.raises(ValueError, match=r"cache_len=25 must be an int in \[1, max_len=24\]"):
        models.KVCache.create(f.cfg, 2, 25)
    with pytest.raises(ValueError, match=r"batch_size=0 must be a positive int"):
        models.KVCache.create(f.cfg, 0, 8)
    f, p = encdec
    with pytest.raises(ValueError, match="no cross-attention keys"):
        _apply(f, p, jnp.array([2, 2]), models.KVCache.create(f.cfg, 2, 8), method="step")
    with pytest.raises(ValueError, match=r"beams=0 must be a positive int"):
        _apply(f, p, random_tokens(0, (2, 4), 61), 8, 0, method="init_cache")
