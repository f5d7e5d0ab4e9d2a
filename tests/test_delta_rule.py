"""The gated delta rule (models/delta_rule.py): its three forms agree with each other and
with transformers' Qwen3-Next reference, in values and gradients; padding changes nothing;
the causal convolution matches the layer's and its decoding step; bad shapes are named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import delta_rule

# Tiny but telling shapes: T = 19 is not a multiple of the chunk size 8, value heads are
# twice the key heads (N = 2K), and key and value widths differ (H != E).
B, T, K, N, H, E = 2, 19, 2, 4, 6, 5
CHUNK = 8

recurrent = jax.jit(delta_rule.recurrent, static_argnames=("qk_l2norm",))
chunked = jax.jit(delta_rule.chunked, static_argnames=("chunk_size", "qk_l2norm"))
step = jax.jit(delta_rule.step, static_argnames=("qk_l2norm",))
conv = jax.jit(delta_rule.causal_conv1d)
conv_step = jax.jit(delta_rule.causal_conv1d_step)


def make_inputs(seed: int = 0, *, length: int = T, key_scale: float = 1.0):
    """float32 (q, k, v, g, beta, state) with decays and strengths in a model's ranges.
    Without the L2 norm, keys of norm about 1 (`key_scale` H^-1/2) keep the rule stable,
    as a trained model's are."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, length, K, H))
    k = key_scale * rng.normal(size=(B, length, K, H))
    v = rng.normal(size=(B, length, N, E))
    g = -rng.uniform(0.01, 1.5, size=(B, length, N))
    beta = rng.uniform(0.05, 0.95, size=(B, length, N))
    state = rng.normal(size=(B, N, H, E))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta, state))


def transformers_module():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next
    return modeling_qwen3_next


# --- Parity with transformers --------------------------------------------------------------

@pytest.mark.parametrize("qk_l2norm", [True, False])
def test_recurrent_and_chunked_match_transformers(qk_l2norm):
    import torch
    reference = transformers_module()
    inputs = make_inputs(1, key_scale=1.0 if qk_l2norm else H ** -0.5)
    as_torch = [torch.from_numpy(x) for x in inputs]
    *args, state = as_torch
    want_out, want_state = reference.torch_recurrent_gated_delta_rule(
        *args, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm)
    want_chunk_out, want_chunk_state = reference.torch_chunk_gated_delta_rule(
        *args, chunk_size=CHUNK, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=qk_l2norm)

    out, final = recurrent(*inputs, qk_l2norm=qk_l2norm)
    np.testing.assert_allclose(out, want_out.numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(final, want_state.numpy(), atol=1e-5, rtol=1e-5)
    out, final = chunked(*inputs, chunk_size=CHUNK, qk_l2norm=qk_l2norm)
    np.testing.assert_allclose(out, want_chunk_out.numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(final, want_chunk_state.numpy(), atol=1e-5, rtol=1e-5)


def test_layer_calls_match_transformers(monkeypatch):
    """Inside transformers' Qwen3NextGatedDeltaNet, our convolution, decay_and_beta and
    chunked form reproduce what the layer computes from the same inputs (its conv1d
    weight, A_log and dt_bias; the a, b, q, k, v it makes)."""
    import torch
    reference = transformers_module()
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=16, num_hidden_layers=1, layer_types=["linear_attention"],
        linear_num_key_heads=K, linear_num_value_heads=N, linear_key_head_dim=H,
        linear_value_head_dim=E, linear_conv_kernel_dim=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    layer = reference.Qwen3NextGatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        layer.dt_bias.normal_()
        layer.conv1d.weight.normal_()
    seen = {}

    def recording(name, original):
        def record(*args, **kwargs):
            result = original(*args, **kwargs)
            seen[name] = (args, kwargs, result)
            return result
        return record

    monkeypatch.setattr(reference, "causal_conv1d_fn",
                        recording("conv", reference.causal_conv1d_fn))
    monkeypatch.setattr(reference, "torch_chunk_gated_delta_rule",
                        recording("rule", reference.torch_chunk_gated_delta_rule))
    monkeypatch.setattr(layer, "fix_query_key_value_ordering",
                        recording("split", layer.fix_query_key_value_ordering))
    with torch.no_grad():
        layer(torch.randn(B, T, config.hidden_size))
    assert set(seen) == {"conv", "rule", "split"}, "the layer no longer calls these helpers"

    numpy = {name: np.asarray(p.detach()) for name, p in layer.named_parameters()}
    (conv_in, _, *_), _, conv_out = seen["conv"]
    y, _ = conv(conv_in.numpy().swapaxes(1, 2), numpy["conv1d.weight"][:, 0], None)
    np.testing.assert_allclose(y, conv_out.numpy().swapaxes(1, 2), atol=1e-6, rtol=1e-6)

    *_, b, a = seen["split"][2]
    _, rule_kwargs, (rule_out, _) = seen["rule"]
    g, beta = delta_rule.decay_and_beta(a.numpy(), b.numpy(), numpy["A_log"], numpy["dt_bias"])
    np.testing.assert_allclose(g, rule_kwargs["g"].numpy(), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(beta, rule_kwargs["beta"].numpy(), atol=1e-6, rtol=1e-6)

    q, k, v = (x.numpy() for x in seen["rule"][0][:3])
    assert rule_kwargs["use_qk_l2norm_in_kernel"] is True
    out, _ = chunked(q, k, v, g, beta, chunk_size=64)
    np.testing.assert_allclose(out, rule_out.numpy(), atol=1e-5, rtol=1e-5)


# --- The forms agree with each other ------------------------------------------------------

@pytest.mark.parametrize("chunk_size", [1, CHUNK, 32])
def test_chunked_equals_recurrent(chunk_size):
    """Chunks of one token, chunks that leave a ragged tail, and one chunk longer than T."""
    inputs = make_inputs(2)
    want_out, want_state = recurrent(*inputs)
    out, final = chunked(*inputs, chunk_size=chunk_size)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(final, want_state, atol=1e-5, rtol=1e-5)


def test_chunked_gradients_equal_recurrent():
    """d(loss)/d(q, k, v, g, beta, initial state), the loss weighing every output and the
    final state."""
    inputs = make_inputs(3)
    rng = np.random.default_rng(4)
    out_weight = rng.normal(size=(B, T, N, E)).astype(np.float32)
    state_weight = rng.normal(size=(B, N, H, E)).astype(np.float32)

    def loss(form):
        def weighed(*args):
            out, final = form(*args)
            return (out * out_weight).sum() + (final * state_weight).sum()
        return jax.jit(jax.grad(weighed, argnums=tuple(range(6))))

    want = loss(delta_rule.recurrent)(*inputs)
    got = loss(lambda *a: delta_rule.chunked(*a, chunk_size=CHUNK))(*inputs)
    for name, w, x in zip(("q", "k", "v", "g", "beta", "state"), want, got, strict=True):
        assert np.all(np.isfinite(x)), name
        np.testing.assert_allclose(x, w, atol=1e-5, rtol=1e-5, err_msg=name)


def test_steps_equal_recurrent():
    q, k, v, g, beta, state = make_inputs(5)
    want_out, want_state = recurrent(q, k, v, g, beta, state)
    outs = []
    for t in range(T):
        out, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(out)
    np.testing.assert_allclose(np.stack(outs, axis=1), want_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(state, want_state, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_then_steps_equal_recurrent():
    """A decode: a chunked prefill of 13 tokens, then 6 steps from its state."""
    q, k, v, g, beta, state = make_inputs(6)
    want_out, want_state = recurrent(q, k, v, g, beta, state)
    prompt = 13
    out, state = chunked(*(x[:, :prompt] for x in (q, k, v, g, beta)), state,
                         chunk_size=CHUNK)
    outs = [out]
    for t in range(prompt, T):
        out, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(out[:, None])
    np.testing.assert_allclose(np.concatenate(outs, axis=1), want_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(state, want_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_output_depends_only_on_the_past(form):
    """Changing every input after position t leaves the outputs up to t as they were."""
    run = recurrent if form == "recurrent" else lambda *a: chunked(*a, chunk_size=CHUNK)
    inputs = make_inputs(7)
    other = make_inputs(8)
    t = 10    # inside the second chunk
    mixed = [np.concatenate([x[:, :t + 1], y[:, t + 1:]], axis=1)
             for x, y in zip(inputs[:5], other[:5], strict=True)]
    out, _ = run(*inputs)
    mixed_out, _ = run(*mixed, inputs[5])
    np.testing.assert_array_equal(mixed_out[:, :t + 1], out[:, :t + 1])
    assert not np.allclose(mixed_out[:, t + 1:], out[:, t + 1:])


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_bfloat16_inputs_are_computed_in_float32(form):
    """bfloat16 inputs give bfloat16 outputs and a float32 state, the very numbers of the
    float32 computation on the same (bfloat16-rounded) values."""
    run = recurrent if form == "recurrent" else lambda *a: chunked(*a, chunk_size=CHUNK)
    inputs = [jnp.asarray(x, jnp.bfloat16) for x in make_inputs(19)]
    out, final = run(*inputs)
    want_out, want_state = run(*(x.astype(np.float32) for x in inputs))
    assert out.dtype == jnp.bfloat16 and final.dtype == np.float32
    np.testing.assert_array_equal(out, want_out.astype(jnp.bfloat16))
    np.testing.assert_array_equal(final, want_state)


# --- Padding ------------------------------------------------------------------------------

def padded_positions(length: int, seed: int = 9):
    """Inputs of `length` padded positions: zero q, k, v, and g = 0, beta = 0."""
    zero = [np.zeros_like(x[:, :length]) for x in make_inputs(seed)[:5]]
    return zero


@pytest.mark.parametrize("form", ["recurrent", "chunked", "step"])
def test_padded_positions_leave_the_state_unchanged(form):
    state = make_inputs(10)[5]
    padding = padded_positions(11)
    if form == "step":
        final = state
        for t in range(11):
            _, final = step(*(x[:, t] for x in padding), final)
    elif form == "recurrent":
        _, final = recurrent(*padding, state)
    else:
        _, final = chunked(*padding, state, chunk_size=CHUNK)
    np.testing.assert_array_equal(final, state)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_row_padded_at_its_end_keeps_its_unpadded_state(form):
    """A ragged batch: row 1 has 11 real tokens, padded to T; its outputs at real positions
    and its final state are those of the 11 tokens alone, and row 0 is untouched."""
    run = recurrent if form == "recurrent" else lambda *a: chunked(*a, chunk_size=CHUNK)
    *sequence, state = make_inputs(11)
    real = 11
    padded = [x.copy() for x in sequence]
    for x in padded:
        x[1, real:] = 0.0
    out, final = run(*padded, state)
    alone_out, alone_state = run(*(x[:, :real] for x in sequence), state)
    full_out, full_state = run(*sequence, state)
    np.testing.assert_allclose(out[1, :real], alone_out[1], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(final[1], alone_state[1], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(out[0], full_out[0], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(final[0], full_state[0], atol=1e-6, rtol=1e-6)


# --- The causal convolution ---------------------------------------------------------------

C, W = 7, 4


def conv_inputs(seed: int = 12, length: int = T):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, length, C)).astype(np.float32)
    weight = rng.normal(size=(C, W)).astype(np.float32)
    bias = rng.normal(size=(C,)).astype(np.float32)
    return x, weight, bias


@pytest.mark.parametrize("length", [2, T])
def test_causal_conv1d_matches_torch_conv_and_silu(length):
    """The layer's convolution: nn.Conv1d(groups=C, padding=W - 1), the first T outputs,
    then SiLU; the new window is the last W - 1 inputs (zeros before the first)."""
    torch = pytest.importorskip("torch")
    x, weight, bias = conv_inputs(13, length)
    layer = torch.nn.Conv1d(C, C, W, groups=C, padding=W - 1, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight)[:, None])
        layer.bias.copy_(torch.from_numpy(bias))
        want = torch.nn.functional.silu(layer(torch.from_numpy(x).transpose(1, 2))[..., :length])
    y, window = conv(x, weight, bias)
    np.testing.assert_allclose(y, want.transpose(1, 2).numpy(), atol=1e-6, rtol=1e-6)
    seen = np.concatenate([np.zeros((B, W - 1, C), np.float32), x], axis=1)
    np.testing.assert_array_equal(window, seen[:, -(W - 1):].swapaxes(1, 2))


def test_causal_conv1d_step_matches_transformers_update():
    """transformers' decoding update keeps W inputs, newest last, and reads all of them
    through the W taps; ours keeps the W - 1 the next step reads. Same outputs, and our
    window is its state without the oldest input."""
    import torch
    reference = transformers_module()
    x, weight, bias = conv_inputs(14)
    window = np.random.default_rng(15).normal(size=(B, C, W - 1)).astype(np.float32)
    oldest = np.full((B, C, 1), 123.0, np.float32)    # never read
    torch_state = torch.from_numpy(np.concatenate([oldest, window], axis=-1))
    want = reference.causal_conv1d_update(
        torch.from_numpy(x[:, 0, :, None]), torch_state, torch.from_numpy(weight),
        torch.from_numpy(bias), "silu")
    y, new_window = conv_step(x[:, 0], weight, bias, window)
    np.testing.assert_allclose(y, want[..., 0].numpy(), atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(new_window, torch_state[..., 1:].numpy())


def test_causal_conv1d_steps_and_pieces_equal_whole_sequence():
    x, weight, bias = conv_inputs(16)
    want, want_window = conv(x, weight, bias)
    y, window = conv(x[:, :5], weight, bias)
    ys = [y]
    for t in range(5, 12):
        y, window = conv_step(x[:, t], weight, bias, window)
        ys.append(y[:, None])
    y, window = conv(x[:, 12:], weight, bias, window)     # a later chunk of a prefill
    ys.append(y)
    np.testing.assert_allclose(np.concatenate(ys, axis=1), want, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(window, want_window)


def test_causal_conv1d_output_depends_only_on_the_past():
    x, weight, bias = conv_inputs(17)
    want, _ = conv(x, weight, bias)
    for t in (0, 5, T - 2):
        changed = x.copy()
        changed[:, t + 1:] += 10.0
        y, _ = conv(changed, weight, bias)
        np.testing.assert_array_equal(y[:, :t + 1], want[:, :t + 1])
        assert not np.allclose(y[:, t + 1], want[:, t + 1])


# --- Packed rows --------------------------------------------------------------------------

# Row 0: sequences of 3, 5, 10 and 1 tokens (id 0 is padding, a sequence like any other);
# row 1: ids that repeat once apart (only changes between neighbours start a sequence).
# With chunks of 4, sequences start inside chunks, at their edges, and span several.
SEGMENTS = np.asarray([[1] * 3 + [2] * 5 + [3] * 10 + [0],
                       [4] * 8 + [9] * 4 + [4] * 7])


def _pieces(row):
    """(start, end) of each sequence of a row of SEGMENTS."""
    starts = [0] + [t for t in range(1, T) if row[t] != row[t - 1]] + [T]
    return list(zip(starts, starts[1:], strict=False))


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_a_packed_row_gives_each_sequence_what_it_gives_alone(form):
    """Outputs of every sequence as run alone from a zero state, and the final state the
    last sequence's alone; with a state given, the row's first sequence continues it; and
    the gradients through the packed row are the pieces'."""
    q, k, v, g, beta, state = make_inputs(21)
    run = (jax.jit(lambda *a, s=None: delta_rule.chunked(*a, chunk_size=4, segment_ids=s))
           if form == "chunked" else jax.jit(
               lambda *a, s=None: delta_rule.recurrent(*a, segment_ids=s)))
    for start in (None, state):
        out, final = run(q, k, v, g, beta, start, s=SEGMENTS)
        for b in range(B):
            for i, (lo, hi) in enumerate(_pieces(SEGMENTS[b])):
                first = start[b:b + 1] if start is not None and i == 0 else None
                want, want_final = recurrent(*(x[b:b + 1, lo:hi] for x in (q, k, v, g, beta)),
                                             first)
                np.testing.assert_allclose(out[b:b + 1, lo:hi], want, atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(final[b:b + 1], want_final, atol=1e-5, rtol=1e-5)

    def packed_loss(q, k, v):
        return (run(q, k, v, g, beta, None, s=SEGMENTS)[0] ** 2).sum()

    def pieces_loss(q, k, v):
        return sum((recurrent(*(x[b:b + 1, lo:hi] for x in (q, k, v, g, beta)))[0] ** 2).sum()
                   for b in range(B) for lo, hi in _pieces(SEGMENTS[b]))
    got, want = jax.grad(packed_loss, (0, 1, 2))(q, k, v), jax.grad(pieces_loss, (0, 1, 2))(q, k, v)
    for x, w in zip(got, want, strict=True):
        assert np.all(np.isfinite(x))
        np.testing.assert_allclose(x, w, atol=1e-5, rtol=1e-5)


def test_causal_conv1d_of_a_packed_row_reads_no_earlier_sequence():
    """Each sequence's outputs as alone (from zeros), and the window the last sequence's
    inputs only: row 0 ends with a sequence of one token, so two of its three are zeros."""
    x, weight, bias = conv_inputs()
    y, window = delta_rule.causal_conv1d(x, weight, bias, segment_ids=SEGMENTS)
    for b in range(B):
        for lo, hi in _pieces(SEGMENTS[b]):
            want, want_window = delta_rule.causal_conv1d(x[b:b + 1, lo:hi], weight, bias)
            np.testing.assert_allclose(y[b:b + 1, lo:hi], want, atol=1e-6)
        np.testing.assert_allclose(window[b:b + 1], want_window, atol=0)
    assert np.all(np.asarray(window[0, :, :2]) == 0)
    with pytest.raises(ValueError, match=r"segment_ids \(packed rows\) or lengths"):
        delta_rule.causal_conv1d(x, weight, bias, segment_ids=SEGMENTS,
                                 lengths=np.full((B,), T, np.int32))
    with pytest.raises(ValueError, match=r"segment_ids has shape \(2, 18\), expected"):
        delta_rule.causal_conv1d(x, weight, bias, segment_ids=SEGMENTS[:, 1:])


# --- Bad input ----------------------------------------------------------------------------

def call_with(form: str, **changes):
    """Calls `form` on good inputs with some replaced."""
    q, k, v, g, beta, state = make_inputs(18)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, state=state)
    if form == "step":
        args = {name: x[:, 0] if name != "state" else x for name, x in args.items()}
    args.update(changes)
    return getattr(delta_rule, form)(**args)


@pytest.mark.parametrize("form, changes, message", [
    ("recurrent", dict(v=np.zeros((B, T, 3, E), np.float32)),
     r"num_v_heads=3 .* multiple of num_k_heads=2"),
    ("chunked", dict(v=np.zeros((B, T, 3, E), np.float32)),
     r"num_v_heads=3 .* multiple of num_k_heads=2"),
    ("recurrent", dict(k=np.zeros((B, T, K, H + 1), np.float32)), r"k has shape \(2, 19, 2, 7\)"),
    ("recurrent", dict(v=np.zeros((B, T + 1, N, E), np.float32)), r"v has shape \(2, 20, 4, 5\)"),
    ("chunked", dict(g=np.zeros((B, T, K), np.float32)), r"g has shape \(2, 19, 2\)"),
    ("recurrent", dict(beta=np.zeros((B, T), np.float32)), r"beta must be \[B, T, N\]"),
    ("chunked", dict(state=np.zeros((B, N, E, H), np.float32)),
     r"state has shape \(2, 4, 5, 6\), expected \[B, N, H, E\] = \(2, 4, 6, 5\)"),
    ("chunked", dict(chunk_size=0), r"chunk_size=0 must be a positive int"),
    ("step", dict(state=None), r"step needs a state"),
    ("step", dict(q=np.zeros((B, T, K, H), np.float32)), r"q must be \[B, K, H\]"),
    ("step", dict(v=np.zeros((B, 3, E), np.float32)), r"num_v_heads=3"),
])
def test_bad_delta_rule_input_is_named(form, changes, message):
    with pytest.raises(ValueError, match=message):
        call_with(form, **changes)


@pytest.mark.parametrize("changes, message", [
    (dict(weight=np.zeros((C + 1, W), np.float32)), r"weight has shape \(8, 4\).*C=7"),
    (dict(bias=np.zeros((C + 1,), np.float32)), r"bias has shape \(8,\)"),
    (dict(window=np.zeros((B, C, W), np.float32)),
     r"window has shape \(2, 7, 4\), expected \[B, C, W - 1\] = \(2, 7, 3\)"),
    (dict(x=np.zeros((B, C), np.float32)), r"x must be \[B, T, C\]"),
])
def test_bad_convolution_input_is_named(changes, message):
    x, weight, bias = conv_inputs()
    args = dict(x=x, weight=weight, bias=bias, window=None) | changes
    with pytest.raises(ValueError, match=message):
        delta_rule.causal_conv1d(**args)


def test_bad_decay_input_is_named():
    a = np.zeros((B, T, N), np.float32)
    with pytest.raises(ValueError, match=r"A_log has shape \(3,\), expected \[N\] = \(4,\)"):
        delta_rule.decay_and_beta(a, a, np.zeros(3, np.float32), np.zeros(N, np.float32))
    with pytest.raises(ValueError, match=r"b has shape \(2, 19, 3\)"):
        delta_rule.decay_and_beta(a, a[..., :3], np.zeros(N, np.float32),
                                  np.zeros(N, np.float32))
