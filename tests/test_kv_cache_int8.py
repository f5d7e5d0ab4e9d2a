"""The int8 KV cache (`models.cache_int8`, `kv_cache_dtype="int8"`).

Checked: quantizing a vector and reading it back is within half a scale of it, per
element; every cache (rows, beam regions, pages) keeps each scale with its keys; a ragged
prefill and cached steps over an int8 cache give the float cache's logits to a stated
tolerance, and a step that reads before it writes (`read_step`) the same as one that
writes first (`step`); an encoder-decoder's self-attention cache is int8, its cross
keys/values not; on a small model trained here to copy, greedy decoding, beam search and
the paged serving engine with an int8 cache give the float cache's tokens (and the engine
`generate`'s with the same cache); a bad dtype is refused by name wherever it is given.

The suite trains no generative model to convergence cheaply (its runs are a few steps:
near-uniform logits whose argmax any rounding may flip), so `copier` trains one here, a
decoder-only model that copies the 5 tokens before a separator (about 5 s on 2 cores)."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import decode
import models
import serve
from decode import cli_request, encoder_cli, whisper_cli
from decode.__main__ import build_parser
from models.cache_int8 import bytes_per_token, dequantize, quantize
from models.errors import UserError
from models.paged_cache import PagedKVCache
from models.pretrained import GenerationDefaults, Pretrained
from serve.engine import Engine
from tests.helpers import fns, tiny

# ------------------------------------------------------------------------------------------
# Quantize, dequantize.


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_then_dequantize_is_within_half_a_scale_per_element(scale_dtype):
    rng = np.random.default_rng(0)
    # Vectors of very different sizes (1e-4 .. 1e3), one all zero, one with a lone spike.
    sizes = 10.0 ** rng.uniform(-4, 3, (6, 4, 1))
    x = (rng.normal(size=(6, 4, 64)) * sizes).astype(np.float32)
    x[0, 0] = 0.0
    x[1, 2, 5] = 500.0
    q, scale = quantize(jnp.asarray(x), scale_dtype)
    assert q.dtype == jnp.int8 and scale.dtype == scale_dtype and scale.shape == (6, 4, 1)
    scale = np.asarray(scale, np.float32)
    back = np.asarray(q, np.float32) * scale         # exact in float32: q has 8 bits
    assert np.all(np.abs(x - back) <= scale / 2 * (1 + 2 ** -20))
    # The scale is never rounded down (to bfloat16), so no entry is clipped; in float32 the
    # largest entry is +-127.
    assert np.all(scale[1:] >= np.abs(x[1:]).max(-1, keepdims=True) / 127)
    top = np.abs(np.asarray(q, np.int32)).max(-1)[1:]
    assert np.all(top == 127) if scale_dtype == jnp.float32 else np.all(top >= 126)
    assert not np.asarray(q[0, 0]).any() and scale[0, 0] == 0
    assert not np.asarray(dequantize(q, jnp.asarray(scale))[0, 0]).any()


def test_bytes_per_token():
    cfg = models.get_config("gpt-tiny", vocab_size=100)         # L 2, K 4, H 16
    assert (cfg.decoder_layers, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 16)
    assert bytes_per_token(cfg) == 2 * 2 * 4 * 16 * 4 == 1024
    assert bytes_per_token(cfg, "int8") == 2 * 2 * 4 * (16 + 4) == 320
    bf16 = cfg.replace(dtype=jnp.bfloat16, head_dim=64)
    assert (bytes_per_token(bf16), bytes_per_token(bf16, "int8")) == (2048, 1056)
    cache = models.KVCache.create(cfg, 1, 8, dtype="int8")
    assert sum(x.nbytes for x in jax.tree.leaves((cache.k, cache.v, cache.k_scale,
                                                  cache.v_scale))) == 8 * 320


def test_every_cache_keeps_each_scale_with_its_keys():
    """Writes read back to within half a scale; gathered rows, beam regions and pages take
    their scales along; a position without a page writes neither."""
    cfg = models.get_config("gpt-tiny", vocab_size=100, max_len=8)
    shape = (2, 3, cfg.num_kv_heads, cfg.head_dim)                      # [B, T, K, H]
    k = jax.random.normal(jax.random.key(0), shape) * jnp.array([1.0, 100.0])[:, None, None,
                                                                          None]
    positions = jnp.array([[0, 1, 2], [4, 5, 6]])
    cache = models.KVCache.create(cfg, 2, 8, dtype="int8").write(1, k, -k, positions)
    keys, values = cache.read(1)                                         # [B, S, K, H]
    got = jnp.stack([keys[0, :3], keys[1, 4:7]])
    bound = jnp.abs(k).max(-1, keepdims=True) / 254 * (1 + 1e-6)
    assert bool((jnp.abs(got - k) <= bound).all())
    chex.assert_trees_all_close(values, -keys)
    swapped = cache.take_rows(jnp.array([1, 0])).read(1)
    chex.assert_trees_all_close(swapped, (keys[::-1], values[::-1]))
    beams = models.BeamKVCache.from_cache(cache.replace(lengths=jnp.array([3, 7])), 2)
    chex.assert_trees_all_close(beams.read(1)[0][:, :8], keys)        # region 0: the row
    paged = PagedKVCache.create(cfg, rows=2, num_pages=3, page_size=4, pages_per_row=2,
                                dtype="int8")
    paged = paged.replace(page_table=jnp.array([[2, 0], [3, 3]]))       # row 1: no page
    paged = paged.write(1, k, -k, positions)
    chex.assert_trees_all_close(paged.read(1)[0][0, :3], keys[0, :3])
    assert not np.asarray(paged.k_scale[1][1]).any()                    # page 1: untouched


# ------------------------------------------------------------------------------------------
# Prefill and steps: the float cache's logits, to a tolerance.

# Logits of this random tiny model are O(0.1 .. 1); int8 keys and values move them by
# thousandths (measured: 0.005 of 0.4).
LOGIT_ATOL = 0.02


def test_prefill_and_steps_give_the_float_caches_logits():
    """A scanned stack with grouped kv heads (the trained model below has a looped one),
    a ragged prefill, then three steps."""
    f = fns(tiny(scan_layers=True, num_kv_heads=2, max_len=16, positions="rope"))
    params = f.init()
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, 61, (2, 9)), jnp.int32)
    lengths = jnp.array([6, 3], jnp.int32)
    read_step = jax.jit(lambda p, t, c: f.model.apply({"params": p}, t, c,
                                                      method="read_step")[0])
    got = {}
    for dtype in ("auto", "int8"):
        cache = models.KVCache.create(f.cfg, 2, 16, dtype=dtype)
        logits, cache = f.prefill(params, tokens[:, :6], lengths, cache)
        rows = [logits[jnp.arange(2), lengths - 1]]
        for t in range(6, 9):
            step_logits, stepped = f.step(params, tokens[:, t], cache)
            # Reading first (the decode loop's) = writing first (the engine's): the new
            # token sees its own keys as the cache stores them.
            chex.assert_trees_all_close(read_step(params, tokens[:, t], cache), step_logits,
                                        atol=1e-5)
            rows.append(step_logits)
            cache = stepped
        got[dtype] = jnp.stack(rows)
    assert cache.k.dtype == jnp.int8 and cache.k_scale.shape == (2, 2, 2, 16, 1)
    worst = float(jnp.abs(got["int8"] - got["auto"]).max())
    print(f"max |logit int8 - float| {worst:.5f} of max |logit| "
          f"{float(jnp.abs(got['auto']).max()):.3f}")
    assert worst < LOGIT_ATOL


def test_an_encoder_decoders_cache_is_int8_on_its_self_attention_side():
    f = fns(tiny("encoder_decoder"))                                      # K 4
    src = jnp.zeros((2, 5), jnp.int32)
    cache = jax.eval_shape(lambda: f.model.apply(
        {"params": f.init()}, src, 8, 3, kv_cache_dtype="int8", method="init_cache"))
    assert [x.dtype for x in cache.k] == [jnp.int8] * 2
    assert [x.shape for x in cache.v_scale] == [(6, 4, 8, 1)] * 2       # 2 sources x 3 beams
    assert cache.cross_k[0].dtype == jnp.float32                          # projected once


# ------------------------------------------------------------------------------------------
# A trained model: greedy, beam search and the engine give the float cache's tokens.

V, SEP, EOS, PAD, K = 32, 2, 1, 0, 5        # content ids 3 .. V-1; K tokens copied


def _copies(rng, rows: int):
    """Rows "f x SEP x EOS": 0 to 3 random tokens f, then K random tokens x, right-padded
    to 16; and each row's prompt length (f x SEP), so prompts are ragged."""
    fill = rng.integers(0, 4, rows)
    seq = np.full((rows, 16), PAD, np.int32)
    for r, f in enumerate(fill):
        x = rng.integers(3, V, f + K)
        seq[r, :f + 2 * K + 2] = [*x, SEP, *x[f:], EOS]
    return seq, (fill + K + 1).astype(np.int32)


@functools.cache
def copier():
    """(model, params) of a decoder-only model trained to copy (150 adam steps in one
    jitted scan; its loss falls from 3.5 to 0.05)."""
    cfg = tiny(vocab_size=V, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=128,
               max_len=32, positions="rope", norm="rmsnorm", activation="swiglu",
               use_bias=False, eos_id=EOS, pad_id=PAD, bos_id=SEP)
    model = models.build(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 15), jnp.int32))["params"]
    steps = 150
    tx = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, steps))
    rng = np.random.default_rng(0)
    batches = [_copies(rng, 64) for _ in range(steps)]
    seqs, lengths = np.stack([b[0] for b in batches]), np.stack([b[1] for b in batches])

    def loss(params, seq, n_B):
        logp = jax.nn.log_softmax(model.apply({"params": params}, seq[:, :-1]))
        nll = -jnp.take_along_axis(logp, seq[:, 1:, None], -1)[..., 0]
        pos = jnp.arange(seq.shape[1] - 1)[None, :]          # predicts token pos + 1
        scored = (pos >= n_B[:, None] - 1) & (pos < n_B[:, None] + K)   # x's copy, EOS
        return (nll * scored).sum() / scored.sum()

    @jax.jit
    def train(params, seqs, lengths):
        def one(carry, batch):
            params, opt = carry
            updates, opt = tx.update(jax.grad(loss)(params, *batch), opt)
            return (optax.apply_updates(params, updates), opt), None
        return jax.lax.scan(one, (params, tx.init(params)), (seqs, lengths))[0][0]
    return model, train(params, seqs, lengths)


@functools.cache
def copy_tests():
    """16 held-out prompts (right-padded to 10, ragged) and their rows."""
    seq, lengths = _copies(np.random.default_rng(1), 16)
    prompts = np.where(np.arange(10)[None, :] < lengths[:, None], seq[:, :10], PAD)
    return prompts, lengths, seq


@functools.cache
def greedy(dtype: str):
    model, params = copier()
    prompts, lengths, _ = copy_tests()
    return decode.generate(model, params, prompts, lengths, max_new_tokens=K + 2,
                           kv_cache_dtype=dtype)


def test_greedy_tokens_of_a_trained_model_equal_the_float_caches():
    out = {dtype: greedy(dtype) for dtype in ("auto", "int8")}
    np.testing.assert_array_equal(out["int8"].tokens, out["auto"].tokens)
    np.testing.assert_array_equal(out["int8"].lengths, out["auto"].lengths)
    gap = float(jnp.abs(out["int8"].logprobs - out["auto"].logprobs).max())
    print(f"greedy: max |log-prob int8 - float| {gap:.2e}")
    assert gap < 1e-2
    # It learned its task: every copy right, then the end token.
    _, lengths, seq = copy_tests()
    for r, n in enumerate(lengths):
        assert out["int8"].tokens[r, :K + 1].tolist() == seq[r, n:n + K + 1].tolist()


def test_beam_search_of_a_trained_model_equals_the_float_caches():
    """The beams' table cache (`BeamKVCache`: regions and reorder). Two beams: the third
    and fourth best of one source here are improbable copies whose float scores differ by
    0.002, less than int8's score error (0.014), and swap places."""
    model, params = copier()
    prompts, lengths, _ = copy_tests()

    floats, ints = (decode.beam_search(model, params, prompts, lengths, beam_size=2,
                                       max_new_tokens=K + 2, kv_cache_dtype=dtype)
                    for dtype in ("auto", "int8"))
    np.testing.assert_array_equal(ints.tokens, floats.tokens)
    np.testing.assert_array_equal(ints.lengths, floats.lengths)
    gap = float(np.abs(ints.scores - floats.scores).max())
    print(f"beam: max |score int8 - float| {gap:.2e}")
    assert gap < 2e-2


class _Letters:
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def _pretrained() -> Pretrained:
    model, params = copier()
    return Pretrained(model=model, config=model.config, params=params, tokenizer=_Letters(),
                      generation=GenerationDefaults(), model_type="decoder_only")


def test_paged_engine_with_an_int8_pool_equals_generate_with_an_int8_cache():
    """A pool of 5 pages of 8 positions for 3 slots of up to 16 positions: pages
    scatter, prompts are prefilled in chunks, and requests are preempted and recomputed."""
    engine = Engine(_pretrained(), max_slots=3, page_size=8, num_pages=5,
                    max_tokens_per_step=8, prefill_chunk=6, decode_steps=1,
                    kv_cache_dtype="int8")
    assert jax.tree.leaves(engine._state.cache.k)[0].dtype == jnp.int8
    prompts, lengths, _ = copy_tests()
    request = decode.DecodeRequest(max_new_tokens=K + 2)
    engine.start(warmup=False)
    try:
        handles = [engine.submit(serve.Submission(tuple(p[:n]), request))
                   for p, n in zip(prompts, lengths, strict=True)]
        got = [h.result() for h in handles]
    finally:
        engine.stop(drain=False)
    assert engine.preemptions > 0
    want, floats = greedy("int8"), greedy("auto")
    for r, (_, ids, last) in enumerate(got):
        n = int(want.lengths[r]) - 1              # the end token finishes it, unsent
        assert last.finish_reason == "stop" and want.tokens[r, n] == EOS
        assert ids == want.tokens[r, :n].tolist() == floats.tokens[r, :n].tolist()
        np.testing.assert_allclose(last.logprobs, want.logprobs[r, :n], atol=1e-4)


# ------------------------------------------------------------------------------------------
# A bad dtype, wherever it is given.

ALLOWED = r"must be one of \('auto', 'int8'\)"


def test_a_bad_kv_cache_dtype_is_refused_by_name():
    cfg = tiny()
    with pytest.raises(UserError, match=r"dtype='fp8' " + ALLOWED):
        models.KVCache.create(cfg, 1, 8, dtype="fp8")
    with pytest.raises(UserError, match=r"dtype='float16' " + ALLOWED):
        PagedKVCache.create(cfg, rows=1, num_pages=2, page_size=4, pages_per_row=2,
                            dtype="float16")
    with pytest.raises(UserError, match=r"kv_cache_dtype='int4' " + ALLOWED):
        decode.DecodeRequest(kv_cache_dtype="int4")
    with pytest.raises(UserError, match=r"kv_cache_dtype=None " + ALLOWED):
        decode.DecodeRequest().replace(kv_cache_dtype=None)
    model, params = copier()
    with pytest.raises(UserError, match=r"kv_cache_dtype=8 " + ALLOWED):
        decode.generate(model, params, np.full((1, 3), 5), np.array([3]),
                        max_new_tokens=2, kv_cache_dtype=8)
    with pytest.raises(UserError, match=r"kv_cache_dtype='INT8' " + ALLOWED):
        decode.beam_search(model, params, np.full((1, 3), 5), np.array([3]),
                           max_new_tokens=2, kv_cache_dtype="INT8")
    with pytest.raises(UserError, match=r"kv_cache_dtype='int4' " + ALLOWED):
        Engine(_pretrained(), kv_cache_dtype="int4")


def test_an_engine_refuses_a_request_for_another_cache():
    engine = Engine(_pretrained(), max_slots=1, page_size=4, num_pages=4)
    with pytest.raises(UserError, match="kv_cache_dtype='int8': the engine's page pool is "
                                        "'auto'"):
        engine.submit(serve.Submission((3, 4, SEP), decode.DecodeRequest(
            max_new_tokens=2, kv_cache_dtype="int8")))


def test_the_command_lines_flag():
    args = build_parser().parse_args(["--config", "gpt-tiny", "--kv-cache-dtype", "int8"])
    request = cli_request.request_for(args, GenerationDefaults(max_new_tokens=4),
                                      tiny(), prompt_len=3)
    assert request.kv_cache_dtype == "int8"
    assert request.generate_options()["kv_cache_dtype"] == "int8"
    args = build_parser().parse_args(["--config", "gpt-tiny"])
    assert cli_request.request_for(args, GenerationDefaults(max_new_tokens=4), tiny(),
                                   prompt_len=3).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", "gpt-tiny", "--kv-cache-dtype", "fp8"])
    parser = build_parser()       # the encoder-only and audio tasks refuse it: no such cache
    args = parser.parse_args(["--model", "m", "--fill-mask", "--kv-cache-dtype", "int8"])
    with pytest.raises(UserError, match="--kv-cache-dtype applies to generation"):
        encoder_cli.check_flags(args, parser)
    args = parser.parse_args(["--model", "m", "--audio", "a.wav", "--kv-cache-dtype", "int8"])
    with pytest.raises(UserError, match="--kv-cache-dtype applies to text generation"):
        whisper_cli.check_flags(args, parser)
    from serve.__main__ import build_parser as serve_parser
    assert serve_parser().parse_args(["--model", "m", "--kv-cache-dtype", "int8"]
                                     ).kv_cache_dtype == "int8"
