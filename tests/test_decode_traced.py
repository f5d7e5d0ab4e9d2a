"""generate and beam_search with traced arguments: inside a user's jax.jit, under jax.grad."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
from tests.helpers import fns, tiny

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]]


@functools.cache
def setup(arch):
    f = fns(tiny(arch, positions="rope" if arch == "decoder_only" else "sinusoidal",
                 num_kv_heads=2, max_len=32))
    return f.model, f.init()


def ending_eos(model, params, prompts, lengths, n):
    """An end id that row 0 meets at its third token (so rows end at different steps)."""
    free = decode.generate(model, params, prompts, lengths, max_new_tokens=n, eos_id=None)
    return int(free.tokens[0, 2])


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_generate_inside_a_user_jit_equals_the_eager_call(arch):
    model, params = setup(arch)
    prompts, lengths = decode.pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=6, eos_id=ending_eos(model, params, prompts, lengths, 6))
    eager = decode.generate(model, params, prompts, lengths, **kw)
    traced = jax.jit(lambda p, x, n: decode.generate(model, p, x, n, **kw))(
        params, jnp.asarray(prompts), jnp.asarray(lengths))
    np.testing.assert_array_equal(traced.tokens, eager.tokens)
    np.testing.assert_array_equal(traced.lengths, eager.lengths)
    assert int(eager.lengths.min()) < 6 == int(eager.lengths.max())    # rows end apart
    np.testing.assert_allclose(traced.logprobs, eager.logprobs, atol=1e-6)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_beam_search_inside_a_user_jit_equals_the_eager_call(arch):
    model, params = setup(arch)
    prompts, lengths = decode.pad_prompts(PROMPTS)
    kw = dict(beam_size=3, max_new_tokens=5, eos_id=ending_eos(model, params, prompts, lengths, 5))
    eager = decode.beam_search(model, params, prompts, lengths, **kw)
    traced = jax.jit(lambda p, x, n, alpha: decode.beam_search(
        model, p, x, n, length_penalty=alpha, **kw))(
        params, jnp.asarray(prompts), jnp.asarray(lengths), jnp.float32(0.6))
    np.testing.assert_array_equal(traced.tokens, eager.tokens)
    np.testing.assert_array_equal(traced.lengths, eager.lengths)
    np.testing.assert_allclose(traced.scores, eager.scores, atol=1e-6)


def test_traced_sampling_values_with_a_strategy_equal_the_eager_call():
    model, params = setup("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=8, eos_id=None)
    temperature, top_k = np.float32([0.0, 0.9, 1.3]), 20
    eager = decode.generate(model, params, prompts, lengths, rng=jax.random.key(5),
                            temperature=temperature, top_k=top_k, **kw)
    strategy = decode.Strategy(sample=True, top_k=True)
    traced = jax.jit(lambda t, k, rng: decode.generate(
        model, params, prompts, lengths, rng=rng, temperature=t, top_k=k, strategy=strategy,
        **kw))(jnp.asarray(temperature), jnp.int32(top_k), jax.random.key(5))
    np.testing.assert_array_equal(traced.tokens, eager.tokens)
    np.testing.assert_allclose(traced.logprobs, eager.logprobs, atol=1e-6)
    # The comparison means something: rows 1 and 2 sample, row 0 (temperature 0) is greedy.
    greedy = decode.generate(model, params, prompts, lengths, **kw)
    np.testing.assert_array_equal(eager.tokens[0], greedy.tokens[0])
    assert not np.array_equal(eager.tokens[1:], greedy.tokens[1:])


@pytest.mark.parametrize("name", ["temperature", "top_p", "repetition_penalty"])
def test_a_traced_sampling_value_without_a_strategy_is_an_error(name):
    model, params = setup("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    run = jax.jit(lambda value: decode.generate(
        model, params, prompts, lengths, max_new_tokens=4, rng=jax.random.key(0),
        **{name: value}))
    with pytest.raises(ValueError, match=rf"{name} is traced .*pass "
                                         r"strategy=decode\.Strategy\(\.\.\.\)"):
        run(jnp.float32(0.9))


def test_a_strategy_that_leaves_off_a_processor_the_values_need_is_an_error():
    model, params = setup("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    with pytest.raises(ValueError, match=r"top_p=0.9 needs strategy.top_p=True, but "
                                         r"strategy=Strategy\(sample=True"):
        decode.generate(model, params, prompts, lengths, max_new_tokens=4, rng=jax.random.key(0),
                        temperature=1.0, top_p=0.9, strategy=decode.Strategy(sample=True))
    with pytest.raises(ValueError, match=r"strategy must be a decode.Strategy or None"):
        decode.generate(model, params, prompts, lengths, max_new_tokens=4, strategy="greedy")
    with pytest.raises(ValueError, match=r"top_k is traced with dtype float32: it must be an "
                                         r"int array"):
        jax.jit(lambda k: decode.generate(
            model, params, prompts, lengths, max_new_tokens=4, top_k=k,
            strategy=decode.Strategy(top_k=True)))(jnp.float32(3))


def teacher_forced_logprobs(model, params, prompts, lengths, tokens_BN, new_lengths_B):
    """The log-probability of each generated token under the full forward pass over the
    prompt (source) and the generated tokens, summed over the tokens up to each end."""
    cfg = model.config
    B, N = tokens_BN.shape
    if cfg.is_encoder_decoder:
        tgt_in_BN = jnp.concatenate(
            [jnp.full((B, 1), cfg.bos_id, jnp.int32), tokens_BN[:, :-1]], axis=1)
        logits_BNV = model.apply({"params": params}, prompts, tgt_in_BN, src_lengths=lengths)
    else:
        # Row b: its prompt, then its new tokens from position lengths[b] on.
        seq_BT = np.zeros((B, prompts.shape[1] + N), np.int32)
        for b in range(B):
            seq_BT[b, : lengths[b]] = prompts[b, : lengths[b]]
            seq_BT[b, lengths[b]: lengths[b] + N] = tokens_BN[b]
        logits_BTV = model.apply({"params": params}, jnp.asarray(seq_BT))
        predicts_BN = (lengths - 1)[:, None] + np.arange(N)[None, :]
        logits_BNV = jnp.take_along_axis(logits_BTV, jnp.asarray(predicts_BN)[:, :, None], 1)
    logprobs_BN = jnp.take_along_axis(jax.nn.log_softmax(logits_BNV, axis=-1),
                                      tokens_BN[:, :, None], axis=-1)[:, :, 0]
    real_BN = jnp.arange(N)[None, :] < new_lengths_B[:, None]
    return jnp.where(real_BN, logprobs_BN, 0.0).sum()


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_grad_of_generated_logprobs_equals_the_teacher_forced_gradient(arch):
    model, params = setup(arch)
    prompts, lengths = decode.pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=6, eos_id=ending_eos(model, params, prompts, lengths, 6),
              loop="scan")
    out = decode.generate(model, params, prompts, lengths, **kw)
    value, grads = jax.jit(jax.value_and_grad(lambda p: decode.generate(
        model, p, prompts, lengths, **kw).logprobs.sum()))(params)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(lambda p: teacher_forced_logprobs(
        model, p, prompts, lengths, np.asarray(out.tokens), np.asarray(out.lengths))))(params)
    np.testing.assert_allclose(value, ref_value, atol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=1e-4)
    assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)) > 1.0
