"""Quantized weights (`models.quant`, `models.quantize`): the error of each scheme, which
kernels are quantized in every family, a trained model's logits and greedy tokens against
its float self, the cached path equal to the forward pass, loading quantized, and the
refusals."""

from __future__ import annotations

import functools
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import decode
import models
from models import axes
from models.errors import UserError
from models.quant import Quantized, nbytes, quantize_kernel
from tests.helpers import tiny

V = 48


# --- one kernel --------------------------------------------------------------------------

@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 8), ("int4", 32)])
def test_each_weight_is_within_half_a_step_of_its_scale(scheme, group):
    w = jax.random.normal(jax.random.key(1), (2, 32, 3, 5)) * jnp.array([[[[1e-3, 1, 30, 0, 2]]]])
    q = quantize_kernel(w, scheme, n_lead=1, n_in=1, group=group or 128)
    chex.assert_shape(q.dequantize(), w.shape)
    assert q.shape == w.shape and q.lead_shape == (2,)
    if scheme == "int8":
        chex.assert_shape(q.scales, (2, 3, 5))
        step = q.scales[:, None]                                 # per output channel
        assert q.values.dtype == jnp.int8 and int(jnp.max(jnp.abs(q.values))) <= 127
    else:
        chex.assert_shape(q.scales, (2, 32 // group, 3, 5))
        chex.assert_shape(q.values, (2, 32 // group, group // 2, 3, 5))     # two a byte
        step = jnp.repeat(q.scales, group, axis=1)
        assert q.values.dtype == jnp.uint8
    err = jnp.abs(q.dequantize() - w)
    assert bool(jnp.all(err <= step / 2 * (1 + 1e-6) + 1e-12))
    # The largest weight of each channel (group) is exact, a zero channel stays zero.
    assert float(jnp.max(jnp.abs(q.dequantize()[..., 3]))) == 0.0
    np.testing.assert_allclose(jnp.max(jnp.abs(q.dequantize()), axis=1),
                               jnp.max(jnp.abs(w), axis=1), rtol=1e-6)


def test_w8a8_multiplies_integers_and_matches_the_float_product_to_both_roundings():
    from models.quant import dense, quantize_rows
    w = jax.random.normal(jax.random.key(0), (64, 4, 6))
    x = jax.random.normal(jax.random.key(1), (3, 5, 64)).at[0, 0].set(0.0)   # a zero row
    q = quantize_kernel(w, "w8a8", n_lead=0, n_in=1)
    x_q, x_scale = quantize_rows(x)
    assert x_q.dtype == jnp.int8 and float(x_scale[0, 0, 0]) == 0.0
    got = dense(x, q, jnp.float32)
    chex.assert_shape(got, (3, 5, 4, 6))
    exact = jnp.einsum("btd,dnh->btnh", x, w)
    np.testing.assert_allclose(got, exact, atol=0.02 * float(jnp.max(jnp.abs(exact))))
    np.testing.assert_array_equal(got[0, 0], 0.0)
    hlo = jax.jit(lambda x, q: dense(x, q, jnp.float32)).lower(x, q).as_text()
    assert "tensor<15x64xi8>" in hlo
    assert "-> tensor<15x4x6xi32>" in hlo                       # summed in int32
    one_row = jax.jit(lambda x, q: dense(x, q, jnp.float32)).lower(x[:1, :1], q).as_text()
    assert "-> tensor<2x4x6xi32>" in one_row                    # a row of zeros beside it
    np.testing.assert_array_equal(dense(x[1:2, 1:2], q, jnp.float32), got[1:2, 1:2])


def test_int4_packs_every_value_and_its_sign_into_its_nibble():
    values = jnp.arange(-7, 9, dtype=jnp.float32)[:16].at[15].set(7)        # -7 .. 7, 7
    w = values[:, None] * jnp.array([[1.0, -0.5]])                  # [16 inputs, 2 outputs]
    q = quantize_kernel(w, "int4", n_lead=0, n_in=1, group=16)
    np.testing.assert_array_equal(q.dequantize(), w)
    assert q.nbytes == 16 + 2 * 4                                    # 16*2/2 + 2 scales


def test_a_projection_reads_int8_without_rebuilding_the_kernel():
    """int8's matrix product contracts the integers and scales the outputs: its program
    has no multiply of the whole kernel by its scales."""
    from models.quant import dense
    q = quantize_kernel(jax.random.normal(jax.random.key(0), (64, 48)), "int8", n_lead=0,
                        n_in=1)
    x = jax.random.normal(jax.random.key(1), (3, 64))
    np.testing.assert_allclose(dense(x, q, jnp.float32), x @ q.dequantize(), rtol=1e-5,
                               atol=1e-5)
    hlo = jax.jit(lambda x, q: dense(x, q, jnp.float32)).lower(x, q).as_text()
    assert "stablehlo.convert %arg1 : (tensor<64x48xi8>) -> tensor<64x48xf32>" in hlo
    assert hlo.count("stablehlo.multiply") == 1   # of [3, 48], not of the kernel


# --- which kernels, in every family ------------------------------------------------------

FAMILIES = {
    "decoder_only": dict(),
    "scanned": dict(scan_layers=True),
    "encoder_decoder": dict(arch="encoder_decoder"),
    "moe": dict(num_experts=4, experts_per_token=2, expert_mlp_dim=16, activation="swiglu",
                use_bias=False),
    "encoder_only": dict(arch="encoder_only"),
}


def _config(family: str) -> models.TransformerConfig:
    kw = dict(FAMILIES[family])
    return tiny(kw.pop("arch", "decoder_only"), vocab_size=V, **kw)


def _init(cfg):
    args, method = axes.init_args(cfg)
    args = [jnp.arange(6, dtype=jnp.int32)[None] % V + 2 for _ in args]
    params = models.build(cfg).init(jax.random.key(0), *args, method=method)["params"]
    return params, args, method


def _leaves(tree):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, Quantized))[0]}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_projection_kernel_and_nothing_else_is_quantized(family):
    cfg = _config(family)
    params, args, method = _init(cfg)
    q = models.quantize(params, cfg, "int8")
    before, after = _leaves(params), _leaves(q)
    assert before.keys() == after.keys()
    quantized = {k for k, x in after.items() if isinstance(x, Quantized)}
    names = {k.split("']['")[-1].rstrip("']") for k in quantized}
    assert names <= {"kernel", "key_kernel", "value_kernel", "gate_kernel", "up_kernel",
                     "down_kernel"}
    expected = {k for k in before if k.endswith("kernel']") and "head" not in k
                and "router" not in k}
    assert quantized == expected
    for k in before.keys() - quantized:                       # untouched: the same arrays
        assert after[k] is before[k] or np.array_equal(after[k], before[k])
    if family == "moe":
        assert any("gate_kernel" in k for k in quantized)
    model = models.build(cfg)
    logits = model.apply({"params": params}, *args, method=method)
    got = model.apply({"params": q}, *args, method=method)
    np.testing.assert_allclose(got, logits, atol=0.05 * float(jnp.max(jnp.abs(logits))))


def test_embeddings_and_the_head_only_when_asked_and_tied_tables_read_quantized():
    for tied in (True, False):
        cfg = tiny(vocab_size=V, tie_embeddings=tied)
        params, args, _ = _init(cfg)
        model = models.build(cfg)
        q = _leaves(models.quantize(params, cfg, "int8", embeddings=True))
        assert isinstance(q["['tokens']['embedding']"], Quantized)
        assert tied or isinstance(q["['head']['kernel']"], Quantized)
        logits = model.apply({"params": params}, *args)
        quantized = models.quantize(params, cfg, "int4", group=16, embeddings=True)
        np.testing.assert_allclose(model.apply({"params": quantized}, *args), logits,
                                   atol=0.2 * float(jnp.max(jnp.abs(logits))))


# --- a trained model ---------------------------------------------------------------------

def _sequences(seed: int, n: int, length: int = 24) -> np.ndarray:
    """Rows counting from a random start (mod V - 2, shifted past the ids 0 and 1), by 1
    from an even start and by 2 from an odd one."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, V - 2, (n, 1))
    return jnp.asarray((start + (1 + start % 2) * np.arange(length)) % (V - 2) + 2, jnp.int32)


@functools.cache
def _trained():
    """A 2-layer decoder trained on `_sequences` until it is sure of them (about 5 s on 2
    idle cores)."""
    cfg = tiny(vocab_size=V, d_model=64, num_heads=4, mlp_dim=128, num_layers=2)
    model = models.build(cfg)
    params = model.init(jax.random.key(0), _sequences(0, 1))["params"]
    tx = optax.adam(1e-2)

    @jax.jit
    def step(params, opt, rows):
        def loss(p):
            logits = model.apply({"params": p}, rows[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt)
        return optax.apply_updates(params, updates), opt, value

    opt = tx.init(params)
    for i in range(320):
        params, opt, value = step(params, opt, _sequences(100 + i, 32))
    return cfg, model, params, float(value), jax.jit(
        lambda p, rows: model.apply({"params": p}, rows))


def test_a_trained_models_int8_logits_and_greedy_tokens_follow_its_float_ones():
    cfg, model, params, loss, forward = _trained()
    assert loss < 0.1, loss
    held_out = _sequences(7, 64)
    logits = forward(params, held_out[:, :-1])
    for scheme, tolerance, agreement in (("int8", 0.02, 0.99), ("w8a8", 0.04, 0.99),
                                         ("int4", 0.25, 0.95)):
        q = models.quantize(params, cfg, scheme, group=16)
        got = forward(q, held_out[:, :-1])
        spread = float(jnp.max(logits) - jnp.min(logits))
        assert float(jnp.max(jnp.abs(got - logits))) <= tolerance * spread, scheme
        same = float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(logits, -1)))
        assert same >= agreement, (scheme, same)
        prompts, lengths = held_out[:, :8], jnp.full((64,), 8, jnp.int32)
        ours = decode.generate(model, q, prompts, lengths, max_new_tokens=12).tokens
        theirs = decode.generate(model, params, prompts, lengths, max_new_tokens=12).tokens
        assert float(jnp.mean(ours == theirs)) >= agreement, scheme


def test_prefill_and_steps_over_quantized_weights_equal_their_forward_pass():
    cfg, model, params, _, forward = _trained()
    q = models.quantize(params, cfg, "int4", group=16)
    rows = _sequences(3, 2, 10)
    prefill = jax.jit(lambda p, t, n, c: model.apply({"params": p}, t, n, c,
                                                     method="prefill"))
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, method="step"))
    first, cache = prefill(q, rows[:, :6], jnp.array([6, 6]), models.KVCache.create(cfg, 2, 16))
    steps = [first]
    for t in range(6, 10):
        logits, cache = step(q, rows[:, t], cache)
        steps.append(logits[:, None])
    np.testing.assert_allclose(jnp.concatenate(steps, 1), forward(q, rows), atol=2e-5,
                               rtol=2e-5)


def test_a_quantized_beam_search_equals_the_float_one_on_a_trained_model():
    cfg, model, params, _, _ = _trained()
    prompts = _sequences(11, 8)[:, :6]
    lengths = jnp.full((8,), 6, jnp.int32)
    q = models.quantize(params, cfg, "int8")
    ours = decode.beam_search(model, q, prompts, lengths, beam_size=3, max_new_tokens=8)
    theirs = decode.beam_search(model, params, prompts, lengths, beam_size=3,
                                max_new_tokens=8)
    np.testing.assert_array_equal(ours.tokens[:, 0], theirs.tokens[:, 0])


@pytest.mark.parametrize("family", ["decoder_only", "encoder_decoder"])
def test_int4_parameter_bytes_are_a_quarter_of_int8s_projection_bytes(family):
    cfg = tiny(family, vocab_size=V, d_model=64, num_heads=4, mlp_dim=128)
    params, _, _ = _init(cfg)
    kernels = sum(int(np.prod(x.shape)) for k, x in _leaves(models.quantize(
        params, cfg, "int8")).items() if isinstance(x, Quantized))
    floats = nbytes(params)
    int8, int4 = (nbytes(models.quantize(params, cfg, s, group=32)) for s in ("int8", "int4"))
    assert floats - int8 >= kernels * 3 - kernels // 8     # 4 bytes -> 1, plus scales
    assert int8 - int4 >= kernels // 2 - kernels // 8      # 1 byte -> half


# --- loading, and what is refused --------------------------------------------------------

def test_load_quantizes_as_it_reads_and_save_refuses_quantized_weights(tmp_path):
    cfg = tiny(vocab_size=V)
    params, args, _ = _init(cfg)
    models.save(str(tmp_path / "m"), cfg, params)
    pre = models.load(str(tmp_path / "m"), quantize="int8")
    expected = models.quantize(models.load(str(tmp_path / "m")), "int8")
    chex.assert_trees_all_close(pre.params, expected.params)
    assert isinstance(_leaves(pre.params)["['decoder']['layer_0']['mlp']['up']['kernel']"],
                      Quantized)
    with pytest.raises(UserError, match="quantized"):
        models.save(str(tmp_path / "again"), pre.config, pre.params)
    assert not os.path.exists(tmp_path / "again")
    with pytest.raises(UserError, match="'int3'.*int8"):
        models.load(str(tmp_path / "m"), quantize="int3")


def test_bad_schemes_groups_trees_and_merges_are_refused_by_name():
    cfg = tiny(vocab_size=V, d_model=48, num_heads=2, mlp_dim=96)
    params, _, _ = _init(cfg)
    with pytest.raises(UserError, match="'fp8'.*int8.*int4"):
        models.quantize(params, cfg, "fp8")
    with pytest.raises(UserError, match="group=32 does not divide .*query/kernel's 48"):
        models.quantize(params, cfg, "int4", group=32)
    with pytest.raises(UserError, match="group=7"):
        models.quantize(params, cfg, "int4", group=7)
    q = models.quantize(params, cfg, "int8")
    with pytest.raises(UserError, match="already quantized"):
        models.quantize(q, cfg, "int8")
    with pytest.raises(UserError, match="needs its model's config"):
        models.quantize(params, "int8")
    other = tiny("encoder_decoder", vocab_size=V, d_model=48, num_heads=2, mlp_dim=96)
    with pytest.raises(UserError, match="have no encoder/"):
        models.quantize(params, other, "int8")
    from models import lora
    adapted = cfg.replace(lora=models.LoraConfig(rank=2))
    with pytest.raises(UserError, match="quantized base"):
        lora.merge(adapted, q)


# --- the command lines -------------------------------------------------------------------

def test_decode_quantize_flag_decodes_with_the_quantized_weights(tmp_path, capsys):
    from decode.__main__ import main
    cfg, model, params, _, _ = _trained()
    models.save(str(tmp_path / "m"), cfg, params)
    prompt = _sequences(5, 1)[:, :6]
    args = ["--model", str(tmp_path / "m"), "--max-new-tokens", "8", "--no-compile-cache",
            " ".join(map(str, prompt[0].tolist()))]
    q = models.quantize(params, cfg, "int4", group=16)
    expected = decode.generate(model, q, prompt, jnp.array([6]), max_new_tokens=8).tokens
    assert main(args + ["--quantize", "int4", "--quantize-group", "16"]) == 0
    out = capsys.readouterr()
    assert out.out.split() == [str(t) for t in expected[0].tolist()]
    assert "int4 weights" in out.err
    assert main(args + ["--quantize", "int4", "--quantize-group", "12"]) == 2
    assert "group=12 does not divide" in capsys.readouterr().err


def test_the_server_takes_the_same_quantize_flags():
    from serve.__main__ import build_parser
    args = build_parser().parse_args(["--model", "m", "--quantize", "int4",
                                      "--quantize-group", "64"])
    assert (args.quantize, args.quantize_group) == ("int4", 64)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--quantize", "fp8"])
