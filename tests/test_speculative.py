"""Speculative decoding (`decode.speculative`): greedy gives exactly the target's greedy
tokens, sampling keeps the target's distribution (checked statistically), for both
generative families, ragged batches, end tokens and every token constraint."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
import models
from models.errors import UserError
from tests.helpers import tiny

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]


@functools.cache
def pair(arch: str, vocab_size: int = 61):
    """A target and a smaller draft of the same family and vocabulary, random weights."""
    cfg = tiny(arch, max_len=40, vocab_size=vocab_size)
    small = cfg.replace(d_model=16, num_heads=2, head_dim=None, num_kv_heads=None, mlp_dim=32,
                        num_layers=1, num_encoder_layers=1, num_decoder_layers=1)
    ones = jnp.ones((1, 3), jnp.int32)
    args = (ones, ones) if cfg.is_encoder_decoder else (ones,)
    target, draft = models.build(cfg), models.build(small)
    return (target, target.init(jax.random.key(0), *args)["params"], draft,
            draft.init(jax.random.key(1), *args)["params"])


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_the_targets_greedy_with_end_tokens_and_constraints(arch, k):
    target, params, draft, draft_params = pair(arch)
    prompts, lengths = decode.pad_prompts(PROMPTS)
    free = decode.generate(target, params, prompts, lengths, max_new_tokens=10, eos_id=None)
    eos = int(free.tokens[0, 4])                 # row 0 ends early
    cases = [dict(eos_id=None), dict(eos_id=eos),
             dict(eos_id=eos, banned_ids=(int(free.tokens[1, 1]),), min_new_tokens=[6, 0, 2],
                  forced_bos_id=7, forced_eos_id=9, repetition_penalty=1.5,
                  no_repeat_ngram_size=2)]
    for options in cases:
        plain = decode.generate(target, params, prompts, lengths, max_new_tokens=10, **options)
        fast = decode.generate(target, params, prompts, lengths, max_new_tokens=10,
                               draft_model=draft, draft_params=draft_params, draft_tokens=k,
                               **options)
        np.testing.assert_array_equal(fast.tokens, plain.tokens, err_msg=str(options))
        np.testing.assert_array_equal(fast.lengths, plain.lengths)
        np.testing.assert_allclose(fast.logprobs, plain.logprobs, atol=1e-5)
        # The target's cache holds the decoder prompt and every new token but the last.
        prompt = np.ones(3) if arch == "encoder_decoder" else np.asarray(lengths)
        np.testing.assert_array_equal(fast.cache_lengths, prompt + fast.lengths - 1)


def test_a_draft_that_agrees_is_accepted_whole():
    """The target as its own draft: every proposal is accepted, so each iteration gains
    k + 1 tokens."""
    target, params, _, _ = pair("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    out = decode.generate(target, params, prompts, lengths, max_new_tokens=9, eos_id=None,
                          draft_model=target, draft_params=params, draft_tokens=3)
    np.testing.assert_array_equal(out.accepted, out.drafted)   # 2 iterations of 3, then 4 + 4
    np.testing.assert_array_equal(out.drafted, [6, 6, 6])


def _exact_continuations(target, params, prompt, first, vocab, logits_fn):
    """The target's exact distribution of the two tokens after `prompt + [first]`, under
    the processed logits `logits_fn`: float64[V, V]."""
    base = jnp.asarray([prompt + [first]])
    p2 = np.asarray(jax.nn.softmax(logits_fn(target.apply({"params": params}, base)[0, -1])),
                    np.float64)
    rows = jnp.asarray([prompt + [first, x] for x in range(vocab)])
    p3 = np.asarray(jax.nn.softmax(jax.vmap(logits_fn)(
        target.apply({"params": params}, rows)[:, -1])), np.float64)
    return p2[:, None] * p3


@pytest.mark.parametrize("top_k", [0, 4])
def test_sampling_keeps_the_targets_distribution(top_k):
    """4000 rows of one prompt, the first token forced, sampled with a draft that disagrees
    with the target: the empirical distribution of the next two tokens is the target's
    exact one (total variation within sampling noise), with top-k filtering and a banned
    id applied to both models."""
    V = 8
    target, params, draft, draft_params = pair("decoder_only", vocab_size=V)
    prompt, rows, banned = [4, 5, 6], 4000, 3
    prompts = np.tile(np.asarray([prompt], np.int32), (rows, 1))
    lengths = np.full((rows,), 3, np.int32)
    out = decode.generate(target, params, prompts, lengths, max_new_tokens=3, eos_id=None,
                          temperature=0.9, top_k=top_k, banned_ids=(banned,), forced_bos_id=5,
                          rng=jax.random.key(7), draft_model=draft, draft_params=draft_params,
                          draft_tokens=2)
    assert 0 < int(out.accepted.sum()) < int(out.drafted.sum())     # both rules are used

    def processed(logits):
        logits = logits.at[banned].set(-jnp.inf) / 0.9
        return decode.top_k_filter(logits[None], top_k)[0] if top_k else logits
    exact = _exact_continuations(target, params, prompt, 5, V, processed)
    counts = np.zeros((V, V))
    np.add.at(counts, (np.asarray(out.tokens[:, 1]), np.asarray(out.tokens[:, 2])), 1)
    assert np.all(np.asarray(out.tokens[:, 0]) == 5)
    tv = 0.5 * np.abs(counts / rows - exact).sum()
    assert tv < 0.05, tv
    if top_k:
        assert counts[exact == 0].sum() == 0       # nothing outside the target's support


def test_speculative_decoding_runs_inside_a_users_jit():
    target, params, draft, draft_params = pair("encoder_decoder")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=6, eos_id=None, draft_model=draft, draft_tokens=2)
    eager = decode.generate(target, params, prompts, lengths, draft_params=draft_params, **kw)
    jitted = jax.jit(lambda p, dp: decode.generate(target, p, prompts, lengths,
                                                   draft_params=dp, **kw))(params, draft_params)
    np.testing.assert_array_equal(jitted.tokens, eager.tokens)


def test_a_draft_that_does_not_fit_is_refused_by_name():
    target, params, draft, draft_params = pair("decoder_only")
    other = models.build(tiny("decoder_only", vocab_size=50, max_len=40))
    seq2seq = pair("encoder_decoder")[2]
    prompts, lengths = decode.pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=4)
    for options, message in (
            (dict(draft_model=other, draft_params=draft_params), r"vocab_size=50, the model 61"),
            (dict(draft_model=seq2seq, draft_params=draft_params),
             r"draft_model is encoder_decoder, the model decoder_only"),
            (dict(draft_model=draft), r"draft_model needs draft_params"),
            (dict(draft_model=draft, draft_params=draft_params, draft_tokens=0),
             r"draft_tokens=0 must be a positive int"),
            (dict(draft_model=draft, draft_params=draft_params, loop="scan"),
             r"loop='scan' is not speculative decoding's loop")):
        with pytest.raises(UserError, match=message):
            decode.generate(target, params, prompts, lengths, **kw, **options)
