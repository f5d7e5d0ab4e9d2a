"""decode.DecodeRequest: it checks itself, changes field by field, and decodes exactly as the
same keyword arguments do through generate, beam_search and run (one set-up, one lowering
path: `decode.setup.DecodeCall`)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
from decode import DecodeRequest
from decode.beam_steps import STOPPINGS
from decode.generate import _generate
from models.errors import UserError
from tests.helpers import fns, tiny

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]]


@functools.cache
def setup(arch):
    f = fns(tiny(arch, num_kv_heads=2, max_len=32))
    prompts, lengths = decode.pad_prompts(PROMPTS)
    return f.model, f.init(), prompts, lengths


BAD = [
    (dict(strategy="top"), r"strategy='top' must be one of \('greedy', 'sample', 'beam'\)"),
    (dict(max_new_tokens=0), r"max_new_tokens=0 must be a positive int"),
    (dict(max_new_tokens=2.0), r"max_new_tokens=2.0 must be a positive int"),
    (dict(temperature=-0.1), r"temperature=-0.1 is outside \[0.0, inf\]"),
    (dict(temperature=[0.5, 1.0]), r"temperature=\[0.5, 1.0\] must be a number"),
    (dict(temperature=np.array([0.5, 1.0])), r"temperature must be one value, got shape \(2,\)"),
    (dict(top_k=2.5), r"top_k=2.5 must be an int"),
    (dict(top_k=-1), r"top_k=-1 is outside \[0, inf\]"),
    (dict(top_p=0), r"top_p=0 is outside \(0.0, 1.0\]"),
    (dict(min_p=1.0), r"min_p=1 is outside \[0.0, 1.0\)"),
    (dict(repetition_penalty=0), r"repetition_penalty=0 is outside \(0.0, inf\)"),
    (dict(eos_id=()), r"eos_id must be None, an int or a non-empty sequence of ints"),
    (dict(eos_id="end"), r"eos_id must be None, an int or a non-empty sequence"),
    (dict(eos_id=[1, -2]), r"eos_id: token id -2 must be >= 0"),
    (dict(forced_bos_id=-1), r"forced_bos_id=-1 must be None or a token id"),
    (dict(forced_eos_id=True), r"forced_eos_id=True must be None or a token id"),
    (dict(banned_ids=5), r"banned_ids must be a sequence of int token ids, got 5"),
    (dict(banned_ids=("a",)), r"banned_ids must be a sequence of int token ids"),
    (dict(banned_ids=[3, -1]), r"banned_ids: token id -1 must be >= 0"),
    (dict(min_new_tokens=-1), r"min_new_tokens=-1 is outside \[0, inf\]"),
    (dict(no_repeat_ngram_size=1.5), r"no_repeat_ngram_size=1.5 must be an int"),
    (dict(beam_size=0), r"beam_size=0 must be a positive int"),
    (dict(length_penalty=-1.0), r"length_penalty=-1 is outside \[0.0, inf\)"),
    (dict(length_penalty=float("nan"), length_normalization="hf"),
     r"length_penalty=nan is outside \(-inf, inf\)"),
    (dict(length_normalization="none"), r"length_normalization='none' must be one of"),
    (dict(renormalize_logits="yes"), r"renormalize_logits='yes' must be True or False"),
    (dict(early_stopping="always"), r"early_stopping='always' must be True, False or 'never'"),
    (dict(early_stopping=0), r"early_stopping=0 must be True, False or 'never'"),
    (dict(early_stopping=None), r"early_stopping=None must be True, False or 'never'"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[m[:30] for _, m in BAD])
def test_a_request_checks_itself_naming_the_field_the_value_and_the_rule(bad, message):
    with pytest.raises(UserError, match=message):
        DecodeRequest(**bad)


def test_values_are_normalised_and_hf_takes_any_length_penalty():
    r = DecodeRequest(eos_id=3, banned_ids=[4, 5], temperature=np.float32(0.5), top_k=np.int64(7),
                      length_penalty=-0.5, length_normalization="hf")
    assert (r.eos_id, r.banned_ids, r.temperature, r.top_k) == ((3,), (4, 5), 0.5, 7)
    assert type(r.temperature) is float and type(r.top_k) is int
    assert DecodeRequest(eos_id=np.array([2, 9])).eos_id == (2, 9)
    assert DecodeRequest(eos_id=None).eos_id is None and DecodeRequest().eos_id == "config"
    assert DecodeRequest().early_stopping == "never"              # the exact stop
    assert DecodeRequest(early_stopping=np.bool_(True)).early_stopping is True
    assert r == DecodeRequest(eos_id=(3,), banned_ids=(4, 5), temperature=0.5, top_k=7,
                              length_penalty=-0.5, length_normalization="hf")


def test_replace_refuses_unknown_fields_by_name_and_override_skips_none():
    r = DecodeRequest(top_k=5, max_new_tokens=8)
    with pytest.raises(UserError, match=r"DecodeRequest has no field 'temprature' \(did you "
                                        r"mean 'temperature'\?\)"):
        r.replace(temprature=0.7)
    with pytest.raises(UserError, match=r"no field 'zzz'; its fields: strategy, "):
        r.override(zzz=None)                      # unknown even when None
    with pytest.raises(UserError, match=r"top_p=1.5 is outside"):
        r.replace(top_p=1.5)                      # checked again
    assert r.override(top_k=None, top_p=0.9, forced_bos_id=None) == r.replace(top_p=0.9)
    assert r.replace(forced_bos_id=3).replace(forced_bos_id=None) == r   # None set by replace
    assert r.replace(top_k=0).top_k == 0 and r.top_k == 5               # frozen: a copy


def test_a_traced_value_is_refused_and_goes_through_the_keywords_instead():
    model, params, prompts, lengths = setup("decoder_only")
    request = DecodeRequest(strategy="sample", max_new_tokens=5, eos_id=None, top_k=20)
    key = jax.random.key(3)

    def in_jit(t):
        return decode.generate(model, params, prompts, lengths, request, temperature=t,
                               rng=key, strategy=decode.Strategy(sample=True, top_k=True))

    with pytest.raises(UserError, match=r"temperature is traced: a DecodeRequest holds "
                                        r"concrete values; give a traced value to "
                                        r"decode.generate / decode.beam_search as a keyword"):
        jax.jit(lambda t: DecodeRequest(temperature=t))(0.7)
    traced = jax.jit(in_jit)(jnp.float32(0.7))
    eager = decode.generate(model, params, prompts, lengths, request.replace(temperature=0.7),
                            rng=key)
    np.testing.assert_array_equal(traced.tokens, eager.tokens)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_generate_with_a_request_equals_the_same_keywords(arch):
    model, params, prompts, lengths = setup(arch)
    free = decode.generate(model, params, prompts, lengths, max_new_tokens=7, eos_id=None)
    eos, banned = int(free.tokens[0, 1]), (int(free.tokens[1, 0]),)
    keywords = dict(max_new_tokens=7, eos_id=eos, forced_bos_id=8, banned_ids=banned,
                    min_new_tokens=3, no_repeat_ngram_size=2, repetition_penalty=1.3)
    request = DecodeRequest(**keywords)
    # The request gives exactly these keywords, so the same compilation key.
    _, by_keywords = decode.generate_arguments(model, params, prompts, lengths, **keywords)
    _, by_request = decode.generate_arguments(model, params, prompts, lengths, request)
    assert by_request == by_keywords and "cache_sharding" not in by_request
    chex.assert_trees_all_equal(decode.generate(model, params, prompts, lengths, request),
                                decode.generate(model, params, prompts, lengths, **keywords))
    # Sampling: the sampling values only with strategy "sample", each equal to its keyword.
    sampled = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)
    key = jax.random.key(5)
    chex.assert_trees_all_equal(
        decode.generate(model, params, prompts, lengths,
                        request.replace(strategy="sample", **sampled), rng=key),
        decode.generate(model, params, prompts, lengths, rng=key, **keywords, **sampled))
    greedy = decode.generate(model, params, prompts, lengths, request.replace(**sampled))
    chex.assert_trees_all_equal(greedy, decode.generate(model, params, prompts, lengths,
                                                        **keywords))


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_beam_search_with_a_request_equals_the_same_keywords(arch):
    model, params, prompts, lengths = setup(arch)
    keywords = dict(max_new_tokens=6, beam_size=3, length_penalty=1.5,
                    length_normalization="hf", banned_ids=(4, 9), forced_eos_id=11,
                    min_new_tokens=2, renormalize_logits=True, early_stopping=True)
    request = DecodeRequest(strategy="beam", **keywords)
    (*_, kw_inputs), by_keywords = decode.beam_search_arguments(model, params, prompts,
                                                                 lengths, **keywords)
    (*_, inputs), by_request = decode.beam_search_arguments(model, params, prompts, lengths,
                                                            request)
    assert by_request == by_keywords
    assert int(inputs.stopping) == int(kw_inputs.stopping) == STOPPINGS.index("full")
    chex.assert_trees_all_equal(decode.beam_search(model, params, prompts, lengths, request),
                                decode.beam_search(model, params, prompts, lengths, **keywords))
    # The sampling values and the repetition penalty are not beam search's: not applied.
    unused = request.replace(temperature=0.3, top_k=2, repetition_penalty=2.0)
    chex.assert_trees_all_equal(decode.beam_search(model, params, prompts, lengths, unused),
                                decode.beam_search(model, params, prompts, lengths, request))


def test_a_keyword_given_with_a_request_wins_over_its_field():
    model, params, prompts, lengths = setup("decoder_only")
    free = decode.generate(model, params, prompts, lengths, max_new_tokens=4, eos_id=None)
    request = DecodeRequest(max_new_tokens=8, eos_id=None, banned_ids=(int(free.tokens[0, 0]),))
    out = decode.generate(model, params, prompts, lengths, request, max_new_tokens=4,
                          banned_ids=())
    chex.assert_trees_all_equal(out, free)
    beams = decode.beam_search(model, params, prompts, lengths,
                               request.replace(strategy="beam", beam_size=3), beam_size=2)
    assert beams.tokens.shape == (3, 2, 8)
    # Keywords no request field names (loop, cache_len, rng) go through as they are.
    while_loop = decode.generate(model, params, prompts, lengths, request, loop="while",
                                 cache_len=20)
    chex.assert_trees_all_equal(while_loop.tokens, decode.generate(
        model, params, prompts, lengths, request).tokens)


def test_each_call_refuses_the_other_strategy_and_a_request_without_new_tokens():
    model, params, prompts, lengths = setup("decoder_only")
    with pytest.raises(UserError, match=r"this request is beam search \(strategy='beam'\): "
                                        r"decode.beam_search or decode.run runs it"):
        decode.generate(model, params, prompts, lengths,
                        DecodeRequest(strategy="beam", max_new_tokens=4))
    with pytest.raises(UserError, match=r"this request is strategy='sample', not beam search"):
        decode.beam_search(model, params, prompts, lengths,
                           DecodeRequest(strategy="sample", max_new_tokens=4))
    with pytest.raises(UserError, match=r"the request sets no max_new_tokens"):
        decode.generate(model, params, prompts, lengths, DecodeRequest())
    with pytest.raises(UserError, match=r"request must be a decode.DecodeRequest or None, "
                                        r"got dict"):
        decode.generate(model, params, prompts, lengths, {"max_new_tokens": 4})
    with pytest.raises(UserError, match=r"got 'sample' \(a strategy name such as 'sample' is "
                                        r"a decode.DecodeRequest's field: pass the request\)"):
        decode.generate(model, params, prompts, lengths, max_new_tokens=4, strategy="sample")
    with pytest.raises(TypeError):                      # an unknown keyword, as before
        decode.generate(model, params, prompts, lengths, DecodeRequest(max_new_tokens=4),
                        beams=2)


def test_run_decodes_each_strategy_with_its_computation():
    model, params, prompts, lengths = setup("encoder_decoder")
    request = DecodeRequest(max_new_tokens=6, eos_id=None, banned_ids=(5,))
    key = jax.random.key(2)
    for strategy in ("greedy", "sample"):
        r = request.replace(strategy=strategy, temperature=1.2)
        got = decode.run(model, params, prompts, lengths, r, rng=key)
        want = decode.generate(model, params, prompts, lengths, r, rng=key)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.lengths, want.lengths)
    beam = request.replace(strategy="beam", beam_size=3)
    got = decode.run(model, params, prompts, lengths, beam)
    want = decode.beam_search(model, params, prompts, lengths, beam)
    np.testing.assert_array_equal(got.tokens, want.tokens[:, 0])
    np.testing.assert_array_equal(got.lengths, want.lengths[:, 0])
    with pytest.raises(UserError, match=r"rng is required"):
        decode.run(model, params, prompts, lengths, request.replace(strategy="sample"))


def test_a_decode_call_runs_lowers_and_checks_with_the_same_arguments():
    model, params, prompts, lengths = setup("decoder_only")
    request = DecodeRequest(max_new_tokens=4, eos_id=None)
    assert decode.generate.arguments is decode.generate_arguments
    assert decode.beam_search.arguments is decode.beam_search_arguments
    assert repr(decode.generate) == "<decode.generate>" and decode.generate.__name__ == "generate"
    assert decode.generate.__doc__.startswith("Autoregressive decoding with a KV cache")
    assert decode.generate.computation is _generate
    lowered = decode.generate.lower(model, params, prompts, lengths, request)
    keywords = decode.generate.lower(model, params, prompts, lengths, max_new_tokens=4,
                                     eos_id=None)
    assert lowered.as_text() == keywords.as_text()
    beams = decode.beam_search.lower(model, params, prompts, lengths,
                                     request.replace(strategy="beam", beam_size=2))
    assert beams.as_text().count("stablehlo.while") == 1
    with pytest.raises(UserError, match=r"beam_size=0 must be a positive int"):
        decode.beam_search.lower(model, params, prompts, lengths, request.replace(
            strategy="beam"), beam_size=0)
    # One compilation serves a request and its keywords.
    decode.generate(model, params, prompts, lengths, max_new_tokens=4, eos_id=None)
    size = _generate._cache_size()
    decode.generate(model, params, prompts, lengths, request)
    assert _generate._cache_size() == size
