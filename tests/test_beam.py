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
from models.cache import layer_shape
from tests.helpers import fns, tiny


@functools.cache
def small_vocab_model():
    f = fns(tiny(vocab_size=6, max_len=16, positions="learned"))
    params = f.init()
    # Sharpen the random model so that sequence scores are well separated.
    params = jax.tree.map(lambda x: x, params)
    params["tokens"]["embedding"] = params["tokens"]["embedding"] * 40.0
    return f.model, params


def exhaustive(model, params, prompt, n, alpha, eos, top, normalization="gnmt"):
    """Every continuation of at most n tokens that has an end only as its last token, and
    its score, best first."""
    ends = (eos,) if isinstance(eos, int) else tuple(eos)
    V = model.config.vocab_size
    seqs = [s for k in range(1, n + 1) for s in itertools.product(range(V), repeat=k)
            if not set(ends) & set(s[:-1]) and (k == n or s[-1] in ends)]
    width = len(prompt) + n
    batch = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        batch[i, : len(prompt) + len(s)] = list(prompt) + list(s)
    logp = jax.nn.log_softmax(fns(model.config).forward(params, jnp.asarray(batch)), -1)
    scores = []
    for i, s in enumerate(seqs):
        total = sum(float(logp[i, len(prompt) - 1 + t, tok]) for t, tok in enumerate(s))
        penalty = len(s) ** alpha if normalization == "hf" else decode.gnmt_penalty(len(s), alpha)
        scores.append(total / float(penalty))
    order = np.argsort(-np.array(scores), kind="stable")[:top]
    return [seqs[i] for i in order], [scores[i] for i in order]


@pytest.mark.parametrize(("alpha", "beam_cache"),
                         [(0.0, "table"), (0.6, "table"), (2.0, "table"), (0.6, "gathered")])
def test_beam_search_equals_exhaustive_search(alpha, beam_cache):
    model, params = small_vocab_model()
    # W >= every candidate of every step (25 live prefixes x 6 tokens), so nothing is pruned
    # and the search is exact: the W best of all 181 sequences.
    n, W, eos = 3, 150, 1
    prompts, lengths = decode.pad_prompts([[3, 4], [5, 3, 4, 2]], width=4)
    out = decode.beam_search(model, params, prompts, lengths, beam_size=W, max_new_tokens=n,
                             length_penalty=alpha, eos_id=eos, beam_cache=beam_cache)
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


def test_hf_normalisation_with_an_exact_stop_finds_the_best_sequences():
    """A chain: V = 3 and two end ids, so each step has one alive beam and 3 candidates,
    W = 3 keeps them all (the search prunes nothing) and the pool is full from step 1 on.
    What remains is when to stop: under "hf" with alpha > 0 a longer sequence can score
    higher than any finished one although its sum is lower, so stopping when no alive beam
    beats the pool *at its current length* loses it (seed 1, alpha 1 does); the bound over
    every reachable length does not."""
    f = fns(tiny(vocab_size=3, max_len=16, positions="learned"))
    params = f.init(1)
    prompts, lengths = decode.pad_prompts([[0, 2], [2, 0, 0, 2]], width=4)
    n, W, eos = 5, 3, (1, 2)
    for alpha in (-1.0, 0.5, 1.0, 2.0):
        out = decode.beam_search(f.model, params, prompts, lengths, beam_size=W,
                                 max_new_tokens=n, length_penalty=alpha, eos_id=eos,
                                 length_normalization="hf")
        for b in range(2):
            seqs, scores = exhaustive(f.model, params, prompts[b, : lengths[b]].tolist(), n,
                                      alpha, eos, W, normalization="hf")
            got = [tuple(out.tokens[b, w, : out.lengths[b, w]].tolist()) for w in range(W)]
            assert got == seqs, (alpha, b)
            np.testing.assert_allclose(out.scores[b], scores, atol=1e-4, rtol=1e-5)


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
    assert cache.batch_size == 8                        # self-attention: B * W rows
    assert layer_shape(cache.cross_k)[0] == 2           # cross-attention: B rows, not tiled
    out = decode.beam_search(f.model, params, prompts, lengths, beam_size=4, max_new_tokens=8)
    assert out.tokens.shape == (2, 4, 8)
    # Each source's best beam is what the same source gives when searched alone.
    alone = decode.beam_search(f.model, params, *decode.pad_prompts([[9, 10]]), beam_size=4,
                               max_new_tokens=8)
    np.testing.assert_array_equal(out.tokens[1], alone.tokens[0])
    np.testing.assert_allclose(out.scores[1], alone.scores[0], atol=1e-5)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_both_beam_caches_give_the_same_beams(arch):
    """Beams whose rows are gathered by parent every step, and beams whose keys and values
    stay put behind an ancestry table (models.BeamKVCache), with ragged prompts, an end
    token and n-gram blocking: the same tokens, lengths and scores."""
    f = fns(tiny(arch, max_len=40, vocab_size=11))
    params = f.init()
    prompts, lengths = decode.pad_prompts([[5, 6, 7], [9, 10, 3, 4, 8], [2]])
    kw = dict(beam_size=3, max_new_tokens=9, eos_id=3, no_repeat_ngram_size=2)
    table = decode.beam_search(f.model, params, prompts, lengths, **kw)
    gathered = decode.beam_search(f.model, params, prompts, lengths, beam_cache="gathered", **kw)
    np.testing.assert_array_equal(table.tokens, gathered.tokens)
    np.testing.assert_array_equal(table.lengths, gathered.lengths)
    np.testing.assert_allclose(table.scores, gathered.scores, atol=1e-5)
    assert (gathered.lengths < 9).any() and (gathered.lengths > 1).any()   # ends and lives


def test_beam_search_bad_input():
    f = fns(tiny(max_len=32))
    params = f.init()
    p, n = decode.pad_prompts([[5, 6]])
    with pytest.raises(ValueError, match=r"beam_size=0 must be a positive int"):
        decode.beam_search(f.model, params, p, n, beam_size=0, max_new_tokens=4)
    before = decode.beam._beam_search._cache_size()
    decode.beam_search(f.model, params, p, n, length_penalty=0.3, max_new_tokens=4)
    decode.beam_search(f.model, params, p, n, length_penalty=1.7, max_new_tokens=4)
    for early_stopping in (True, False):
        decode.beam_search(f.model, params, p, n, length_penalty=1.7, max_new_tokens=4,
                           early_stopping=early_stopping)
    assert decode.beam._beam_search._cache_size() == before + 1   # alpha, the rule traced
    for bad in (1, "true", None):
        with pytest.raises(ValueError, match=rf"early_stopping={bad!r} must be True, False "
                                             r"or 'never'"):
            decode.beam_search(f.model, params, p, n, max_new_tokens=4, early_stopping=bad)
    with pytest.raises(ValueError, match=r"length_penalty=-1 is outside \[0.0, inf\)"):
        decode.beam_search(f.model, params, p, n, length_penalty=-1.0, max_new_tokens=4)
    decode.beam_search(f.model, params, p, n, length_penalty=-1.0, max_new_tokens=4,
                       length_normalization="hf")              # transformers allows < 0
    with pytest.raises(ValueError, match=r"length_penalty=inf is outside \(-inf, inf\)"):
        decode.beam_search(f.model, params, p, n, length_penalty=np.inf, max_new_tokens=4,
                           length_normalization="hf")
    with pytest.raises(ValueError, match=r"length_normalization='GNMT' must be one of"):
        decode.beam_search(f.model, params, p, n, max_new_tokens=4, length_normalization="GNMT")
    with pytest.raises(ValueError, match=r"beam_cache='tree' must be one of \('table', "):
        decode.beam_search(f.model, params, p, n, max_new_tokens=4, beam_cache="tree")
    with pytest.raises(ValueError, match=r"renormalize_logits must be a bool, got 1"):
        decode.beam_search(f.model, params, p, n, max_new_tokens=4, renormalize_logits=1)
    with pytest.raises(ValueError, match=r"banned_ids hold token id 99 outside"):
        decode.beam_search(f.model, params, p, n, max_new_tokens=4, banned_ids=[99])
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
        (jnp.array([[-0.9, bs.NO_SEQUENCE_SCORE]]), jnp.array([[[5, 2, 0], [0, 0, 0]]]),
         jnp.array([[2, 0]])), seqs_BCN, logprobs_BC, ending_BC, length=2, alpha=0.0)
    np.testing.assert_allclose(scores_BW, [[-0.9, -1.71]], atol=0.005)
    np.testing.assert_array_equal(tokens_BWN, [[[5, 2, 0], [4, 2, 0]]])
    np.testing.assert_array_equal(lengths_BW, [[2, 2]])
    ends_BC = bs.adds_end(token_BC, jnp.array([2]))
    np.testing.assert_array_equal(ends_BC, [[False, True, False, True]])
    alive_BW, alive_tokens_BWN, parent_BW, token_BW = bs.select_alive(
        logprobs_BC, ends_BC, seqs_BCN, parent_BC, token_BC, W=2)
    np.testing.assert_allclose(alive_BW, [[-0.35, -1.86]], atol=0.005)
    np.testing.assert_array_equal(alive_tokens_BWN, [[[4, 1, 0], [7, 0, 0]]])
    np.testing.assert_array_equal(parent_BW, [[0, 1]])
    np.testing.assert_array_equal(token_BW, [[1, 0]])
    assert not bs.cannot_improve(scores_BW, alive_BW, 1.0, 1.0)[0]
    # "hf", alpha 1: the bound takes the longest length (3), not the current one (2).
    hf = functools.partial(bs.length_penalty, alpha=1.0, normalization="hf")
    finished, alive = jnp.array([[-0.9, -1.0]]), jnp.array([[-2.4, -3.0]])
    assert not bs.cannot_improve(finished, alive, hf(2), hf(3))[0]     # bound -0.8
    assert bs.cannot_improve(finished, alive, hf(2), hf(2))[0]         # -1.2 would stop
    np.testing.assert_array_equal(bs.cache_rows(jnp.array([[0, 1], [1, 1]])), [0, 1, 3, 3])


def test_token_logprobs_and_the_normalisations_give_their_docstrings_examples():
    from decode import beam_steps as bs
    from decode.processors import Constraints
    none = Constraints.none(3, 1)
    banned = none.replace(banned=jnp.array([False, True, False]))
    logits = jnp.zeros((1, 3))
    np.testing.assert_allclose(bs.token_logprobs(logits, banned, 0, 3),
                               [[-1.0986, -np.inf, -1.0986]], atol=1e-4)
    np.testing.assert_allclose(bs.token_logprobs(logits, banned, 0, 3, renormalize=True),
                               [[-0.6931, -np.inf, -0.6931]], atol=1e-4)
    forced = none.replace(forced_bos=jnp.int32(2))
    np.testing.assert_array_equal(bs.token_logprobs(logits, forced, 0, 3),
                                  [[-np.inf, -np.inf, 0.0]])
    np.testing.assert_allclose(bs.token_logprobs(logits, forced, 1, 3), [[-1.0986] * 3],
                               atol=1e-4)                               # only at step 0
    # The module docstring: log-prob -6 at length 4, alpha 1.
    assert float(-6.0 / bs.length_penalty(4, 1.0, "gnmt")) == -4.0
    assert float(-6.0 / bs.length_penalty(4, 1.0, "hf")) == -1.5
    with pytest.raises(ValueError, match=r"length_normalization='nope' must be one of"):
        bs.length_penalty(4, 1.0, "nope")


def test_lowered_beam_search_checks_like_beam_search_and_is_one_loop():
    f = fns(tiny(max_len=32))
    params = f.init()
    p, n = decode.pad_prompts([[5, 6], [7]])
    args, static = decode.beam_search_arguments(f.model, params, p, n, beam_size=3,
                                                max_new_tokens=4, length_penalty=0.3)
    assert static == dict(beam_size=3, max_new_tokens=4, cache_len=12, eos_ids=(1,),
                          normalization="gnmt", no_repeat=False, constrained=False,
                          beam_cache="table")
    text = decode.beam_search.lower(f.model, params, p, n, beam_size=3,
                                    max_new_tokens=4).as_text()
    assert text.count("stablehlo.while") == 1
    with pytest.raises(ValueError, match=r"beam_size=0 must be a positive int"):
        decode.beam_search.lower(f.model, params, p, n, beam_size=0, max_new_tokens=4)
    with pytest.raises(TypeError):
        decode.beam_search.lower(f.model, params, p, n, max_new_tokens=4, temperature=0.5)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_constraints_in_beam_search_and_beam_one_equals_constrained_greedy(arch):
    """Beam 1 with constraints is greedy with the same constraints; at beam 3 every beam
    keeps them (forced first and last tokens, banned ids, no end before 3 tokens, no
    repeated bigram), and new values never recompile."""
    f = fns(tiny(arch, max_len=32))
    params = f.init()
    prompts, lengths = decode.pad_prompts([[5, 6, 7], [9, 10, 11, 12, 13], [20]])
    n = 7
    free = decode.generate(f.model, params, prompts, lengths, max_new_tokens=n, eos_id=None)
    eos, banned = int(free.tokens[0, 1]), (int(free.tokens[1, 0]), int(free.tokens[2, 1]))
    kw = dict(max_new_tokens=n, eos_id=eos, forced_bos_id=8, forced_eos_id=9,
              banned_ids=banned, min_new_tokens=3, no_repeat_ngram_size=2)
    greedy = decode.generate(f.model, params, prompts, lengths, **kw)
    beam1 = decode.beam_search(f.model, params, prompts, lengths, beam_size=1,
                               length_penalty=0.0, **kw)
    np.testing.assert_array_equal(beam1.tokens[:, 0], greedy.tokens)
    out = decode.beam_search(f.model, params, prompts, lengths, beam_size=3,
                             length_penalty=1.0, length_normalization="hf", **kw)
    for b in range(3):
        for w in range(3):
            seq = out.tokens[b, w, : out.lengths[b, w]].tolist()
            assert seq[0] == 8 and not set(banned) & set(seq), (b, w, seq)
            assert eos not in seq[:3] and seq[-1] in (eos, 9), (b, w, seq)
            body = seq[:-1] if len(seq) == n else seq      # a forced last token may repeat
            bigrams = list(zip(body[:-1], body[1:], strict=True))
            assert len(set(bigrams)) == len(bigrams), (b, w, seq)
    size = decode.beam._beam_search._cache_size()
    decode.beam_search(f.model, params, prompts, lengths, beam_size=3, length_penalty=0.5,
                       length_normalization="hf", **{**kw, "forced_bos_id": None,
                                                     "banned_ids": (3,), "min_new_tokens": 0,
                                                     "no_repeat_ngram_size": 4})
    assert decode.beam._beam_search._cache_size() == size


def test_a_candidate_that_ends_below_the_w_best_is_dropped_not_kept_alive():
    """A stub model (V = 3: x, y and the end token e; the next-token probabilities depend
    on the last token only), W = 2. At step 1 the candidates rank x e (.25, ends),
    x x (.20), y e (.18), y x (.06): y e adds an end token but ranks 3rd, so it is dropped,
    as transformers drops it, and y x stays alive instead (kept alive, y e would go on past
    its end: y e x)."""
    import flax.struct

    from decode import beam_steps as bs

    @flax.struct.dataclass
    class NoCache:
        rows: jax.Array

        def take_rows(self, rows):
            return NoCache(self.rows[rows])

    after = jnp.log(jnp.array([[0.4, 0.1, 0.5],          # after x
                               [0.2, 0.2, 0.6],          # after y
                               [1 / 3, 1 / 3, 1 / 3]]))  # after e (never reached)
    first = jnp.log(jnp.array([[0.5, 0.3, 0.2]] * 2))
    state = bs.beam_init(first, NoCache(jnp.zeros(2)), beam_size=2, max_new_tokens=3)
    state = bs.beam_loop(lambda tokens, cache: (after[tokens], cache), state, alpha=0.0,
                         eos_ids=(2,))
    np.testing.assert_array_equal(state.alive_tokens[0], [[0, 0, 0], [1, 0, 0]])  # xxx, yxx
    tokens, scores, lengths = bs.finalize(state, 0.0, pad_id=0)
    np.testing.assert_array_equal(tokens[0], [[0, 2, 0], [0, 0, 2]])     # x e, x x e
    np.testing.assert_allclose(scores[0], np.log([0.25, 0.1]), atol=1e-6)

