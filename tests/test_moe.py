"""The mixture-of-experts MLP (models/moe.py) and its training terms
(train/objectives/moe_terms.py).

Routing never drops a token (every token reaches exactly k experts, however unbalanced the
router), the ragged dispatch equals the dense one and a per-token reference, the top-k
weights are renormalised or not as the config says, a looped stack equals a scanned one
(with remat) and a prefill then cached steps equal the forward pass; the load-balancing loss
equals transformers' `load_balancing_loss_func` on the same logits and mask, the z-loss its
formula; and the train step's gradient includes both terms.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import moe
from tests.helpers import fns, random_tokens, tiny
from train.objectives import moe_terms
from train.objectives.next_token import NextToken

CFG = tiny(positions="rope", norm="rmsnorm", activation="swiglu", use_bias=False,
           num_experts=4, experts_per_token=2, mlp_dim=16, vocab_size=61)
D, E, F, K = CFG.d_model, CFG.num_experts, CFG.expert_width, CFG.experts_per_token


def _kernels(seed=0):
    r = np.random.default_rng(seed)
    return {name: jnp.asarray(r.normal(0, 0.3, shape), jnp.float32) for name, shape in (
        ("gate_EDF", (E, D, F)), ("up_EDF", (E, D, F)), ("down_EFD", (E, F, D)))}


def _reference(x_ND, weights_Nk, experts_Nk, kernels):
    """Token by token, expert by expert, in float64."""
    g, u, d = (np.asarray(kernels[k], np.float64) for k in ("gate_EDF", "up_EDF", "down_EFD"))
    out = np.zeros(x_ND.shape, np.float64)
    for n, x in enumerate(np.asarray(x_ND, np.float64)):
        for w, e in zip(np.asarray(weights_Nk[n]), np.asarray(experts_Nk[n]), strict=True):
            a = x @ g[e]
            out[n] += w * ((a / (1 + np.exp(-a)) * (x @ u[e])) @ d[e])
    return out


def test_route_keeps_the_top_k_and_renormalises_as_configured():
    logits = jnp.asarray([[0.0, 0.0, np.log(2.0), -1.0]])
    w, e = moe.route(logits, 2, renormalize=True)
    np.testing.assert_allclose(w, [[2 / 3, 1 / 3]], rtol=1e-6)
    assert int(e[0, 0]) == 2
    w, e = moe.route(logits, 2, renormalize=False)
    probs = jax.nn.softmax(logits)
    np.testing.assert_allclose(w, [[probs[0, 2], probs[0, e[0, 1]]]], rtol=1e-6)
    assert float(jnp.sum(w)) < 1.0


@pytest.mark.parametrize("dispatch", ["ragged", "dense"])
def test_no_token_is_dropped_however_unbalanced_the_router(dispatch):
    """Every token prefers expert 0 then 1: both take all N tokens, none is dropped."""
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(40, D)), jnp.float32)
    logits = jnp.tile(jnp.asarray([[5.0, 4.0, 0.0, -1.0]]), (40, 1)) + 0.01 * x[:, :E]
    w, e = moe.route(logits, K, renormalize=True)
    assert np.all(np.sort(np.asarray(e), axis=1) == [0, 1])        # k experts per token
    np.testing.assert_allclose(jnp.sum(w, axis=1), 1.0, rtol=1e-6)
    kernels = _kernels()
    y = moe.DISPATCH[dispatch](x, w, e, **kernels)
    np.testing.assert_allclose(y, _reference(x, w, e, kernels), atol=1e-4, rtol=1e-4)


def test_ragged_dispatch_equals_dense_in_values_and_gradients():
    r = np.random.default_rng(2)
    x = jnp.asarray(r.normal(size=(33, D)), jnp.float32)
    logits = jnp.asarray(r.normal(size=(33, E)), jnp.float32)
    kernels = _kernels(3)

    def loss(kernels, x, dispatch):
        w, e = moe.route(logits, K, renormalize=False)
        return jnp.sum(jnp.sin(moe.DISPATCH[dispatch](x, w, e, **kernels)))

    for argnum in (0, 1):
        ragged = jax.grad(loss, argnum)(kernels, x, "ragged")
        dense = jax.grad(loss, argnum)(kernels, x, "dense")
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
                     ragged, dense)
    # A sum of 33 x D sines that mostly cancel: each term agrees to float32 rounding, the
    # sum to that rounding times the number of terms (1.1e-5 absolute on an AMD EPYC host).
    np.testing.assert_allclose(loss(kernels, x, "ragged"), loss(kernels, x, "dense"),
                               atol=1e-4)


@pytest.mark.slow
def test_a_moe_model_loops_scans_remats_and_decodes_with_the_same_logits():
    f = fns(CFG)
    params = f.init(0)
    assert params["decoder"]["layer_0"]["mlp"]["gate_kernel"].shape == (E, D, F)
    assert params["decoder"]["layer_0"]["mlp"]["router_kernel"].shape == (D, E)
    tokens = random_tokens(0, (2, 9), CFG.vocab_size)
    want = f.forward(params, tokens)
    dense = fns(CFG.replace(moe_dispatch="dense"))
    np.testing.assert_allclose(dense.forward(params, tokens), want, atol=1e-5)
    scanned = fns(CFG.replace(scan_layers=True, remat=True))
    stacked = {**params, "decoder": {"layers": jax.tree.map(
        lambda *xs: jnp.stack(xs), params["decoder"]["layer_0"], params["decoder"]["layer_1"]),
        "final_norm": params["decoder"]["final_norm"]}}
    np.testing.assert_allclose(scanned.forward(stacked, tokens), want, atol=1e-5)
    lengths = jnp.asarray([4, 6], jnp.int32)
    for g, p in ((f, params), (scanned, stacked)):        # looped and scanned alike
        cache = g.init_cache(p, 2, 16)
        logits, cache = g.prefill(p, tokens[:, :6], lengths, cache)
        np.testing.assert_allclose(logits[0, :4], want[0, :4], atol=1e-5)
        np.testing.assert_allclose(logits[1, :6], want[1, :6], atol=1e-5)
        for i in range(3):
            at = np.asarray(lengths) + i
            step, cache = g.step(p, tokens[np.arange(2), at], cache)
            np.testing.assert_allclose(step, want[np.arange(2), at], atol=1e-5)


def test_looped_and_scanned_stacks_sow_every_layers_router_logits():
    model = models.build(CFG)
    params = fns(CFG).init(0)
    tokens = random_tokens(1, (2, 7), CFG.vocab_size)
    _, looped = jax.jit(lambda p: model.apply({"params": p}, tokens,
                                              mutable=moe_terms.COLLECTIONS))(params)
    scanned_model = models.build(CFG.replace(scan_layers=True))
    stacked = {**params, "decoder": {"layers": jax.tree.map(
        lambda *xs: jnp.stack(xs), params["decoder"]["layer_0"], params["decoder"]["layer_1"]),
        "final_norm": params["decoder"]["final_norm"]}}
    _, scanned = jax.jit(lambda p: scanned_model.apply(
        {"params": p}, tokens, mutable=moe_terms.COLLECTIONS))(stacked)
    a, b = moe_terms.router_logits(looped), moe_terms.router_logits(scanned)
    assert a.shape == (2, 2, 7, E) and a.dtype == jnp.float32
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow                                  # importing transformers and torch
def test_the_load_balancing_loss_is_transformers_and_the_z_loss_its_formula():
    torch = pytest.importorskip("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    r = np.random.default_rng(4)
    L, B, T = 3, 2, 5
    logits = r.normal(size=(L, B, T, E)).astype(np.float32) * 2
    mask = np.ones((B, T), np.int64)
    mask[1, 3:] = 0
    for m in (None, mask):
        theirs = load_balancing_loss_func(
            tuple(torch.as_tensor(x.reshape(B * T, E)) for x in logits), E, K,
            None if m is None else torch.as_tensor(m))
        ours = moe_terms.load_balancing_loss(jnp.asarray(logits),
                                             np.ones((B, T)) if m is None else m, top_k=K)
        np.testing.assert_allclose(ours, float(theirs), rtol=1e-6)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    want = (lse ** 2 * mask[None]).sum() / (L * mask.sum())
    np.testing.assert_allclose(moe_terms.router_z_loss(jnp.asarray(logits), mask), want,
                               rtol=1e-5)


def _batch():
    r = np.random.default_rng(5)
    targets = r.integers(3, CFG.vocab_size, (2, 8)).astype(np.int32)
    seg = np.ones((2, 8), np.int32)
    seg[1, 5:] = 0
    targets[1, 5:] = 0
    pos = np.where(seg > 0, np.arange(8)[None, :], 0).astype(np.int32)
    return {"targets": jnp.asarray(targets), "targets_segmentation": jnp.asarray(seg),
            "targets_position": jnp.asarray(pos)}


def _train_loss(cfg, params, batch):
    objective = NextToken(bos_id=2)
    task = objective.prepare(batch, key=None, row_ids=None)
    sums = objective.loss_sums(models.build(cfg), params, batch, task,
                               dropout_rng=jax.random.key(0), sample_rng=jax.random.key(1),
                               step=0, train=True)
    return sums["loss"] / sums["weight"], sums


@pytest.mark.slow
def test_the_train_loss_and_its_gradient_include_the_router_terms():
    params, batch = fns(CFG).init(0), _batch()
    plain = CFG.replace(router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    coef = CFG.replace(router_aux_loss_coef=0.3, router_z_loss_coef=0.05)
    (loss0, sums0), g0 = jax.jit(jax.value_and_grad(lambda p: _train_loss(plain, p, batch),
                                                    has_aux=True))(params)
    (loss1, sums1), g1 = jax.jit(jax.value_and_grad(lambda p: _train_loss(coef, p, batch),
                                                    has_aux=True))(params)
    weight = float(sums0["weight"])
    aux, z = float(sums0["moe_aux_loss"]) / weight, float(sums0["router_z_loss"]) / weight
    assert aux > 0 and z > 0
    np.testing.assert_allclose(loss1 - loss0, 0.3 * aux + 0.05 * z, rtol=1e-5)
    np.testing.assert_allclose(sums1["nll"], sums0["nll"], rtol=1e-6)

    def terms(p):                     # the router terms alone, computed apart
        dec_in = jnp.where(batch["targets_position"] == 0, 2,
                           jnp.pad(batch["targets"], ((0, 0), (1, 0)))[:, :-1])
        dec_in = jnp.where(batch["targets_segmentation"] > 0, dec_in, 0)
        _, router = models.build(CFG).apply(
            {"params": p}, dec_in, segment_ids=batch["targets_segmentation"],
            positions=batch["targets_position"], mutable=moe_terms.COLLECTIONS)
        logits, mask = moe_terms.router_logits(router), batch["targets_segmentation"] > 0
        return (0.3 * moe_terms.load_balancing_loss(logits, mask, top_k=K)
                + 0.05 * moe_terms.router_z_loss(logits, mask))
    g_terms = jax.jit(jax.grad(terms))(params)
    router = ("decoder", "layer_0", "mlp", "router_kernel")

    def at(tree):
        for k in router:
            tree = tree[k]
        return np.asarray(tree)
    assert np.abs(at(g0)).max() > 0                     # the LM loss reaches the router
    assert np.abs(at(g_terms)).max() > 0
    np.testing.assert_allclose(at(g1) - at(g0), at(g_terms), atol=1e-6)


def test_a_train_step_logs_the_router_terms():
    from train import step as step_lib
    params, batch = fns(CFG).init(0), _batch()
    _, sums = jax.jit(lambda p: _train_loss(CFG.replace(router_aux_loss_coef=0.1), p,
                                            batch))(params)
    out = step_lib.summarise(jax.device_get(sums))
    assert set(moe_terms.METRICS) <= set(out)
    assert out["moe_aux_loss"] >= 1.0 - 1e-6              # E * sum f P >= 1 (equality: even)


REFUSED = [
    (dict(experts_per_token=5), ["experts_per_token=5", "num_experts=4"]),
    (dict(activation="gelu"), ["num_experts=4", "swiglu", "gelu"]),
    (dict(activation="clamped_swiglu", swiglu_limit=0.0), ["swiglu_limit=0.0", "> 0"]),
    (dict(router_aux_loss_coef=-1.0), ["router_aux_loss_coef=-1.0"]),
    (dict(lora={"rank": 2, "targets": ["up"]}), ["lora target 'up'", "experts"]),
    (dict(lora={"rank": 2, "targets": ["mlp"]}), ["lora target 'mlp'", "experts"]),
    (dict(architecture="encoder_decoder"), ["num_experts=4", "decoder_only"]),
]


@pytest.mark.parametrize("fields,words", REFUSED, ids=[next(iter(f)) for f, _ in REFUSED])
def test_a_moe_config_that_cannot_be_computed_is_refused_by_name(fields, words):
    with pytest.raises(ValueError) as e:
        CFG.replace(**fields)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_lora_on_attention_trains_beside_the_experts():
    cfg = CFG.replace(lora={"rank": 2, "targets": ["query", "value"]})
    f = fns(cfg)
    params = f.init(0)
    assert "lora_a" in str(jax.tree_util.tree_structure(params))
    assert f.forward(params, random_tokens(2, (1, 4), cfg.vocab_size)).shape == (1, 4, 61)


# GPT-OSS's layer: biased router and experts, the clamped SwiGLU, attention sinks.
GPT_OSS_LIKE = dict(use_bias=True, activation="clamped_swiglu", swiglu_limit=0.5,
                    attention_sinks=True)


# Llama 4's: input-scaled sigmoid routing, a shared expert, experts in layer 0 only, and its
# attention (a chunked RoPE layer with L2 q/k norms, a NoPE layer with its temperature).
LLAMA4_LIKE = dict(router_score="sigmoid", router_scales_input=True, router_renormalize=False,
                   shared_expert_mlp_dim=8, moe_layers=(0,), rope_interleaved=True,
                   qk_l2_norm=True, layer_types=("chunked", "full"), attention_chunk_size=3,
                   nope_layers=(1,), attn_temperature_floor=2)


# DeepSeek-V3's: latent attention, biased sigmoid routing among the best of two groups,
# scaled, a shared expert, experts in layer 0 only.
DEEPSEEK_V3_LIKE = dict(head_dim=12, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4,
                        v_head_dim=6, rope_interleaved=True, router_score="sigmoid",
                        router_score_bias=True, router_groups=2, router_top_groups=1,
                        routed_scaling=2.0, shared_expert_mlp_dim=8, moe_layers=(0,))


# Qwen3-Next's: a Gated DeltaNet layer (on the batches' packed rows) then gated attention,
# the experts with a gated shared expert.
QWEN3_NEXT_LIKE = dict(layer_types=("linear", "full"), norm_scale_offset=1.0, qk_norm=True,
                       attention_output_gate=True, partial_rotary_factor=0.5,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=4, linear_chunk_size=4, shared_expert_mlp_dim=8,
                       shared_expert_gate=True)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [{}, GPT_OSS_LIKE, LLAMA4_LIKE, DEEPSEEK_V3_LIKE,
                                     QWEN3_NEXT_LIKE],
                         ids=["mixtral", "gpt_oss", "llama4", "deepseek_v3", "qwen3_next"])
def test_three_steps_with_experts_over_the_expert_axis_equal_one_device(variant):
    """A (1, 2, 1) mesh with expert 2 on the 4 simulated devices: the experts' weights and
    their adam moments split over expert (and embed over fsdp), the batch over fsdp ×
    expert; three steps give the parameters of three on one device, router terms on."""
    from jax.sharding import PartitionSpec as P

    from tests import test_sharding as ts
    from train import sharding
    cfg = CFG.replace(max_len=ts.W, num_heads=4, router_aux_loss_coef=0.1,
                      router_z_loss_coef=0.01, **variant)
    steps, tx, make_state = ts._problem(cfg)
    mesh = sharding.make_mesh((1, 2, 1), expert=2)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 2}
    sh = sharding.for_model(steps, tx, mesh=mesh,
                            rules=sharding.check_rules(sharding.DEFAULT_RULES))
    state = sh.init_state(make_state)
    gate = state.params["decoder"]["layer_0"]["mlp"]["gate_kernel"]            # [E, D, F]
    assert gate.sharding.spec == P("expert", "fsdp", None)
    assert gate.addressable_data(0).shape == (E // 2, D // 2, F)
    mu = state.opt_state[1][0].mu["decoder"]["layer_0"]["mlp"]["down_kernel"]
    assert mu.sharding.spec == P("expert", None, "fsdp")
    assert sh.batch_sharding.spec == P(("fsdp", "expert"))
    for b in ts._batches(cfg):
        state, metrics = sh.train_step(state, jax.tree.map(lambda x: x.reshape(4, -1, ts.W), b))
        assert float(metrics["moe_aux_loss"]) > 0
    chex.assert_trees_all_close(sh.host_state(state).params, ts._one_device(cfg), atol=2e-5)


def test_an_expert_axis_that_does_not_divide_the_devices_is_refused_by_name():
    from train import sharding
    with pytest.raises(ValueError, match="mesh_expert=3 must be an int >= 1 that divides the "
                                         "4 devices"):
        sharding.make_mesh((1, -1, 1), expert=3)
    with pytest.raises(ValueError, match=r"mesh_shape=\(1, 4, 1\) has 4 devices, but there "
                                         r"are 2"):
        sharding.make_mesh((1, 4, 1), expert=2)


def test_the_run_configs_mesh_expert_sizes_the_sharded_wrappers_expert_axis():
    from tests import test_sharding as ts
    from train import setup
    from train.settings import ParallelSettings
    steps, tx, _ = ts._problem(CFG.replace(max_len=ts.W))
    settings = ParallelSettings(parallel="sharded", mesh_shape=(1, -1, 1), mesh_expert=2)
    wrapper = setup.make_wrapper(settings, steps, tx, seed=0)
    assert dict(wrapper.mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 2}
