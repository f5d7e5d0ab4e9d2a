"""Logits processors keep exactly the right tokens; sampling matches the softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
from decode.processors import SamplingParams, Strategy, select_tokens

INF = np.inf


def kept(logits):
    return np.isfinite(np.asarray(logits))


def test_top_k_keeps_exactly_k_with_ties_to_the_lower_id():
    logits = jnp.array([[1.0, 3.0, 3.0, 2.0, 3.0],
                        [5.0, 4.0, 3.0, 2.0, 1.0]])
    np.testing.assert_array_equal(kept(decode.top_k_filter(logits, 2)),
                                  [[0, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    # Per-row k, and 0 means off.
    np.testing.assert_array_equal(kept(decode.top_k_filter(logits, jnp.array([0, 1]))),
                                  [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    out = decode.top_k_filter(logits, 3)
    np.testing.assert_array_equal(out[kept(out)], logits[kept(out)])  # survivors unchanged


def test_top_p_boundary():
    logits = jnp.log(jnp.array([[0.5, 0.25, 0.125, 0.125]]))   # exact binary fractions
    def keep(p):
        return kept(decode.top_p_filter(logits, p))[0].tolist()
    assert keep(0.5) == [1, 0, 0, 0]        # mass 0.5 reaches p: stop
    assert keep(0.51) == [1, 1, 0, 0]       # the token that crosses p is kept
    assert keep(0.75) == [1, 1, 0, 0]
    assert keep(0.76) == [1, 1, 1, 1]       # the two 0.125 tie: both kept
    assert keep(1e-6) == [1, 0, 0, 0]       # at least one token survives
    assert keep(1.0) == [1, 1, 1, 1]
    shuffled = logits[:, jnp.array([2, 0, 3, 1])]
    assert kept(decode.top_p_filter(shuffled, 0.75))[0].tolist() == [0, 1, 0, 1]


def test_min_p_keeps_tokens_above_a_fraction_of_the_top():
    probs = jnp.array([[0.4, 0.2, 0.19, 0.01, 0.2]])
    # Threshold min_p * 0.4: 0.49 keeps the 0.2s (>= 0.196) but not 0.19; 0.51 drops them.
    np.testing.assert_array_equal(kept(decode.min_p_filter(jnp.log(probs), 0.49)),
                                  [[1, 1, 0, 0, 1]])
    np.testing.assert_array_equal(kept(decode.min_p_filter(jnp.log(probs), 0.51)),
                                  [[1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(
        kept(decode.min_p_filter(jnp.log(jnp.concatenate([probs, probs])),
                                 jnp.array([0.49, 0.01]))),
        [[1, 1, 0, 0, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(kept(decode.min_p_filter(jnp.log(probs), 0.0)),
                                  [[1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(kept(decode.min_p_filter(jnp.log(probs), 0.99)),
                                  [[1, 0, 0, 0, 0]])


def test_temperature_and_repetition_penalty():
    logits = jnp.array([[2.0, -1.0, 0.5], [2.0, -1.0, 0.5]])
    np.testing.assert_allclose(decode.apply_temperature(logits, jnp.array([0.5, 0.0])),
                               [[4.0, -2.0, 1.0], [2.0, -1.0, 0.5]])
    seen = jnp.array([[True, True, False], [False, False, False]])
    np.testing.assert_allclose(decode.apply_repetition_penalty(logits, seen, 2.0),
                               [[1.0, -2.0, 0.5], [2.0, -1.0, 0.5]])


def _sample(logits_V, temperature, n, seed=0):
    params = SamplingParams(*(jnp.full((n,), v) for v in (temperature, 0, 1.0, 0.0, 1.0)))
    logits_BV = jnp.broadcast_to(logits_V, (n, logits_V.shape[0]))
    logits_BV = decode.apply_temperature(logits_BV, temperature)
    return select_tokens(logits_BV, jax.random.key(seed), params, Strategy(sample=True))


def test_sampling_is_reproducible_and_matches_the_softmax():
    logits = jnp.array([1.0, 0.2, -0.5, 2.0, 0.0])
    a, b = _sample(logits, 0.7, 20_000), _sample(logits, 0.7, 20_000)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, _sample(logits, 0.7, 20_000, seed=1))
    freq = np.bincount(np.asarray(a), minlength=5) / a.size
    # 20,000 draws: the standard error of each frequency is <= 0.0036; allow 4 of them.
    np.testing.assert_allclose(freq, jax.nn.softmax(logits / 0.7), atol=0.015)


def test_greedy_rows_inside_a_sampling_batch_take_the_argmax():
    logits = jnp.array([[0.0, 1.0, 0.9], [0.0, 1.0, 0.9]])
    params = SamplingParams(jnp.array([0.0, 1.0]), jnp.zeros(2, jnp.int32), jnp.ones(2),
                            jnp.zeros(2), jnp.ones(2))
    for seed in range(20):
        assert int(select_tokens(logits, jax.random.key(seed), params,
                                 Strategy(sample=True))[0]) == 1


def sorted_top_k(logits, k):
    """Oracle: a stable descending sort, keep the first k."""
    order = np.argsort(-logits, axis=-1, kind="stable")
    keep = np.zeros(logits.shape, bool)
    for b in range(logits.shape[0]):
        keep[b, order[b, :k]] = True
    return keep


def sorted_top_p(logits, p):
    """Oracle: sort probabilities, keep while the mass before a token is below p, plus ties."""
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), -1), np.float64)
    keep = np.zeros(logits.shape, bool)
    for b in range(logits.shape[0]):
        s = np.sort(probs[b])[::-1]
        before = np.cumsum(s) - s
        keep[b] = probs[b] >= s[np.sum(before < p) - 1]
    return keep


@pytest.mark.parametrize("seed", range(5))
def test_bisection_filters_equal_sorting_oracles(seed):
    rng = np.random.default_rng(seed)
    # Few distinct values, so ties are everywhere; negative, positive and -inf logits.
    logits = rng.integers(-6, 6, (4, 50)).astype(np.float32) * 0.75
    logits[0, :3] = -np.inf
    for k in (1, 2, 7, 49, 50):
        np.testing.assert_array_equal(kept(decode.top_k_filter(jnp.asarray(logits), k)),
                                      sorted_top_k(logits, k) & np.isfinite(logits),
                                      err_msg=f"k={k}")
    smooth = rng.normal(size=(4, 300)).astype(np.float32) * 3
    for p in (0.05, 0.3, 0.9, 0.999):
        np.testing.assert_array_equal(kept(decode.top_p_filter(jnp.asarray(smooth), p)),
                                      sorted_top_p(smooth, p), err_msg=f"p={p}")


@pytest.mark.parametrize("fn,arg", [(decode.top_k_filter, 2), (decode.top_p_filter, 0.5),
                                    (decode.min_p_filter, 0.3)])
def test_processors_run_under_jit(fn, arg):
    logits = jax.random.normal(jax.random.key(0), (3, 11))
    np.testing.assert_array_equal(jax.jit(fn)(logits, arg), fn(logits, arg))
