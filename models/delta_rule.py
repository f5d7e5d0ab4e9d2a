"""The gated delta rule: the linear-attention recurrence of Qwen3-Next's Gated DeltaNet layers.

Each value head n keeps a state S [H, E], a fast-weight memory that maps keys to values.
For each token t, with query q_t and key k_t [H], value v_t [E], log-decay g_t <= 0 and
write strength beta_t in (0, 1):

    S     <- exp(g_t) * S                   forget a little of everything
    delta  = beta_t * (v_t - k_t^T S)       the part of v_t that S does not yet predict
    S     <- S + k_t delta^T                write only that correction (the delta rule)
    o_t    = q_t^T S

Queries are scaled by H^-1/2 and, with `qk_l2norm` (Qwen3-Next's setting), queries and
keys are first L2-normalised as x * rsqrt(sum(x * x) + 1e-6). All of it is computed in
float32 whatever the inputs' dtype; outputs come back in the query's dtype, states are
float32.

Dimensions (einsum letters): B batch, T time steps, K query/key heads, N value heads,
G = N // K value heads per key head, H query/key head width (d_k), E value head width
(d_v), M chunks, I and J positions inside a chunk (I reads, J wrote), C convolution
channels, W convolution width. Each query/key head serves G *consecutive* value heads
(value heads kG .. kG + G - 1 read key head k: a repeat, as transformers'
`repeat_interleave`, not a tile).

Three forms compute the same numbers (to float32 rounding):

    recurrent  a `lax.scan` over tokens: the reference, and short prefills. Training
               through it stores the state at every step for the backward pass:
               T * B * N * H * E floats.
    chunked    chunks of `chunk_size` tokens solved in parallel (the WY/UT form below),
               a `lax.scan` over chunks carrying the state: training and long prefills.
               It stores one state per chunk plus the chunks' [L, L] matrices:
               (T / L) * B * N * H * E + T * L * B * N floats, for chunk size L.
    step       one token, for the cached decoding step: reads and writes one state.

The chunked form. Inside a chunk that starts from state S0, with c_t the cumulative sum
of g up to and including t, unrolling the recurrence gives

    S_t  = e^{c_t} S0 + sum_{j <= t} e^{c_t - c_j} k_j delta_j^T
    delta_t + beta_t sum_{j < t} e^{c_t - c_j} (k_t . k_j) delta_j
         = beta_t v_t - beta_t e^{c_t} k_t^T S0

so the deltas of a chunk solve one unit lower-triangular system (I + A) Delta = ...;
its solution splits into U - W S0, where U = (I + A)^-1 diag(beta) V and
W = (I + A)^-1 diag(beta e^c) K do not depend on S0 and are solved for all chunks at
once. The scan over chunks is then matrix products only:

    Delta  = U - W S0
    O      = (e^c * Q) S0 + (causal(Q K^T * e^{c_i - c_j})) Delta
    S_next = e^{c_L} S0 + (e^{c_L - c} * K)^T Delta

Decays enter as differences c_i - c_j (never as a ratio of two exponentials that could
underflow), masked to -inf above the diagonal before the exponential, so no inf reaches
the gradient.

The decode state of one layer is `state` [B, N, H, E] float32 plus the convolution
window [B, C, W - 1] (the last W - 1 inputs of `causal_conv1d`, in the inputs' dtype).
Neither depends on T: this is why a Qwen3-Next decode state does not grow with the
sequence, where an attention layer's KV cache does.

Padding: a caller that pads a ragged batch sets g = 0 and beta = 0 at the padded
positions (and zero q, k, v). Then exp(g) = 1 and delta = 0 there, so the state comes out
of a padded position exactly as it went in, and a row padded at its end ends with its
unpadded final state. `chunked` pads T up to a multiple of `chunk_size` the same way.

Packed rows: given `segment_ids` [B, T], a token whose id differs from the token's before
it starts a new sequence, whose state starts from zeros (the state is reset before the
token is read), and the convolution reads no input of an earlier sequence. In the chunked
form a reset inside a chunk drops S0's terms (e^c S0) from the positions after it and
masks the decays between positions of different sequences to 0, so no sequence sees
another's tokens and no decay spans two sequences. Ids need not be increasing; only
changes between neighbours count, so the first token never resets a given state.

The causal depthwise convolution before the rule (Qwen3-Next runs q, k and v, joined on
the channel axis, through it): weight [C, W] is transformers' `conv1d.weight` [C, 1, W]
squeezed. Output t is SiLU(bias + sum_j weight[:, j] * x[t - (W - 1) + j]): the last tap
multiplies the current input, and inputs before the first token are the window's (zeros
when there is none). The window keeps the newest input at its end (index W - 2), as
transformers' conv state does (transformers keeps W inputs; the oldest is never read).

    x = [x0, x1, x2], W = 4, window None  ->  y2 = silu(w0*0 + w1*x0 + w2*x1 + w3*x2 + b)
                                              new window = [x0, x1, x2]
    then causal_conv1d_step(x3, ...)      ->  y3 = silu(w0*x0 + w1*x1 + w2*x2 + w3*x3 + b)
                                              new window = [x1, x2, x3]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import solve_triangular
from jaxtyping import Array, Float

from models.errors import UserError

L2NORM_EPS = 1e-6


# --- Argument checks ----------------------------------------------------------------------

def _shape_of(x) -> tuple:
    return tuple(getattr(x, "shape", ()))


def _check_rank(x, name: str, rank: int, doc: str) -> None:
    if not hasattr(x, "ndim") or x.ndim != rank:
        raise UserError(f"{name} must be {doc} (rank {rank}), got shape {_shape_of(x)}")


def _check_shape(x, name: str, expected: tuple, doc: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise UserError(f"{name} has shape {tuple(x.shape)}, expected {doc} = {tuple(expected)}")


def _check_inputs(q, k, v, g, beta, state, *, per_token: bool) -> None:
    """Checks the shapes of one call's arrays: with `per_token` they have a time axis
    ([B, T, ...]), without it they are one token's ([B, ...]; `step`)."""
    lead = "B, T, " if per_token else "B, "
    extra = 1 if per_token else 0
    _check_rank(q, "q", 3 + extra, f"[{lead}K, H]")
    _check_rank(v, "v", 3 + extra, f"[{lead}N, E]")
    _check_shape(k, "k", q.shape, f"q's shape [{lead}K, H]")
    *outer, num_k_heads, key_width = q.shape
    if tuple(v.shape[:-2]) != tuple(outer):
        raise UserError(f"v has shape {tuple(v.shape)}, but q has shape {tuple(q.shape)}: "
                        f"their leading [{lead.rstrip(', ')}] dimensions must agree")
    num_v_heads, value_width = v.shape[-2:]
    if num_k_heads < 1 or num_v_heads % num_k_heads:
        raise UserError(f"num_v_heads={num_v_heads} (v's heads) must be a positive multiple "
                        f"of num_k_heads={num_k_heads} (q's and k's heads)")
    for name, x in (("g", g), ("beta", beta)):
        _check_rank(x, name, 2 + extra, f"[{lead}N]")
        _check_shape(x, name, (*outer, num_v_heads), f"[{lead}N]")
    if state is not None:
        _check_rank(state, "state", 4, "[B, N, H, E]")
        _check_shape(state, "state", (outer[0], num_v_heads, key_width, value_width),
                     "[B, N, H, E]")


# --- Shared pieces ------------------------------------------------------------------------

def l2_normalize(x: Float[Array, "... H"]) -> Float[Array, "... H"]:
    """x * rsqrt(sum(x * x) + 1e-6) over the last axis (the FLA library's and
    transformers' `l2norm`: the epsilon is inside the root, so a zero vector stays zero)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _prepare(q, k, v, g, beta, *, qk_l2norm: bool, head_axis: int):
    """float32 copies of the inputs, with q and k repeated to one head per value head
    (head k serves value heads kG .. kG + G - 1), optionally L2-normalised, and q scaled
    by H^-1/2."""
    group = v.shape[head_axis] // q.shape[head_axis]
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    q = jnp.repeat(q, group, axis=head_axis)
    k = jnp.repeat(k, group, axis=head_axis)
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _segment_counts(segment_ids, shape) -> jax.Array | None:
    """int32[B, T]: how many sequences have started before or at each token of a packed
    row (a start: an id that differs from the token's before; the first token is none), or
    None without `segment_ids`. Two tokens are of one sequence when their counts agree."""
    if segment_ids is None:
        return None
    _check_rank(segment_ids, "segment_ids", 2, "[B, T]")
    _check_shape(segment_ids, "segment_ids", shape, "[B, T] of q")
    starts_BT = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1], dtype=bool),
                                 segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jnp.cumsum(starts_BT, axis=1, dtype=jnp.int32)


def _initial_state(state, q, v) -> Float[Array, "B N H E"]:
    if state is not None:
        return state.astype(jnp.float32)
    batch, num_v_heads, value_width = v.shape[0], v.shape[-2], v.shape[-1]
    return jnp.zeros((batch, num_v_heads, q.shape[-1], value_width), jnp.float32)


def _token_update(state_BNHE, q_BNH, k_BNH, v_BNE, g_BN, beta_BN):
    """One token of the rule on prepared (float32, repeated, scaled) inputs:
    (new state, output)."""
    state_BNHE = state_BNHE * jnp.exp(g_BN)[:, :, None, None]
    predicted_BNE = jnp.einsum("BNH,BNHE->BNE", k_BNH, state_BNHE)
    delta_BNE = beta_BN[:, :, None] * (v_BNE - predicted_BNE)
    state_BNHE = state_BNHE + jnp.einsum("BNH,BNE->BNHE", k_BNH, delta_BNE)
    return state_BNHE, jnp.einsum("BNH,BNHE->BNE", q_BNH, state_BNHE)


# --- The three forms ------------------------------------------------------------------------

def recurrent(q: Float[Array, "B T K H"], k: Float[Array, "B T K H"],
              v: Float[Array, "B T N E"], g: Float[Array, "B T N"],
              beta: Float[Array, "B T N"], state: Float[Array, "B N H E"] | None = None, *,
              qk_l2norm: bool = True, segment_ids=None,
              ) -> tuple[Float[Array, "B T N E"], Float[Array, "B N H E"]]:
    """The gated delta rule token by token (a `lax.scan` over T): the reference form.

    Args:
      q, k: queries and keys [B, T, K, H].
      v: values [B, T, N, E], N a multiple of K.
      g: log-decays [B, T, N], <= 0 (0 at padded positions).
      beta: write strengths [B, T, N] in (0, 1) (0 at padded positions).
      state: the state before the first token [B, N, H, E]; None means zeros.
      qk_l2norm: L2-normalise q and k first (Qwen3-Next does).
      segment_ids: None, or int[B, T] packed rows' sequence ids: the state restarts from
        zeros at each sequence's first token (module docstring).

    Returns:
      (outputs [B, T, N, E] in q's dtype, the state after the last token [B, N, H, E]
      float32).
    """
    _check_inputs(q, k, v, g, beta, state, per_token=True)
    counts_BT = _segment_counts(segment_ids, q.shape[:2])
    start = _initial_state(state, q, v)
    prepared = _prepare(q, k, v, g, beta, qk_l2norm=qk_l2norm, head_axis=2)
    if counts_BT is None:
        keep_BT = jnp.ones(q.shape[:2], jnp.float32)
    else:                               # 0 at a sequence's first token: the state restarts
        keep_BT = jnp.concatenate([jnp.ones_like(counts_BT[:, :1]),
                                   (counts_BT[:, 1:] == counts_BT[:, :-1])], axis=1)
    time_major = tuple(jnp.moveaxis(x, 1, 0) for x in (*prepared, keep_BT.astype(jnp.float32)))

    def token(state_BNHE, xs):
        *inputs, keep_B = xs
        return _token_update(state_BNHE * keep_B[:, None, None, None], *inputs)
    final, out_TBNE = lax.scan(token, start, time_major)
    return jnp.moveaxis(out_TBNE, 0, 1).astype(q.dtype), final


def step(q: Float[Array, "B K H"], k: Float[Array, "B K H"], v: Float[Array, "B N E"],
         g: Float[Array, "B N"], beta: Float[Array, "B N"], state: Float[Array, "B N H E"], *,
         qk_l2norm: bool = True) -> tuple[Float[Array, "B N E"], Float[Array, "B N H E"]]:
    """One token of the gated delta rule: the cached decoding step. Arguments are
    `recurrent`'s without the T axis, and the state is required.

    Returns:
      (output [B, N, E] in q's dtype, the new state [B, N, H, E] float32).
    """
    if state is None:
        raise UserError("step needs a state [B, N, H, E] (zeros before the first token)")
    _check_inputs(q, k, v, g, beta, state, per_token=False)
    prepared = _prepare(q, k, v, g, beta, qk_l2norm=qk_l2norm, head_axis=1)
    new_state, out_BNE = _token_update(state.astype(jnp.float32), *prepared)
    return out_BNE.astype(q.dtype), new_state


def chunked(q: Float[Array, "B T K H"], k: Float[Array, "B T K H"],
            v: Float[Array, "B T N E"], g: Float[Array, "B T N"],
            beta: Float[Array, "B T N"], state: Float[Array, "B N H E"] | None = None, *,
            chunk_size: int = 64, qk_l2norm: bool = True, segment_ids=None,
            ) -> tuple[Float[Array, "B T N E"], Float[Array, "B N H E"]]:
    """The gated delta rule chunk by chunk (the module docstring's WY/UT form): `recurrent`'s
    arguments and results, to float32 rounding, with T padded up to a multiple of
    `chunk_size` by positions that change nothing (g = 0, beta = 0, zero inputs).

    Args:
      chunk_size: L, the tokens solved together; each chunk costs [L, L] matrices per head
        and the scan runs ceil(T / L) steps.
      segment_ids: `recurrent`'s: packed rows, each sequence from a zero state.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise UserError(f"chunk_size={chunk_size!r} must be a positive int")
    _check_inputs(q, k, v, g, beta, state, per_token=True)
    counts_BT = _segment_counts(segment_ids, q.shape[:2])
    start = _initial_state(state, q, v)
    out_dtype, length = q.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, qk_l2norm=qk_l2norm, head_axis=2)
    pad = -length % chunk_size

    def to_chunks(x, mode="constant"):
        """[B, T, N, ...] -> [M, B, N, L, ...], padded at the end of T (zeros)."""
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode=mode)
        x = x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 3))

    q_MBNIH, k_MBNIH, v_MBNIE = to_chunks(q), to_chunks(k), to_chunks(v)
    g_MBNI, beta_MBNI = to_chunks(g), to_chunks(beta)

    # Decays within a chunk, from cumulative log-decays: decay_IJ = e^{c_i - c_j} for j <= i;
    # S0 (the state before the chunk) reaches token i decayed by e^{c_i}, the next chunk by
    # e^{c_L}.
    cum_MBNI = jnp.cumsum(g_MBNI, axis=-1)
    seen_MBNIJ = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    from_start_MBNI, last_MBN = jnp.exp(cum_MBNI), cum_MBNI[..., -1]
    if counts_BT is not None:
        # Packed rows: i sees j of its own sequence only, and S0 reaches only the tokens
        # before the chunk's first restart (and the next chunk only without one).
        counts_BTN = jnp.broadcast_to(counts_BT[:, :, None], g.shape)
        counts_MBNI = to_chunks(counts_BTN, mode="edge")      # padding: the last's
        seen_MBNIJ = seen_MBNIJ[None, None, None] & (
            counts_MBNI[..., :, None] == counts_MBNI[..., None, :])
        before_MBN = jnp.concatenate([counts_BTN[:, :1], counts_BTN], axis=1)[
            :, ::chunk_size][:, :counts_MBNI.shape[0]]        # the count before each chunk
        carries_MBNI = counts_MBNI == jnp.moveaxis(before_MBN, 1, 0)[..., None]
        from_start_MBNI = jnp.where(carries_MBNI, from_start_MBNI, 0.0)
        last_MBN = jnp.where(carries_MBNI[..., -1], last_MBN, -jnp.inf)
    gap_MBNIJ = cum_MBNI[..., :, None] - cum_MBNI[..., None, :]
    decay_MBNIJ = jnp.exp(jnp.where(seen_MBNIJ, gap_MBNIJ, -jnp.inf))

    # The unit lower-triangular system (I + A) X = [beta V, beta e^c K], solved for every
    # chunk at once: X = [U, W] (module docstring).
    kk_MBNIJ = jnp.einsum("MBNIH,MBNJH->MBNIJ", k_MBNIH, k_MBNIH)
    # A is strictly lower-triangular; with `unit_diagonal` the solver reads only that part
    # and takes the diagonal as ones, so passing A solves with I + A.
    a_MBNIJ = beta_MBNI[..., :, None] * jnp.tril(kk_MBNIJ * decay_MBNIJ, -1)
    right = jnp.concatenate([beta_MBNI[..., None] * v_MBNIE,
                             (beta_MBNI * from_start_MBNI)[..., None] * k_MBNIH], axis=-1)
    solved = solve_triangular(a_MBNIJ, right, lower=True, unit_diagonal=True)
    value_width = v_MBNIE.shape[-1]
    u_MBNIE, w_MBNIH = solved[..., :value_width], solved[..., value_width:]

    # What the scan needs besides U and W, none of which depends on the state.
    q_decayed_MBNIH = from_start_MBNI[..., None] * q_MBNIH
    attn_MBNIJ = jnp.einsum("MBNIH,MBNJH->MBNIJ", q_MBNIH, k_MBNIH) * decay_MBNIJ
    # The chunk's last row of the decays: e^{c_L - c_j} from j of the last sequence, else 0.
    k_to_end_MBNIH = decay_MBNIJ[..., -1, :, None] * k_MBNIH

    def chunk_update(state_BNHE, xs):
        u, w, q_decayed, attn, k_to_end, last = xs
        delta_BNIE = u - jnp.einsum("BNIH,BNHE->BNIE", w, state_BNHE)
        out_BNIE = (jnp.einsum("BNIH,BNHE->BNIE", q_decayed, state_BNHE)
                    + jnp.einsum("BNIJ,BNJE->BNIE", attn, delta_BNIE))
        state_BNHE = (jnp.exp(last)[:, :, None, None] * state_BNHE
                      + jnp.einsum("BNJH,BNJE->BNHE", k_to_end, delta_BNIE))
        return state_BNHE, out_BNIE

    final, out_MBNIE = lax.scan(
        chunk_update, start,
        (u_MBNIE, w_MBNIH, q_decayed_MBNIH, attn_MBNIJ, k_to_end_MBNIH, last_MBN))
    batch, num_v_heads = out_MBNIE.shape[1:3]
    out_BTNE = jnp.moveaxis(out_MBNIE, (0, 3), (1, 2)).reshape(
        batch, -1, num_v_heads, value_width)
    return out_BTNE[:, :length].astype(out_dtype), final


# --- Decay and write strength from the layer's projections ---------------------------------

def decay_and_beta(a: Float[Array, "... N"], b: Float[Array, "... N"],
                   A_log: Float[Array, " N"],
                   dt_bias: Float[Array, " N"]) -> tuple[Float[Array, "... N"],
                                                         Float[Array, "... N"]]:
    """Qwen3-Next's log-decay g = -exp(A_log) * softplus(a + dt_bias) and write strength
    beta = sigmoid(b), both float32, from the layer's per-token projections a and b
    [..., N] and its per-head parameters A_log and dt_bias [N]."""
    num_v_heads = a.shape[-1]
    if tuple(b.shape) != tuple(a.shape):
        raise UserError(f"b has shape {tuple(b.shape)}, but a has shape {tuple(a.shape)}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if tuple(x.shape) != (num_v_heads,):
            raise UserError(f"{name} has shape {tuple(x.shape)}, expected [N] = "
                            f"({num_v_heads},) (a's last axis)")
    per_head = (1,) * (a.ndim - 1) + (num_v_heads,)
    rate = jnp.exp(A_log.astype(jnp.float32)).reshape(per_head)
    shift = dt_bias.astype(jnp.float32).reshape(per_head)
    g = -rate * jax.nn.softplus(a.astype(jnp.float32) + shift)
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


# --- The causal depthwise convolution before the rule --------------------------------------

def _check_conv(x, weight, bias, window, *, per_token: bool) -> None:
    doc = "[B, T, C]" if per_token else "[B, C]"
    _check_rank(x, "x", 3 if per_token else 2, doc)
    _check_rank(weight, "weight", 2, "[C, W]")
    channels, width = weight.shape
    if x.shape[-1] != channels or width < 1:
        raise UserError(f"weight has shape {tuple(weight.shape)}, expected [C, W] with "
                        f"C={x.shape[-1]} (x's channels) and W >= 1")
    if bias is not None:
        _check_rank(bias, "bias", 1, "[C]")
        _check_shape(bias, "bias", (channels,), "[C]")
    if window is not None:
        _check_rank(window, "window", 3, "[B, C, W - 1]")
        _check_shape(window, "window", (x.shape[0], channels, width - 1), "[B, C, W - 1]")


def causal_conv1d(x: Float[Array, "B T C"], weight: Float[Array, "C W"],
                  bias: Float[Array, " C"] | None = None,
                  window: Float[Array, "B C W-1"] | None = None,
                  lengths=None, segment_ids=None,
                  ) -> tuple[Float[Array, "B T C"], Float[Array, "B C W-1"]]:
    """The causal depthwise convolution of width W, then SiLU (module docstring).

    Args:
      x: inputs [B, T, C].
      weight: [C, W]: transformers' `conv1d.weight` [C, 1, W] squeezed.
      bias: [C] or None.
      window: the W - 1 inputs before x[:, 0], newest last [B, C, W - 1]; None means zeros
        (the start of a sequence).
      lengths: None, or int[B]: each row's real inputs of x (the rest right padding), so
        that its window ends before its padding.
      segment_ids: None, or int[B, T] packed rows' sequence ids (module docstring): an
        output reads no input of an earlier sequence, and the returned window holds only
        the last sequence's inputs (zeros before them).

    Returns:
      (outputs [B, T, C] in x's dtype, the last W - 1 inputs [B, C, W - 1], newest last: the
      window of the next call or `causal_conv1d_step`).
    """
    _check_conv(x, weight, bias, window, per_token=True)
    batch, length, channels = x.shape
    width = weight.shape[1]
    if segment_ids is not None and lengths is not None:
        raise UserError("causal_conv1d takes segment_ids (packed rows) or lengths (right-"
                        "padded rows whose window continues), not both")
    counts_BT = _segment_counts(segment_ids, (batch, length))
    if window is None:
        window = jnp.zeros((batch, channels, width - 1), x.dtype)
    # S = W - 1 + T: the window, then x.
    inputs_BSC = jnp.concatenate([jnp.swapaxes(window, 1, 2).astype(x.dtype), x], axis=1)
    seen_BSC = inputs_BSC.astype(jnp.float32)
    taps_11CW = weight.astype(jnp.float32)[None, None]
    taps = [True] * width                     # which inputs each tap reads, per output
    if counts_BT is not None:                 # the window's inputs are x[0]'s sequence's
        counts_BS = jnp.pad(counts_BT, ((0, 0), (width - 1, 0)))
        taps = [(counts_BS[:, j:j + length] == counts_BT)[..., None] for j in range(width)]
    # Tap j multiplies the input W - 1 - j positions back: x[t - (W - 1) + j].
    y_BTC = sum(taps_11CW[..., j] * jnp.where(taps[j], seen_BSC[:, j:j + length], 0.0)
                for j in range(width))
    if bias is not None:
        y_BTC = y_BTC + bias.astype(jnp.float32)[None, None]
    if lengths is None:
        new_window = inputs_BSC[:, inputs_BSC.shape[1] - (width - 1):]
        if counts_BT is not None:             # only the last sequence's inputs
            last_BS = counts_BS[:, counts_BS.shape[1] - (width - 1):] == counts_BT[:, -1:]
            new_window = jnp.where(last_BS[..., None], new_window, 0)
    else:                 # row b's inputs before x[b, lengths[b]] end at index W - 2 + lengths[b]
        new_window = jax.vmap(lambda seen, n: lax.dynamic_slice_in_dim(seen, n, width - 1))(
            inputs_BSC, lengths)
    return jax.nn.silu(y_BTC).astype(x.dtype), jnp.swapaxes(new_window, 1, 2)


def causal_conv1d_step(x: Float[Array, "B C"], weight: Float[Array, "C W"],
                       bias: Float[Array, " C"] | None,
                       window: Float[Array, "B C W-1"],
                       ) -> tuple[Float[Array, "B C"], Float[Array, "B C W-1"]]:
    """One token of `causal_conv1d`, for the decoding step: (output [B, C], the window
    moved on by one: its oldest input dropped, x appended)."""
    if window is None:
        raise UserError("causal_conv1d_step needs a window [B, C, W - 1] (zeros at the start)")
    _check_conv(x, weight, bias, window, per_token=False)
    y, new_window = causal_conv1d(x[:, None], weight, bias, window)
    return y[:, 0], new_window
