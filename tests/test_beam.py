"""Beam search: exhaustive-search equality, greedy at beam 1, shared cross-attention K/V."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
import decode.beam
from decode.model_fns import start_decoding
from tests.helpers import fns, tiny


@functools.cache
def small_vocab_model():
    f = fns(tiny(vocab_size=6, max_len=16, positions="learned"))
    params = f.init()
    # Sharpen the random model so that sequence scores are well separated.
    params = jax.tree.map(lambda x: x, params)
    params["tokens"]["embedding"] = params["tokens"]["embedding"] * 40.0
    return f.model, params


def exhaustive(model, params, prompt, n, alpha, eos, top):
    """Every continuation of at most n tokens that has an end only as its last token."""
    seqs = [s for k in range(1, n + 1) for s in itertools.product(range(6), repeat=k)
            if (eos not in s[:-1]) and (k == n or s[-1] == eos)]
    width = len(prompt) + n
    batch = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        batch[i, : len(prompt) + len(s)] = list(prompt) + list(s)
    logp = jax.nn.log_softmax(model.apply({"params": params}, jnp.asarray(batch)), -1)
    scores = []
    for i, s in enumerate(seqs):
        total = sum(float(logp[i, len(prompt) - 1 + t, tok]) for t, tok in enumerate(s))
        scores.append(total / decode.gnmt_penalty(len(s), alpha))
    order = np.argsort(-np.array(scores), kind="stable")[:top]
    return [seqs[i] for i in order], [scores[i] for i in order]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_beam_search_equals_exhaustive_search(alpha):
    model, params = small_vocab_model()
    # W >= every candidate of every step (25 live prefixes x 6 tokens), so nothing is pruned
    # and the search is exact: the W best of all 181 sequences.
    n, W, eos = 3, 150, 1
    prompts, lengths = decode.pad_prompts([[3, 4], [5, 3, 4, 2]], width=4)
    out = decode.beam_search(model, params, prompts, lengths, beam_size=W, max_new_tokens=n,
                             length_penalty=alpha, eos_id=eos)
    for b in range(2):
        seqs, scores = exhaustive(model, params, prompts[b, : lengths[b]].tolist(), n, alpha,
                                  eos, W)
        got = [tuple(out.tokens[b, w, : out.lengths[b, w]].tolist()) for w in range(W)]
        assert got[:20] == seqs[:20]
        np.testing.assert_allclose(out.scores[b], scores, atol=1e-4, rtol=1e-5)
        assert np.all(np.diff(np.asarray(out.scores[b])) <= 0)
        # Padding after each beam's end.
        for w in range(W):
            assert not out.tokens[b, w, out.lengths[b, w]:].any()


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_beam_size_one_equals_greedy(arch):
    f = fns(tiny(arch, max_len=32))
    params = f.init()
    prompts, lengths = decode.pad_prompts([[5, 6, 7], [9, 10, 11, 12, 13], [20]])
    greedy = decode.generate(f.model, params, prompts, lengths, max_new_tokens=7, eos_id=None)
    beam = decode.beam_search(f.model, params, prompts, lengths, beam_size=1, max_new_tokens=7,
                              length_penalty=0.0, eos_id=None)
    np.testing.assert_array_equal(beam.tokens[:, 0], greedy.tokens)
    np.testing.assert_allclose(beam.scores[:, 0], greedy.logprobs.sum(1), atol=1e-4)
    # And with an end token that greedy meets.
    eos = int(greedy.tokens[0, 3])
    g = decode.generate(f.model, params, prompts, lengths, max_new_tokens=7, eos_id=eos)
    b = decode.beam_search(f.model, params, prompts, lengths, beam_size=1, max_new_tokens=7,
                           length_penalty=0.0, eos_id=eos)
    np.testing.assert_array_equal(b.tokens[:, 0], g.tokens)
    np.testing.assert_array_equal(b.lengths[:, 0], g.lengths)


def test_beams_share_the_cross_attention_keys_values():
    f = fns(tiny("encoder_decoder", max_len=32))
    params = f.init()
    prompts, lengths = decode.pad_prompts([[5, 6, 7], [9, 10]])
    _, cache = start_decoding(f.model, params, jnp.asarray(prompts), jnp.asarray(lengths), 9,
                              beams=4)
    assert cache.k.shape[1] == 8                        # self-attention: B * W rows
    assert cache.cross_k.shape[1] == 2                  # cross-attention: B rows, not tiled
    out = decode.beam_search(f.model, params, prompts, lengths, beam_size=4, max_new_tokens=8)
    assert out.tokens.shape == (2, 4, 8)
    # Each source's best beam is what the same source gives when searched alone.
    alone = decode.beam_search(f.model, params, *decode.pad_prompts([[9, 10]]), beam_size=4,
                               max_new_tokens=8)
    np.testing.assert_array_equal(out.tokens[1], alone.tokens[0])
    np.testing.assert_allclose(out.scores[1], alone.scores[0], atol=1e-5)


def test_beam_search_bad_input():
    f = fns(tiny(max_len=32))
    params = f.init()
    p, n = decode.pad_prompts([[5, 6]])
    with pytest.raises(ValueError, match=r"beam_size=0 must be a positive int"):
        decode.beam_search(f.model, params, p, n, beam_size=0, max_new_tokens=4)
    before = decode.beam._beam_search._cache_size()
    decode.beam_search(f.model, params, p, n, length_penalty=0.3, max_new_tokens=4)
    decode.beam_search(f.model, params, p, n, length_penalty=1.7, max_new_tokens=4)
    assert decode.beam._beam_search._cache_size() == before + 1   # alpha is traced
    with pytest.raises(ValueError, match=r"length_penalty=-1 is outside \[0.0, inf\)"):
        decode.beam_search(f.model, params, p, n, length_penalty=-1.0, max_new_tokens=4)
    with pytest.raises(ValueError,
                       match=r"max_new_tokens 30 = 38 is beyond the model's max_len 32"):
        decode.beam_search(f.model, params, p, n, max_new_tokens=30)
    with pytest.raises(ValueError, match=r"lengths must be an int array of shape \(1,\)"):
        decode.beam_search(f.model, params, p, np.array([2, 2]), max_new_tokens=4)


def test_the_steps_give_their_docstrings_worked_example():
    """One source, W = 2, V = 3, end id 2, at step 1 (decode.beam_steps' example)."""
    from decode import beam_steps as bs
    logits_RV = jnp.log(jnp.array([[0.02, 0.78, 0.20], [0.70, 0.01, 0.29]]))
    logprobs_BC, parent_BC, token_BC = bs.top_candidates(
        logits_RV, jnp.array([[-0.1, -1.5]]), C=4)
    np.testing.assert_allclose(logprobs_BC, [[-0.35, -1.71, -1.86, -2.74]], atol=0.005)
    np.testing.assert_array_equal(parent_BC, [[0, 0, 1, 1]])
    np.testing.assert_array_equal(token_BC, [[1, 2, 0, 2]])
    seqs_BCN = bs.extend(jnp.array([[[4, 0, 0], [7, 0, 0]]]), parent_BC, token_BC, 1)
    np.testing.assert_array_equal(seqs_BCN, [[[4, 1, 0], [4, 2, 0], [7, 0, 0], [7, 2, 0]]])
    ending_BC = bs.finishing(token_BC, logprobs_BC, jnp.array([2]), W=2)
    np.testing.assert_array_equal(ending_BC, [[False, True, False, False]])
    scores_BW, tokens_BWN, lengths_BW = bs.merge_finished(
        jnp.array([[-0.9, bs.NO_SEQUENCE_SCORE]]), jnp.array([[[5, 2, 0], [0, 0, 0]]]),
        jnp.array([[2, 0]]), seqs_BCN, logprobs_BC, ending_BC, 2, 0.0)
    np.testing.assert_allclose(scores_BW, [[-0.9, -1.71]], atol=0.005)
    np.testing.assert_array_equal(tokens_BWN, [[[5, 2, 0], [4, 2, 0]]])
    np.testing.assert_array_equal(lengths_BW, [[2, 2]])
    alive_BW, alive_tokens_BWN, parent_BW, token_BW = bs.select_alive(
        logprobs_BC, ending_BC, seqs_BCN, parent_BC, token_BC, W=2)
    np.testing.assert_allclose(alive_BW, [[-0.35, -1.86]], atol=0.005)
    np.testing.assert_array_equal(alive_tokens_BWN, [[[4, 1, 0], [7, 0, 0]]])
    np.testing.assert_array_equal(parent_BW, [[0, 1]])
    np.testing.assert_array_equal(token_BW, [[1, 0]])
    assert not bs.cannot_improve(scores_BW, alive_BW, 1.0)[0]
    np.testing.assert_array_equal(bs.cache_rows(jnp.array([[0, 1], [1, 1]])), [0, 1, 3, 3])


def test_lowered_beam_search_checks_like_beam_search_and_is_one_loop():
    f = fns(tiny(max_len=32))
    params = f.init()
    p, n = decode.pad_prompts([[5, 6], [7]])
    args, static = decode.beam_search_arguments(f.model, params, p, n, beam_size=3,
                                                max_new_tokens=4, length_penalty=0.3)
    assert static == dict(beam_size=3, max_new_tokens=4, cache_len=12, eos_ids=(1,))
    text = decode.beam_search.lower(f.model, params, p, n, beam_size=3,
                                    max_new_tokens=4).as_text()
    assert text.count("stablehlo.while") == 1
    with pytest.raises(ValueError, match=r"beam_size=0 must be a positive int"):
        decode.beam_search.lower(f.model, params, p, n, beam_size=0, max_new_tokens=4)
    with pytest.raises(TypeError):
        decode.beam_search.lower(f.model, params, p, n, max_new_tokens=4, temperature=0.5)
