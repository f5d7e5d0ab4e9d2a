"""`mlp_chunks`: the dense MLP over slices of the sequence, rematerialised slice by slice.

The same parameters, logits and gradients as one call (looped and scanned stacks, every
family, a length the slices do not divide, a decoding step shorter than the slices), and a
compiled gradient that holds less: its [B, T, F] activations a slice at a time.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import fns, tiny


@pytest.mark.parametrize("arch,scan", [("decoder_only", False), ("decoder_only", True),
                                       ("encoder_decoder", True), ("encoder_only", False)])
def test_sliced_mlp_gives_the_same_params_logits_and_gradients(arch, scan):
    cfg = tiny(arch, positions="rope", norm="rmsnorm", activation="swiglu", use_bias=False,
               scan_layers=scan, remat=scan)
    sliced = cfg.replace(mlp_chunks=3)
    one, three = fns(cfg), fns(sliced)
    params = one.init(0)
    chex.assert_trees_all_equal_shapes_and_dtypes(three.init(0), params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 10)))
    args = (tokens, tokens) if cfg.is_encoder_decoder else (tokens,)   # 10 = 3 + 3 + 4

    def loss(f):
        return lambda p: jnp.mean(f.forward(p, *args) ** 2)
    np.testing.assert_allclose(three.forward(params, *args), one.forward(params, *args),
                               atol=1e-6)
    chex.assert_trees_all_close(jax.grad(loss(three))(params), jax.grad(loss(one))(params),
                                atol=1e-6)


def test_a_decoding_step_shorter_than_the_slices_decodes_as_one_call():
    import decode
    cfg = tiny(positions="rope", norm="rmsnorm", activation="swiglu", use_bias=False)
    params = fns(cfg).init(0)
    prompts, lengths = decode.pad_prompts([[5, 6, 7, 8, 9], [3, 4]])
    kw = dict(max_new_tokens=5, eos_id=None)
    got = decode.generate(models.build(cfg.replace(mlp_chunks=4)), params, prompts, lengths,
                          **kw)
    want = decode.generate(models.build(cfg), params, prompts, lengths, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)


@pytest.mark.parametrize("remat", [True, False])
def test_the_compiled_gradient_holds_less_with_the_mlp_in_slices(remat):
    """A wide MLP at T 512, scanned, in rematerialised layers or not (then each slice is):
    the gradient's scratch shrinks with slices (its [T, F] activations held an eighth at a
    time)."""
    cfg = tiny(positions="rope", norm="rmsnorm", activation="swiglu", use_bias=False,
               mlp_dim=1024, max_len=512, scan_layers=True, remat=remat,
               attention_impl="chunked", attention_block=128)
    tokens = jnp.zeros((1, 512), jnp.int32)

    def temp_bytes(c):
        model = models.build(c)
        params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
        grad = jax.jit(jax.grad(lambda p, t: jnp.mean(model.apply({"params": p}, t))))
        return grad.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
    assert temp_bytes(cfg.replace(mlp_chunks=8)) < 0.85 * temp_bytes(cfg)


def test_slices_of_a_mixture_of_experts_are_refused_by_name():
    with pytest.raises(ValueError, match="mlp_chunks=2 slices the dense MLP.*num_experts=4"):
        models.get_config("mixtral-tiny", mlp_chunks=2)
    with pytest.raises(ValueError, match="mlp_chunks"):
        tiny(mlp_chunks=0)
