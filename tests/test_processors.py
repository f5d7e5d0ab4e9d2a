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


# The token constraints: forced, banned and end ids before a minimum length, no repeats.

def test_force_ban_and_min_length_give_their_docstring_examples():
    logits = jnp.array([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    np.testing.assert_array_equal(decode.force_token(logits, 0, jnp.array([True, False])),
                                  [[0.0, -INF, -INF], [1.0, 3.0, 2.0]])
    np.testing.assert_array_equal(decode.force_token(logits, -1, True), logits)   # -1: none
    np.testing.assert_array_equal(decode.force_token(logits, jnp.array([2, 1]), True),
                                  [[-INF, -INF, 0.0], [-INF, 0.0, -INF]])
    np.testing.assert_array_equal(decode.ban_tokens(logits, jnp.array([False, True, False])),
                                  [[1.0, -INF, 2.0], [1.0, -INF, 2.0]])
    end = jnp.array([False, True, False])
    np.testing.assert_array_equal(
        decode.ban_end_before(jnp.zeros((2, 3)), end, 2, jnp.array([3, 2])),
        [[0.0, -INF, 0.0], [0.0, 0.0, 0.0]])


def test_constrain_logits_applies_in_transformers_order_so_a_forced_token_wins():
    c = decode.Constraints.none(4, 1).replace(
        banned=jnp.array([False, True, False, False]), forced_bos=jnp.int32(1),
        forced_eos=jnp.int32(3), min_new_tokens=jnp.array([9]),
        end=jnp.array([False, False, False, True]))
    logits = jnp.array([[0.5, 2.0, 1.0, 3.0]])
    # Step 0: 1 is banned but forced; step 1: 1 banned, the end id 3 too (min length);
    # the last step (3): 3 is forced although min length bans it.
    np.testing.assert_array_equal(decode.constrain_logits(logits, c, 0, 3),
                                  [[-INF, 0.0, -INF, -INF]])
    np.testing.assert_array_equal(decode.constrain_logits(logits, c, 1, 3),
                                  [[0.5, -INF, 1.0, -INF]])
    np.testing.assert_array_equal(decode.constrain_logits(logits, c, 3, 3),
                                  [[-INF, -INF, -INF, 0.0]])


def naive_repeated(seq, n, V):
    """Oracle: the tokens that complete an n-gram already in seq (every window compared)."""
    banned = np.zeros(V, bool)
    if n == 0 or len(seq) < n:
        return banned
    prefix = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
    for i in range(len(seq) - n + 1):
        if tuple(seq[i:i + n - 1]) == prefix:
            banned[seq[i + n - 1]] = True
    return banned


def test_ngram_history_equals_comparing_every_window():
    """Sequences over 3 symbols repeat often; rows of different lengths, extended token by
    token, are checked after every token for n = 0 (off) to 5."""
    from decode import ngrams
    rng = np.random.default_rng(0)
    V, B, P, N = 5, 4, 6, 10
    seqs = rng.integers(0, 3, (B, P + N)).astype(np.int32)
    lengths = np.array([1, 3, 6, 4], np.int32)
    h = ngrams.start(jnp.asarray(seqs[:, :P]), jnp.asarray(lengths), P + N)
    append = jax.jit(ngrams.append)
    for step in range(N + 1):
        for n in range(6):
            got = np.asarray(ngrams.repeated(h, n, V))
            for b in range(B):
                seq = list(seqs[b, :lengths[b]]) + list(seqs[b, P:P + step])
                np.testing.assert_array_equal(got[b], naive_repeated(seq, n, V),
                                              err_msg=f"row {b}, step {step}, n {n}")
        if step < N:
            h = append(h, jnp.asarray(seqs[:, P + step]))


def test_constraints_equal_transformers_logits_processors_on_random_logits():
    """Each constraint against transformers' own processor on random logits, and the five
    composed in the order transformers' generate builds them, at every step of a decode
    whose decoder input starts with one token (an encoder-decoder's start token)."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    from decode import ngrams
    rng = np.random.default_rng(0)
    B, V, N, eos = 3, 11, 6, [2, 5]
    # The forced first token is banned and the forced last one is an end id still banned
    # by the minimum length: the order decides, and the forced ones win.
    banned, bos, forced_eos, min_new, n = [4, 7], 4, 2, N, 2
    max_length = 1 + N                                   # the start token and N new tokens
    inputs = np.concatenate([np.zeros((B, 1), np.int64),
                             rng.integers(0, 4, (B, N))], 1)    # repeats of 0..3
    theirs = {
        "banned": lp.NoBadWordsLogitsProcessor([[i] for i in banned] + [[eos[0]]], eos),
        "suppress": lp.SuppressTokensLogitsProcessor(banned),
        "bos": lp.ForcedBOSTokenLogitsProcessor(bos),
        "eos": lp.ForcedEOSTokenLogitsProcessor(max_length, forced_eos),
        "min_length": lp.MinLengthLogitsProcessor(1 + min_new, eos),
        "min_new": lp.MinNewTokensLengthLogitsProcessor(1, min_new, eos),
        "ngram": lp.NoRepeatNGramLogitsProcessor(n),
    }
    composed = lp.LogitsProcessorList([theirs[k] for k in ("ngram", "banned", "min_length",
                                                           "bos", "eos")])
    end = np.isin(np.arange(V), eos)
    c = decode.Constraints.none(V, B).replace(
        banned=jnp.asarray(np.isin(np.arange(V), banned)), forced_bos=jnp.int32(bos),
        forced_eos=jnp.int32(forced_eos), min_new_tokens=jnp.full((B,), min_new),
        end=jnp.asarray(end), no_repeat_ngram_size=jnp.int32(n))
    h = ngrams.start(jnp.asarray(inputs[:, :1], jnp.int32), jnp.ones((B,), jnp.int32), 1 + N)
    for step in range(N):
        ids = torch.as_tensor(inputs[:, :1 + step])
        logits = rng.normal(size=(B, V)).astype(np.float32)
        def hf(p, x=logits, ids=ids):
            return p(ids, torch.as_tensor(x)).numpy()
        x = jnp.asarray(logits)
        ours = {
            "banned": decode.ban_tokens(x, c.banned),
            "bos": decode.force_token(x, bos, step == 0),
            "eos": decode.force_token(x, forced_eos, step == N - 1),
            "min_length": decode.ban_end_before(x, c.end, step, min_new),
            "ngram": decode.ban_tokens(x, ngrams.repeated(h, n, V)),
        }
        ours["suppress"], ours["min_new"] = ours["banned"], ours["min_length"]
        for name, p in theirs.items():
            np.testing.assert_array_equal(np.asarray(ours[name]), hf(p),
                                          err_msg=f"{name}, step {step}")
        np.testing.assert_array_equal(
            np.asarray(decode.constrain_logits(x, c, step, N - 1, ngrams.repeated(h, n, V))),
            hf(composed), err_msg=f"composed, step {step}")
        h = ngrams.append(h, jnp.asarray(inputs[:, 1 + step], jnp.int32))
