"""decode.generate against a naive oracle; ragged batches; compilation; bad input."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
import models
from decode.generate import _generate
from models.errors import UserError
from tests.helpers import fns, tiny


@functools.cache
def setup(arch):
    f = fns(tiny(arch, positions="rope" if arch == "decoder_only" else "sinusoidal",
                 num_kv_heads=2, max_len=32))
    return f.model, f.init()


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]]


def naive_greedy(model, params, prompt, n, eos_id=None):
    """Re-runs the full forward pass on the growing sequence and takes the argmax. The
    sequence is padded to one width (causal: what follows a position never changes its
    logits), so the oracle compiles once."""
    cfg = model.config
    width = cfg.max_len
    forward = jax.jit(lambda p, *a: model.apply({"params": p}, *a))
    if cfg.is_encoder_decoder:
        src, seq = jnp.array([prompt]), [cfg.bos_id]
    else:
        seq = list(prompt)
    start = len(seq)
    for _ in range(n):
        padded = jnp.array([seq + [0] * (width - len(seq))])
        args = (src, padded) if cfg.is_encoder_decoder else (padded,)
        seq.append(int(jnp.argmax(forward(params, *args)[0, len(seq) - 1])))
        if seq[-1] == eos_id:
            break
    return seq[start:]


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_greedy_equals_the_naive_oracle_on_a_ragged_batch(arch):
    model, params = setup(arch)
    prompts, lengths = decode.pad_prompts(PROMPTS)
    out = decode.generate(model, params, prompts, lengths, max_new_tokens=8, eos_id=None)
    chex.assert_shape((out.tokens, out.logprobs, out.lengths), ((3, 8), (3, 8), (3,)))
    for b, prompt in enumerate(PROMPTS):
        assert out.tokens[b].tolist() == naive_greedy(model, params, prompt, 8), f"row {b}"
    np.testing.assert_array_equal(out.lengths, [8, 8, 8])
    decoder_prompt = np.ones(3) if arch == "encoder_decoder" else lengths
    np.testing.assert_array_equal(out.cache_lengths, decoder_prompt + 7)
    assert out.cache_len == (1 if arch == "encoder_decoder" else 8) + 8


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_eos_stops_and_pads_and_logprobs_are_the_models(arch):
    model, params = setup(arch)
    prompts, lengths = decode.pad_prompts(PROMPTS)
    free = decode.generate(model, params, prompts, lengths, max_new_tokens=8, eos_id=None)
    eos = int(free.tokens[0, 2])              # a token row 0 emits third
    out = decode.generate(model, params, prompts, lengths, max_new_tokens=8, eos_id=eos)
    expected = naive_greedy(model, params, PROMPTS[0], 8, eos)
    assert expected[-1] == eos and len(expected) <= 3
    assert out.tokens[0].tolist() == expected + [0] * (8 - len(expected))
    assert int(out.lengths[0]) == len(expected)
    assert float(jnp.abs(out.logprobs[0, len(expected):]).max()) == 0.0
    # The log-prob of each token is log_softmax of the full forward pass at its position.
    seq = jnp.array([PROMPTS[0] + free.tokens[0].tolist()])
    if model.config.is_encoder_decoder:
        tgt = jnp.array([[model.config.bos_id] + free.tokens[0].tolist()])
        logits = model.apply({"params": params}, jnp.array([PROMPTS[0]]), tgt)[0, :8]
    else:
        logits = model.apply({"params": params}, seq)[0, 2:10]
    expected = jnp.take_along_axis(jax.nn.log_softmax(logits), free.tokens[0][:, None], 1)[:, 0]
    np.testing.assert_allclose(free.logprobs[0], expected, atol=1e-5)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_ragged_batch_equals_each_prompt_alone(arch):
    model, params = setup(arch)
    prompts, lengths = decode.pad_prompts(PROMPTS, width=8)
    together = decode.generate(model, params, prompts, lengths, max_new_tokens=6, eos_id=None)
    for b, prompt in enumerate(PROMPTS):
        p, n = decode.pad_prompts([prompt], width=8)
        alone = decode.generate(model, params, p, n, max_new_tokens=6, eos_id=None)
        np.testing.assert_array_equal(together.tokens[b], alone.tokens[0])


def test_same_shape_never_recompiles_and_sampling_values_are_traced():
    model, params = setup("decoder_only")
    kw = dict(max_new_tokens=4, eos_id=1, rng=jax.random.key(0), top_p=0.9)
    prompts, lengths = decode.pad_prompts(PROMPTS)
    decode.generate(model, params, prompts, lengths, temperature=0.5, **kw)
    before = _generate._cache_size()
    for i in range(3):
        p, n = decode.pad_prompts([[4 + i, 5], [6] * (3 + i), [7, 8, 9]])
        decode.generate(model, params, p, n, temperature=[0.3 + i, 1.0, 0.0], **kw)
    assert _generate._cache_size() == before
    decode.generate(model, params, *decode.pad_prompts([[3] * 9]), temperature=1.0, **kw)
    assert _generate._cache_size() == before + 1     # a new bucket width compiles once


def test_lowered_generate_is_one_loop_whose_program_does_not_grow_with_new_tokens():
    """`generate.lower` checks its arguments like `generate` and gives the same program:
    one while loop (the scan); 4 or 24 new tokens differ only in numbers (trip count and
    the output width), never in the operations."""
    import re
    model, params = setup("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    texts = [decode.generate.lower(model, params, prompts, lengths, max_new_tokens=n,
                                   eos_id=None).as_text() for n in (4, 24)]
    assert [len(re.findall(r"stablehlo\.while", t)) for t in texts] == [1, 1]
    assert re.sub(r"\d+", "#", texts[0]) == re.sub(r"\d+", "#", texts[1])
    with pytest.raises(ValueError, match="max_new_tokens=0 must be a positive int"):
        decode.generate.lower(model, params, prompts, lengths, max_new_tokens=0)
    with pytest.raises(TypeError):
        decode.generate.lower(model, params, prompts, lengths, max_new_tokens=4, beams=2)


def test_generate_arguments_give_the_compilation_key_and_a_strategy_shares_it():
    model, params = setup("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=4, rng=jax.random.key(0))
    _, a = decode.generate_arguments(model, params, prompts, lengths, temperature=0.5, **kw)
    _, b = decode.generate_arguments(model, params, prompts, lengths,
                                     temperature=[0.1, 2.0, 0.0], **kw)
    assert a == b == dict(max_new_tokens=4, cache_len=12, eos_ids=(1,),
                          strategy=decode.Strategy(sample=True), loop="scan", no_repeat=False,
                          constrained=False)
    # Given a strategy, greedy and sampled calls share one compilation, and a processor
    # that is on but set to "off" values changes nothing.
    strategy = decode.Strategy(sample=True, top_k=True, penalty=True)
    shared = decode.generate(model, params, prompts, lengths, strategy=strategy, **kw)
    size = _generate._cache_size()
    decode.generate(model, params, prompts, lengths, strategy=strategy, temperature=0.8,
                    top_k=5, repetition_penalty=1.3, **kw)
    assert _generate._cache_size() == size
    greedy = decode.generate(model, params, prompts, lengths, **kw)
    chex.assert_trees_all_equal(shared, greedy)


def test_while_loop_equals_scan():
    model, params = setup("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    free = decode.generate(model, params, prompts, lengths, max_new_tokens=8, eos_id=None)
    kw = dict(max_new_tokens=8, eos_id=int(free.tokens[1, 1]), rng=jax.random.key(3),
              temperature=[0.0, 0.8, 1.2])
    a = decode.generate(model, params, prompts, lengths, loop="scan", **kw)
    b = decode.generate(model, params, prompts, lengths, loop="while", **kw)
    chex.assert_trees_all_equal(a, b)


def test_sampling_is_reproducible_per_key():
    model, params = setup("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=8, eos_id=None, temperature=1.0, top_k=20, top_p=0.95,
              min_p=0.01, repetition_penalty=1.3)
    a = decode.generate(model, params, prompts, lengths, rng=jax.random.key(1), **kw)
    b = decode.generate(model, params, prompts, lengths, rng=jax.random.key(1), **kw)
    c = decode.generate(model, params, prompts, lengths, rng=jax.random.key(2), **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


def test_top_k_1_sampling_is_greedy_and_penalty_avoids_repeats():
    model, params = setup("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    greedy = decode.generate(model, params, prompts, lengths, max_new_tokens=8, eos_id=None)
    top1 = decode.generate(model, params, prompts, lengths, max_new_tokens=8, eos_id=None,
                           temperature=1.5, top_k=1, rng=jax.random.key(0))
    np.testing.assert_array_equal(greedy.tokens, top1.tokens)
    strong = decode.generate(model, params, prompts, lengths, max_new_tokens=8, eos_id=None,
                             repetition_penalty=1e6)
    for b, prompt in enumerate(PROMPTS):
        out = strong.tokens[b].tolist()
        assert len(set(out)) == 8 and not set(out) & set(prompt)


def test_scan_loop_is_differentiable():
    model, params = setup("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    grads = jax.grad(lambda p: decode.generate(
        model, p, prompts, lengths, max_new_tokens=3, eos_id=None).logprobs.sum())(params)
    chex.assert_tree_all_finite(grads)
    assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)) > 0


def test_bucket_width_and_pad_prompts():
    assert [decode.bucket_width(n) for n in (1, 8, 9, 100)] == [8, 8, 16, 128]
    p, n = decode.pad_prompts([[4, 5], [6]])
    np.testing.assert_array_equal(p, [[4, 5, 0, 0, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(n, [2, 1])
    with pytest.raises(ValueError, match="does not fit width=2"):
        decode.pad_prompts([[1, 2, 3]], width=2)
    with pytest.raises(ValueError, match="no empty prompt"):
        decode.pad_prompts([[1], []])


BAD = [
    (dict(prompts=[[5, 61]]), r"prompts hold token id 61 outside \[0, vocab_size=61\)"),
    (dict(prompts=[[5, -2]]), r"token id -2 outside"),
    (dict(prompts=[5, 6]), r"prompts must be an int array \[B, P\]"),
    (dict(prompts=[[5.0, 6.0]]), r"prompts must be an int array"),
    (dict(lengths=[0]), r"lengths\[0\]=0 must be in \[1, padded width 2\]"),
    (dict(lengths=[3]), r"lengths\[0\]=3 must be in \[1, padded width 2\]"),
    (dict(lengths=[2, 2]), r"lengths must be an int array of shape \(1,\)"),
    (dict(max_new_tokens=0), r"max_new_tokens=0 must be a positive int"),
    (dict(max_new_tokens=31), r"prompt width 2 \+ max_new_tokens 31 = 33 is beyond the "
                              r"model's max_len 32"),
    (dict(cache_len=5), r"cache_len=5 must be in \[prompt width 2 \+ max_new_tokens = 6, "
                        r"max_len 32\]"),
    (dict(temperature=-0.1), r"temperature=-0.1 is outside \[0.0, inf\]"),
    (dict(temperature=[1.0, 2.0]), r"temperature must be a scalar or have shape \(1,\)"),
    (dict(top_p=0.0), r"top_p=0 is outside \(0.0, 1.0\]"),
    (dict(top_p=1.5), r"top_p=1.5 is outside"),
    (dict(top_k=-1), r"top_k=-1 is outside \[0, 61\]"),
    (dict(top_k=62), r"top_k=62 is outside \[0, 61\]"),
    (dict(top_k=2.5), r"top_k=2.5 must be integers"),
    (dict(min_p=1.0), r"min_p=1 is outside \[0.0, 1.0\)"),
    (dict(repetition_penalty=0.0), r"repetition_penalty=0 is outside \(0.0, inf\)"),
    (dict(eos_id=61), r"eos_id 61 must be an int in \[0, vocab_size=61\)"),
    (dict(eos_id=()), r"eos_id must be None, an int or a non-empty sequence"),
    (dict(loop="for"), r"loop='for' must be one of"),
    (dict(temperature=1.0, rng=None), r"rng is required when temperature > 0"),
    (dict(forced_bos_id=61), r"forced_bos_id=61 is outside \[0, vocab_size=61\)"),
    (dict(forced_eos_id=-1), r"forced_eos_id=-1 is outside \[0, vocab_size=61\)"),
    (dict(forced_bos_id=[3, 4]), r"forced_bos_id must be None or one int token id"),
    (dict(banned_ids=(3, 70)), r"banned_ids hold token id 70 outside \[0, vocab_size=61\)"),
    (dict(banned_ids=5), r"banned_ids must be a sequence of int token ids, got 5"),
    (dict(banned_ids=("a",)), r"banned_ids must be a sequence of int token ids"),
    (dict(banned_ids=range(61)), r"banned_ids must be a sequence"),
    (dict(banned_ids=list(range(61))), r"banned_ids ban every token of the vocabulary"),
    (dict(banned_ids=list(range(60)), eos_id=60, min_new_tokens=2),
     r"banned_ids and the end ids together are the whole vocabulary"),
    (dict(min_new_tokens=-1), r"min_new_tokens=-1 is outside \[0, inf\]"),
    (dict(min_new_tokens=[1, 2]), r"min_new_tokens must be a scalar or have shape \(1,\)"),
    (dict(no_repeat_ngram_size=-2), r"no_repeat_ngram_size=-2 is outside \[0, inf\]"),
    (dict(no_repeat_ngram_size=2.0), r"no_repeat_ngram_size must be an int, got 2.0"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_names_the_argument_the_value_and_the_limit(bad, message):
    model, params = setup("decoder_only")
    kw = dict(prompts=[[5, 6]], lengths=[2], max_new_tokens=4)
    kw.update(bad)
    prompts, lengths = kw.pop("prompts"), kw.pop("lengths")
    with pytest.raises(UserError, match=message):            # a user's mistake, not a bug
        decode.generate(model, params, np.array(prompts), np.array(lengths), **kw)


def test_sources_are_masked_by_their_lengths_whatever_fills_the_padding():
    """Nothing compares tokens with a pad id: a pad id inside a source is a token like any
    other, and the padding after the length may hold anything."""
    model, params = setup("encoder_decoder")
    src, lengths = np.array([[5, 0, 6, 0], [7, 8, 9, 10]]), np.array([3, 2])
    a = decode.generate(model, params, src, lengths, max_new_tokens=4, eos_id=None)
    junk = np.array([[5, 0, 6, 33], [7, 8, 44, 55]])
    b = decode.generate(model, params, junk, lengths, max_new_tokens=4, eos_id=None)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    c = decode.generate(model, params, src[:1, :2], lengths[:1] - 1, max_new_tokens=4,
                        eos_id=None)                    # the inner 0 is part of row 0
    assert not np.array_equal(a.logprobs[0], c.logprobs[0])


def test_the_default_end_token_is_the_configs():
    model, params = setup("decoder_only")
    prompts, lengths = np.array([[5, 6]]), np.array([2])
    free = decode.generate(model, params, prompts, lengths, max_new_tokens=8, eos_id=None)
    first = int(free.tokens[0, 1])
    cfg = model.config.replace(eos_id=first)
    out = decode.generate(models.build(cfg), params, prompts, lengths, max_new_tokens=8)
    assert int(out.lengths[0]) == 2 and int(out.tokens[0, 1]) == first
    none = models.build(cfg.replace(eos_id=None))
    assert int(decode.generate(none, params, prompts, lengths, max_new_tokens=8).lengths[0]) == 8


def test_bad_sources_for_encoder_decoder():
    model, params = setup("encoder_decoder")
    with pytest.raises(ValueError, match=r"1 \(start token\) \+ max_new_tokens 32 = 33 is beyond"):
        decode.generate(model, params, np.array([[5]]), np.array([1]), max_new_tokens=32)


def naive_constrained(model, params, prompt, n, eos, *, forced_bos=None, forced_eos=None,
                      banned=(), min_new=0, ngram=0):
    """Oracle: `naive_greedy` with transformers' constraints written out on its logits."""
    cfg = model.config
    forward = jax.jit(lambda p, *a: model.apply({"params": p}, *a))
    if cfg.is_encoder_decoder:
        src, seq = jnp.array([prompt]), [cfg.bos_id]
    else:
        seq = list(prompt)
    start = len(seq)
    for i in range(n):
        padded = jnp.array([seq + [0] * (cfg.max_len - len(seq))])
        logits = np.array(forward(params, *((src, padded) if cfg.is_encoder_decoder
                                            else (padded,)))[0, len(seq) - 1])
        if ngram:                          # every earlier window against the last n - 1
            for j in range(len(seq) - ngram + 1):
                if seq[j:j + ngram - 1] == seq[len(seq) - ngram + 1:]:
                    logits[seq[j + ngram - 1]] = -np.inf
        logits[list(banned)] = -np.inf
        if i < min_new:
            logits[eos] = -np.inf
        for forced, at in ((forced_bos, 0), (forced_eos, n - 1)):
            if forced is not None and i == at:
                logits[:] = -np.inf
                logits[forced] = 0.0
        seq.append(int(np.argmax(logits)))
        if seq[-1] == eos:
            break
    return seq[start:]


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_constraints_equal_the_naive_oracle_and_are_traced(arch):
    """Forced first and last tokens, banned ids, an end id banned before 4 new tokens and no
    repeated bigram: each changes what greedy decoding gives here (the free decode shows
    it), and new values never recompile."""
    model, params = setup(arch)
    prompts, lengths = decode.pad_prompts(PROMPTS)
    n = 8
    free = decode.generate(model, params, prompts, lengths, max_new_tokens=n, eos_id=None)
    eos = int(free.tokens[0, 1])                        # row 0 would end at token 2
    banned = (int(free.tokens[1, 0]), int(free.tokens[2, 2]))
    kw = dict(forced_bos=7, forced_eos=9, banned=banned, min_new=4, ngram=2)
    out = decode.generate(model, params, prompts, lengths, max_new_tokens=n, eos_id=eos,
                          forced_bos_id=7, forced_eos_id=9, banned_ids=banned,
                          min_new_tokens=4, no_repeat_ngram_size=2)
    for b, prompt in enumerate(PROMPTS):
        expected = naive_constrained(model, params, prompt, n, eos, **kw)
        got = out.tokens[b, : out.lengths[b]].tolist()
        assert got == expected, f"row {b}"
        assert got[0] == 7 and not set(banned) & set(got)
        assert eos not in got[:4] and (got[-1] in (eos, 9))
    # A repeated bigram was there to ban: without the ban the decode differs.
    no_ngram = decode.generate(model, params, prompts, lengths, max_new_tokens=n, eos_id=eos,
                               forced_bos_id=7, forced_eos_id=9, banned_ids=banned,
                               min_new_tokens=4, no_repeat_ngram_size=0)
    assert not np.array_equal(no_ngram.tokens, out.tokens)
    # Traced: other ids, another minimum and n-gram size, per-row minimums, no recompilation.
    size = _generate._cache_size()
    for other in (dict(forced_bos_id=None, forced_eos_id=3, banned_ids=(4, 5, 6),
                       min_new_tokens=[0, 1, 7], no_repeat_ngram_size=3),
                  dict(forced_bos_id=11, banned_ids=(), no_repeat_ngram_size=1)):
        decode.generate(model, params, prompts, lengths, max_new_tokens=n, eos_id=eos, **other)
    assert _generate._cache_size() == size


def test_constraints_inside_a_user_jit_equal_the_eager_call():
    """Traced ids: banned_ids as an int array (-1 entries ban nothing) and a forced id."""
    model, params = setup("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=5, eos_id=None, no_repeat_ngram_size=2)
    eager = decode.generate(model, params, prompts, lengths, banned_ids=(3, 9),
                            forced_bos_id=12, **kw)
    traced = jax.jit(lambda ids, bos: decode.generate(
        model, params, prompts, lengths, banned_ids=ids, forced_bos_id=bos, **kw))(
        jnp.array([3, -1, 9]), jnp.int32(12))
    np.testing.assert_array_equal(traced.tokens, eager.tokens)
    assert (np.asarray(eager.tokens[:, 0]) == 12).all()


def test_constraints_compile_in_only_when_a_call_sets_one():
    """A call without token constraints compiles none of them in (`constrained` False: no
    per-step masking of the logits); setting any one, or passing a traced one, compiles
    them all, and their values then never recompile."""
    model, params = setup("decoder_only")
    prompts, lengths = decode.pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=4)

    def flag(**options):
        return decode.generate_arguments(model, params, prompts, lengths, **kw,
                                         **options)[1]["constrained"]
    assert not flag()
    assert not flag(banned_ids=(), min_new_tokens=0, forced_bos_id=None)
    for options in (dict(banned_ids=(3,)), dict(min_new_tokens=[0, 2, 0]),
                    dict(forced_bos_id=5), dict(forced_eos_id=5), dict(no_repeat_ngram_size=2)):
        assert flag(**options), options
    static = {}

    def traced(ids):          # inside a user's jit: a traced id counts as set
        static.update(decode.generate_arguments(model, params, prompts, lengths,
                                                banned_ids=ids, **kw)[1])
        return ids
    jax.eval_shape(traced, jnp.array([3, -1]))
    assert static["constrained"]
    lowered = {c: decode.generate.lower(model, params, prompts, lengths, **kw,
                                        **({"banned_ids": (3,)} if c else {})).as_text()
               for c in (False, True)}
    assert lowered[False].count("select") < lowered[True].count("select")
