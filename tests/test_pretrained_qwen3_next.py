"""Qwen3-Next: models.load against transformers' logits and decoding, models.save back,
serving, speculative decoding and training on packed rows.

Tiny random transformers Qwen3NextForCausalLM models (every tensor random: the linear
layers' projections, convolution, A_log, dt_bias and gated norm, the (1 + w) norms, the
gated query, the router, the experts, the shared expert and its gate) give the same logits
loaded here, the delta rule in chunks of 4 (three chunks of the 10 tokens) or in one
chunk; a right-padded batch gives transformers' masked logits at its real tokens; the
fused linear projections split as transformers' `fix_query_key_value_ordering` splits
them; load then save gives the tensors transformers wrote bit for bit; a bfloat16
checkpoint loads exactly; the published files' MTP tensors are skipped by name; refused
values and unknown fields are named; a ragged prefill then cached steps give
transformers' logits and greedy decoding its `generate` (the cache carries the linear
layers' state), and beam search with either beam cache its beam search; the serving
engine (a state per slot), speculative decoding (drafts rejected: both caches rebuild
their states from the kept tokens) and beam search of width 1 give greedy's tokens; a
packed row gives each sequence its own logits, and packed rows train over a sharded mesh
as on one device; gated attention alone decodes as its forward pass; and the
Qwen3-Next-80B-A3B preset has transformers' parameter count.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.paged_cache import PagedKVCache
from models.pretrained import FAMILIES
from tests import pretrained_helpers as ph
from tests.helpers import fns
from tests.pretrained_helpers import SPECIAL, T, copy_dir, edit_config, set_fields
from tests.test_pretrained_2025 import _our_count, _their_count

highest_precision = ph.highest_precision
ATOL = 1e-4
_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=32,
              rms_norm_eps=1e-5, linear_key_head_dim=8, linear_value_head_dim=6,
              num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=20,
              **SPECIAL)

CASES = {
    # Linear, full, linear, full (full_attention_interval 2); two value heads per key head;
    # experts in every layer, top 2 renormalised; RoPE over a quarter of each head (no
    # partial_rotary_factor in config.json: Qwen3NextConfig's 0.25).
    "qwen3-next-interval-2": ("qwen3_next", "Qwen3NextConfig", dict(
        _SMALL, num_hidden_layers=4, full_attention_interval=2, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts_per_tok=2), dict(
        layer_types=("linear", "full", "linear", "full"), moe_layers=(),
        partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, attention_output_gate=True,
        shared_expert_gate=True, norm_scale_offset=1.0, qk_norm=True, tie_embeddings=False,
        experts_per_token=2, router_renormalize=True, expert_width=24,
        shared_expert_mlp_dim=20)),
    # Linear, linear, full (layer_types); one value head per key head; a dense layer 1
    # (mlp_only_layers) between expert layers, top 1 not renormalised; half of each head
    # rotated at base 1000; a tied head; a convolution of width 3.
    "qwen3-next-dense-layer-tied": ("qwen3_next", "Qwen3NextConfig", dict(
        _SMALL, num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=3, linear_num_value_heads=3, linear_conv_kernel_dim=3,
        mlp_only_layers=[1], num_experts_per_tok=1, norm_topk_prob=False,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                   "partial_rotary_factor": 0.5}), dict(
        layer_types=("linear", "linear", "full"), moe_layers=(0, 2), mlp_dim=40,
        partial_rotary_factor=0.5, rope_theta=1000.0, tie_embeddings=True,
        router_renormalize=False, linear_conv_width=3)),
}
# The delta rule's chunk per case: three chunks of the 10 tokens, or one.
CHUNK = {"qwen3-next-interval-2": 4, "qwen3-next-dense-layer-tied": 64}

ckpt, _ = ph.checkpoints(CASES, "hf_checkpoints_qwen3_next", first_seed=900)


@pytest.mark.parametrize("name", CASES)
def test_loaded_qwen3_next_gives_transformers_logits(name, ckpt, highest_precision):
    pre, _ = ph.assert_loads_with_transformers_logits(ckpt(name), atol=ATOL,
                                                      linear_chunk_size=CHUNK[name])
    assert pre.config.linear_chunk_size == CHUNK[name]
    # The gated attention layers through the chunked attention kernel, in blocks of 4.
    other = models.load(ckpt(name).path, attention_impl="chunked", attention_block=4,
                        linear_chunk_size=CHUNK[name])
    np.testing.assert_allclose(fns(other.config).forward(other.params, ckpt(name).tokens),
                               ckpt(name).logits, atol=ATOL, rtol=0)


def test_a_right_padded_batch_gives_transformers_logits_at_its_real_tokens(
        ckpt, highest_precision):
    """Row 1 padded after 6 tokens (pad ids, masked in transformers' attention_mask, which
    also zeroes the padding's input to the linear layers): every real token's logits are
    transformers', as causal layers read no later token."""
    c = ckpt("qwen3-next-interval-2")
    lengths = np.array([T, 6])
    real = np.arange(T)[None, :] < lengths[:, None]
    tokens = np.where(real, c.tokens, 4).astype(np.int32)
    torch = ph.torch
    with torch.no_grad():
        theirs = c.model(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                         attention_mask=torch.as_tensor(real, dtype=torch.long)).logits.numpy()
    pre = models.load(c.path, linear_chunk_size=CHUNK["qwen3-next-interval-2"])
    ours = np.asarray(fns(pre.config).forward(pre.params, jnp.asarray(tokens)))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(ours[b, :n], theirs[b, :n], atol=ATOL, rtol=0,
                                   err_msg=f"row {b}")


def test_the_fused_linear_projections_split_as_transformers_orders_them(ckpt):
    """Our query/key/value/gate and beta/decay kernels, applied to an input, give what
    transformers' `fix_query_key_value_ordering` makes of its fused projections (two value
    heads per key head: the grouping matters); the depthwise taps and the gated query
    land where the model reads them."""
    torch = ph.torch
    c = ckpt("qwen3-next-interval-2")
    pre = models.load(c.path)
    layer = c.model.model.layers[0].linear_attn
    x = np.random.default_rng(0).normal(size=(2, 3, 32)).astype(np.float32)
    with torch.no_grad():
        xt = torch.as_tensor(x)
        theirs = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(xt), layer.in_proj_ba(xt))
    ours = pre.params["decoder"]["layer_0"]["linear_attention"]
    for name, want in zip(("query", "key", "value", "gate", "beta", "decay"), theirs,
                          strict=True):
        kernel = np.asarray(ours[name]["kernel"])
        got = np.tensordot(x, kernel, axes=1)
        np.testing.assert_allclose(got, want.numpy(), atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(ours["conv_kernel"],
                                  c.state["model.layers.0.linear_attn.conv1d.weight"][:, 0])
    q = c.state["model.layers.1.self_attn.q_proj.weight"].numpy()          # [N 2H, D]
    query = np.asarray(pre.params["decoder"]["layer_1"]["self_attention"]["query"]["kernel"])
    np.testing.assert_array_equal(query[:, 1, 16:], q[48:64].T)            # head 1's gate


@pytest.mark.parametrize("name", CASES)
def test_load_then_save_gives_the_tensors_transformers_wrote_bit_for_bit(name, ckpt, tmp_path):
    ph.assert_saves_back_bit_for_bit(ckpt(name), "qwen3_next", tmp_path)
    written = json.load(open(tmp_path / "again" / "config.json"))
    assert written["rope_parameters"]["partial_rotary_factor"] == CASES[name][3].get(
        "partial_rotary_factor", 0.25)


def test_a_bfloat16_checkpoint_loads_exactly(ckpt, tmp_path):
    ph.assert_bfloat16_loads_exactly(ckpt("qwen3-next-interval-2"), tmp_path)


def test_the_published_multi_token_prediction_tensors_are_skipped_by_name(ckpt, tmp_path):
    from safetensors.numpy import load_file, save_file
    c = ckpt("qwen3-next-interval-2")
    path = copy_dir(c.path, tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["mtp.fc.weight"] = np.ones((32, 64), np.float32)
    tensors["mtp.layers.0.input_layernorm.weight"] = np.ones((32,), np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"mtp\.fc\.weight, mtp\.layers\.0\.input_layernorm"):
        pre = models.load(path)
    ph.assert_same_params(pre.params, models.load(c.path).params)


REFUSED = [
    (dict(hidden_act="gelu"), ["hidden_act", "gelu", "silu"]),
    (dict(attention_bias=True), ["attention_bias", "True"]),
    (dict(layer_types=["full_attention"]), ["layer_types", "4 layers"]),
    (dict(layer_types=["sliding_attention"] * 4), ["layer_types", "sliding_attention"]),
    (dict(mlp_only_layers=[0, 1, 2, 3]), ["mlp_only_layers", "expert layers"]),
    (dict(decoder_sparse_step=0), ["decoder_sparse_step", "0"]),
    (dict(use_sliding_window=True), ["use_sliding_window", "True"]),
    (dict(linear_num_value_heads=3), ["linear_num_value_heads=3", "linear_num_key_heads=2"]),
    (dict(partial_rotary_factor=0.5), ["partial_rotary_factor", "0.5", "0.25"]),
    (dict(mtp_num_hidden_layers=1), ["does not know", "mtp_num_hidden_layers=1"]),
]


@pytest.mark.parametrize("fields,words", REFUSED, ids=[next(iter(f)) for f, _ in REFUSED])
def test_a_config_value_that_cannot_be_computed_is_refused_by_name(fields, words, ckpt,
                                                                   tmp_path):
    path = edit_config(copy_dir(ckpt("qwen3-next-interval-2").path, tmp_path / "m"),
                       set_fields(**fields))
    ph.assert_refused_by_name(path, words)


@pytest.mark.parametrize("name", CASES)
def test_a_ragged_prefill_then_steps_and_greedy_generate_give_transformers(
        name, ckpt, highest_precision):
    """The cache carries each linear layer's state (`KVCache.linear`): a ragged prefill
    then cached steps give transformers' logits at every position, and greedy decoding of
    a right-padded batch gives transformers' `generate` of each prompt alone."""
    c = ckpt(name)
    pre = models.load(c.path, linear_chunk_size=CHUNK[name])
    ph.assert_ragged_prefill_then_steps(fns(pre.config), pre.params, c, atol=ATOL)
    ph.assert_greedy_equals_generate(pre, c, filler=3)


@pytest.mark.parametrize("beam_cache", ["table", "gathered"])
def test_beam_search_carries_the_linear_state_with_the_beams(beam_cache, ckpt,
                                                             highest_precision):
    """Both beam caches carry each beam's linear states (the table cache gathers them by
    parent beam, as the gathered cache gathers every row): the best beam equals
    transformers' beam search."""
    import decode
    c = ckpt("qwen3-next-interval-2")
    pre = models.load(c.path)
    n, W, N = int(ph.PROMPT_LENS[1]), 3, 6
    ours = decode.beam_search(pre.model, pre.params, c.tokens[:1, :n], np.array([n], np.int32),
                              beam_size=W, max_new_tokens=N, eos_id=None,
                              beam_cache=beam_cache)
    torch = ph.torch
    with torch.no_grad():
        theirs = c.model.generate(torch.as_tensor(c.tokens[:1, :n], dtype=torch.long),
                                  attention_mask=torch.ones((1, n), dtype=torch.long),
                                  max_new_tokens=N, min_new_tokens=N, do_sample=False,
                                  num_beams=W, length_penalty=1.0, early_stopping=True,
                                  pad_token_id=4)[0, n:].numpy()
    np.testing.assert_array_equal(np.asarray(ours.tokens[0, 0]), theirs)


def test_served_speculative_and_beam_decoding_carry_the_linear_state(highest_precision):
    """qwen3-next-tiny with every weight moved: the serving engine (a state per slot in the
    paged cache, prompts fed in chunks of 4, requests preempted when the pages run out and
    fed again from their start), the model drafting for itself and beam search of width 1
    give each prompt's greedy tokens alone."""
    cfg = models.get_config("qwen3-next-tiny", vocab_size=64, max_len=48, linear_chunk_size=4)
    ph.assert_every_decoder_gives_greedy(cfg, "qwen3_next", seed=5)
    cache = PagedKVCache.create(cfg, rows=3, num_pages=4, page_size=4, pages_per_row=2)
    assert [s is None for s in cache.linear] == [False, False, False, True]
    assert cache.linear[0].recurrent.shape == (3, 4, 16, 16)


def test_a_draft_whose_tokens_are_rejected_leaves_the_targets_greedy_tokens():
    """Speculative decoding with a draft of other weights (both with linear layers): some
    draft tokens are rejected, so both caches roll back inside an iteration, and their
    linear states must be those of the kept tokens alone. Greedy gives the target's own
    greedy tokens on a ragged batch."""
    import decode
    cfg = models.get_config("qwen3-next-tiny", vocab_size=64, max_len=48, linear_chunk_size=4)
    model = models.build(cfg)
    params, draft_params = fns(cfg).init(0), fns(cfg).init(1)
    prompts, lengths = decode.pad_prompts([[5, 9, 11], [7, 3, 20, 31, 8, 4, 12], [40]])
    greedy = decode.generate(model, params, prompts, lengths, max_new_tokens=12, eos_id=None)
    drafted = decode.generate(model, params, prompts, lengths, max_new_tokens=12, eos_id=None,
                              draft_model=model, draft_params=draft_params, draft_tokens=3)
    np.testing.assert_array_equal(drafted.tokens, greedy.tokens)
    assert 0 < int(drafted.accepted.sum()) < int(drafted.drafted.sum())


def test_a_packed_row_gives_each_sequence_its_own_logits(highest_precision):
    """qwen3-next-tiny (three linear layers in chunks of 4, a gated attention layer) on
    packed rows of three sequences and padding equals each sequence alone: the delta
    rule's state and the convolution restart at each sequence's first token, in a chunk's
    middle or at its edge. Gradients flow through the packed rows (training packs)."""
    cfg = models.get_config("qwen3-next-tiny", vocab_size=64, linear_chunk_size=4)
    f = fns(cfg)
    params = f.init(0)
    sizes = [(5, 7, 3), (4, 9, 2)]
    rng = np.random.default_rng(0)
    rows, segments, positions = [], [], []
    for row in sizes:
        pieces = [rng.integers(5, 64, n) for n in row]
        rows.append((pieces, np.concatenate(pieces + [np.zeros(16 - sum(row), int)])))
        segments.append(np.concatenate([np.full(n, i + 1) for i, n in enumerate(row)]
                                       + [np.zeros(16 - sum(row), int)]))
        positions.append(np.concatenate([np.arange(n) for n in row]
                                        + [np.zeros(16 - sum(row), int)]))
    tokens = np.stack([t for _, t in rows])
    packed = f.forward(params, tokens, segment_ids=np.stack(segments),
                       positions=np.stack(positions))
    for b, (pieces, _) in enumerate(rows):
        start = 0
        for piece in pieces:
            np.testing.assert_allclose(packed[b, start:start + len(piece)],
                                       f.forward(params, piece[None])[0], atol=3e-5)
            start += len(piece)
    grads = jax.grad(lambda p: f.model.apply(
        {"params": p}, tokens, segment_ids=np.stack(segments),
        positions=np.stack(positions)).sum())(params)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(grads))


def test_three_packed_steps_over_an_fsdp2_tensor2_mesh_equal_one_device():
    """Qwen3-Next's layers (Gated DeltaNet with its heads split over tensor, gated
    attention, the experts with a gated shared expert), trained three steps on packed rows
    (two sequences and padding a row, as the trainer packs) with the parameters split over
    fsdp and tensor: the parameters of three steps on one device."""
    import chex

    from tests import test_sharding as ts
    cfg = models.get_config("qwen3-next-tiny", vocab_size=64, max_len=ts.W,
                            linear_chunk_size=4, layer_types=("linear", "full"), num_layers=2)
    sh, make_state = ts._sharded(cfg, (1, 2, 2))
    state = sh.init_state(make_state)
    value = state.params["decoder"]["layer_0"]["linear_attention"]["value"]["kernel"]
    assert value.sharding.spec[1] == "tensor"                     # [D, N', E']
    for b in ts._batches(cfg):
        assert (b["targets_segmentation"] == 2).any()
        state, _ = sh.train_step(state, jax.tree.map(lambda x: x.reshape(4, -1, ts.W), b))
    chex.assert_trees_all_close(sh.host_state(state).params, ts._one_device(cfg), atol=2e-5)


def test_linear_layers_refuse_what_they_cannot_compute():
    with pytest.raises(ValueError, match=r"scan_layers=True.*'linear' layers"):
        models.get_config("qwen3-next-tiny", scan_layers=True)
    with pytest.raises(ValueError, match=r"layer_types has 'linear' layers, which need "
                                         r"linear_num_key_heads"):
        models.get_config("qwen3-next-tiny", linear_num_key_heads=None)
    with pytest.raises(ValueError, match=r"linear_num_key_heads=2 shapes the linear"):
        models.get_config("qwen3-next-tiny", layer_types=())
    with pytest.raises(ValueError, match=r"shared_expert_gate=True .* needs "
                                         r"shared_expert_mlp_dim"):
        models.get_config("llama-tiny", shared_expert_gate=True)
    with pytest.raises(ValueError, match=r"attention_output_gate=True .* encoder-decoder"):
        models.get_config("transformer-tiny", attention_output_gate=True)


def test_gated_attention_alone_decodes_as_its_forward_pass(highest_precision):
    """`attention_output_gate` without linear layers: prefill and the read-only step (the
    path `generate` takes) give the forward pass's logits, and `fuse_qkv` leaves the
    twice-as-wide query apart."""
    cfg = models.get_config("llama-tiny", vocab_size=64, max_len=32, num_layers=1,
                            attention_output_gate=True)
    f = fns(cfg)
    params = jax.tree.map(lambda x: x + 0.3 * jnp.sin(jnp.arange(x.size).reshape(x.shape)),
                          f.init(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 6)), jnp.int32)
    want = f.forward(params, tokens)
    cache = models.KVCache.create(cfg, 2, 16)
    logits, cache = f.prefill(params, tokens[:, :5], jnp.asarray([5, 5], jnp.int32), cache)
    np.testing.assert_allclose(logits, want[:, :5], atol=1e-5, rtol=0)
    step, _ = jax.jit(lambda p, t, c: f.model.apply({"params": p}, t, c, method="read_step"))(
        params, tokens[:, 5], cache)
    np.testing.assert_allclose(step, want[:, 5], atol=1e-5, rtol=0)
    attention = models.attention.fuse_qkv(params)["decoder"]["layer_0"]["self_attention"]
    assert "qkv_kernel" not in attention and attention["query"]["kernel"].shape == (64, 4, 32)


def _published() -> dict:
    """Qwen/Qwen3-Next-80B-A3B-Instruct's config.json."""
    return {
        "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
        "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
        "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
        "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
        "num_key_value_heads": 2, "output_router_logits": False, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936}


def test_the_qwen3_next_preset_at_the_published_size_has_transformers_parameter_count():
    cfg = models.get_config("qwen3-next-80b-a3b")
    ids = dict(pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
    assert FAMILIES["qwen3_next"].config_from_hf(_published()).replace(**ids) == cfg
    fields = {k: v for k, v in _published().items() if k != "use_sliding_window"}
    theirs = _their_count("Qwen3NextConfig", fields)
    assert _our_count(cfg) == theirs == 79_674_391_296
