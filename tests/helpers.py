"""Tiny configs and jitted model functions shared across tests (compiled once per config)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models


def tiny(arch: str = "decoder_only", **overrides) -> models.TransformerConfig:
    base = dict(architecture=arch, vocab_size=61, d_model=32, num_heads=4, mlp_dim=48,
                num_layers=2, num_encoder_layers=2, num_decoder_layers=2, max_len=24,
                norm_position="pre")
    return models.TransformerConfig(**{**base, **overrides})


class Fns:
    """init / forward / init_cache / prefill / step of one config, each jitted once."""

    def __init__(self, cfg: models.TransformerConfig):
        self.cfg = cfg
        self.model = model = models.build(cfg)
        self.forward = jax.jit(lambda p, *a, **kw: model.apply({"params": p}, *a, **kw))
        self.prefill = jax.jit(
            lambda p, t, n, c: model.apply({"params": p}, t, n, c, method="prefill"))
        self.step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, method="step"))
        self._init_cache = jax.jit(
            lambda p, src, n, lengths: model.apply({"params": p}, src, n, src_lengths=lengths,
                                                   method="init_cache"),
            static_argnums=2)

    def init(self, seed: int = 0):
        B, T = 2, 5
        tokens = jnp.full((B, T), 3, jnp.int32)
        args = (tokens, tokens) if self.cfg.is_encoder_decoder else (tokens,)
        return jax.jit(self.model.init)(jax.random.key(seed), *args)["params"]

    def init_cache(self, params, batch_size: int, cache_len: int, src=None, src_lengths=None):
        if self.cfg.is_encoder_decoder:
            return self._init_cache(params, src, cache_len, src_lengths)
        return models.KVCache.create(self.cfg, batch_size, cache_len)


@functools.cache
def fns(cfg: models.TransformerConfig) -> Fns:
    return Fns(cfg)


def random_adapters(cfg: models.TransformerConfig, seed: int) -> dict:
    """LoRA adapters of `cfg.lora` (`models.lora.split`'s second tree), every value random
    (B too, not the zeros of `init`), without running `init`."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    args = (tokens, tokens) if cfg.is_encoder_decoder else (tokens,)
    init = functools.partial(models.build(cfg).init, method="classify" if cfg.num_labels else None)
    shapes = jax.eval_shape(init, jax.random.key(0), *args)["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.15, s.shape), s.dtype),
                        models.lora.split(shapes)[1])


def random_tokens(seed: int, shape, vocab_size: int) -> jax.Array:
    """Ids in [3, V): never pad, eos or bos."""
    return jnp.asarray(np.random.default_rng(seed).integers(3, vocab_size, shape), jnp.int32)


@pytest.fixture
def highest_precision():
    """Float32 matmuls at full precision for the test (comparisons with transformers)."""
    old = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", old)
