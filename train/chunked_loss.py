"""The token loss without a [T, V] array: the head and the cross-entropy slice by slice.

The plain loss makes the logits of every position (`[B, T, V]` float32), and its gradient
keeps them, their softmax and their cotangent: at V 32k and T 4096 that is 0.5 GB per row
of the batch for each, more than the rest of a long-sequence gradient. Here the last hidden
states `x_BTD` go in instead, and the loss is computed over `chunks` slices of the sequence,
`[B, C, D] -> [B, C, V]` one at a time in a `lax.scan`, inside a `jax.custom_vjp` whose
backward pass computes each slice's logits again (as MaxText's vocabulary tiling does): what
either pass holds is one slice's `[B, C, V]`, never the whole.

    sums = chunked_cross_entropy(head_fn, head_params, x_BTD, targets_BT, weights_BT,
                                 chunks=8, label_smoothing=0.1, z_loss=1e-4)
    sums = model_loss(model, params, x_BTD, targets_BT, weights_BT, chunks=8)  # a model's head

The sums are `train.losses.cross_entropy`'s (`loss`, `nll`, `z_loss`, `correct`, `weight`),
equal to the plain loss's, and so are the gradients with respect to the head's parameters,
the hidden states and the weights: each slice is the plain loss of its positions, and the
backward pass is that function's own VJP, slice by slice.

Slices are along T (every slice keeps all B rows, so a batch split over devices stays
split): C = ceil(T / chunks), and the sequence is padded to a whole number of slices with
positions of weight 0 (they add nothing to a sum or a gradient).

    T = 10, chunks = 4  ->  C = 3, slices [0:3] [3:6] [6:9] [9:10 + 2 padded positions]
    T = 10, chunks = 16 ->  C = 1, 10 slices (never a slice of padding alone)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from models.errors import UserError, is_int
from train import losses

HeadFn = Callable[[dict, Float[Array, "B C D"]], Float[Array, "B C V"]]


def slices(T: int, chunks: int) -> tuple[int, int]:
    """(slice length C, number of slices) for a sequence of T positions in at most
    `chunks` slices (see the module docstring)."""
    C = -(-T // chunks)
    return C, -(-T // C)


def chunked_cross_entropy(head_fn: HeadFn, head_params, x_BTD: Float[Array, "B T D"],
                          targets_BT: Int[Array, "B T"], weights_BT: Float[Array, "B T"], *,
                          chunks: int, label_smoothing: float = 0.0,
                          z_loss: float = 0.0) -> dict[str, jax.Array]:
    """`losses.cross_entropy(head_fn(head_params, x_BTD), ...)` in slices of the sequence.

    Args:
        head_fn: the head, `(head_params, x_BCD) -> float32 logits_BCV`, a pure function
            of its arguments (it may close over no traced value).
        head_params: the head's parameters (a pytree; they get gradients).
        chunks: how many slices (at most; see `slices`), a positive int.
        label_smoothing, z_loss: as `losses.cross_entropy`'s.

    Returns:
        `losses.cross_entropy`'s sums.

    Raises:
        UserError: `chunks` is not a positive int, or the shapes differ.
    """
    if not is_int(chunks) or chunks < 1:
        raise UserError(f"chunks={chunks!r} must be an int >= 1 (the number of slices of "
                        "the sequence the loss is computed in)")
    if x_BTD.ndim != 3 or targets_BT.shape != x_BTD.shape[:2] or \
            weights_BT.shape != targets_BT.shape:
        raise UserError(f"hidden states {x_BTD.shape} must be [B, T, D] over targets "
                        f"{targets_BT.shape} and weights {weights_BT.shape} of shape [B, T]")
    fn = _tiled(head_fn, int(chunks), float(label_smoothing), float(z_loss))
    return fn(head_params, x_BTD, targets_BT, weights_BT.astype(jnp.float32))


def token_sums(model, params, out, targets_BT, weights_BT, *, chunks: int,
               label_smoothing: float = 0.0, z_loss: float = 0.0) -> dict[str, jax.Array]:
    """An objective's token loss of `out`: with `chunks` 0 the logits `[B, T, V]`
    (`losses.cross_entropy`), else the last hidden states `[B, T, D]`, which the model's
    head scores in `chunks` slices (`model_loss`)."""
    if chunks:
        return model_loss(model, params, out, targets_BT, weights_BT, chunks=chunks,
                          label_smoothing=label_smoothing, z_loss=z_loss)
    return losses.cross_entropy(out, targets_BT, weights_BT,
                                label_smoothing=label_smoothing, z_loss=z_loss)


def model_loss(model, params, x_BTD, targets_BT, weights_BT, *, chunks: int,
               label_smoothing: float = 0.0, z_loss: float = 0.0) -> dict[str, jax.Array]:
    """`chunked_cross_entropy` through a model's own head: `model.logits_from_hidden` over
    the entries of `params` that `model.head_param_names()` names (the forward's logits,
    soft-capping, scaling and bias included), for states from `method="hidden"` (an
    encoder-only model's: `method="encode"`)."""
    head = {name: params[name] for name in model.head_param_names()}

    def head_fn(head, x_BCD):
        return model.apply({"params": head}, x_BCD, method="logits_from_hidden")

    return chunked_cross_entropy(head_fn, head, x_BTD, targets_BT, weights_BT,
                                 chunks=chunks, label_smoothing=label_smoothing,
                                 z_loss=z_loss)


def _to_slices(a_BT, C: int, n: int):
    """[B, T, ...] -> [n, B, C, ...], the end padded with zeros."""
    B, T = a_BT.shape[:2]
    pad = [(0, 0), (0, n * C - T)] + [(0, 0)] * (a_BT.ndim - 2)
    a = jnp.pad(a_BT, pad).reshape(B, n, C, *a_BT.shape[2:])
    return jnp.moveaxis(a, 1, 0)


def _from_slices(a_nBC, T: int):
    """[n, B, C, ...] -> [B, T, ...] (the padding dropped)."""
    n, B, C = a_nBC.shape[:3]
    return jnp.moveaxis(a_nBC, 0, 1).reshape(B, n * C, *a_nBC.shape[3:])[:, :T]


def _tiled(head_fn: HeadFn, chunks: int, label_smoothing: float, z_loss: float):
    """The custom-VJP loss of one head and one setting. The backward pass accumulates the
    head's gradient over the slices in float32 and returns it in the parameters' dtype."""

    def slice_sums(head_params, x_BCD, targets_BC, weights_BC):
        return losses.cross_entropy(head_fn(head_params, x_BCD), targets_BC, weights_BC,
                                    label_smoothing=label_smoothing, z_loss=z_loss)

    @jax.custom_vjp
    def tiled(head_params, x_BTD, targets_BT, weights_BT):
        return forward(head_params, x_BTD, targets_BT, weights_BT)[0]

    def forward(head_params, x_BTD, targets_BT, weights_BT):
        C, n = slices(x_BTD.shape[1], chunks)

        def body(total, piece):
            sums = slice_sums(head_params, *piece)
            return jax.tree.map(jnp.add, total, sums), None

        pieces = tuple(_to_slices(a, C, n) for a in (x_BTD, targets_BT, weights_BT))
        zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(
            slice_sums, head_params, *(p[0] for p in pieces)))
        total, _ = lax.scan(body, zero, pieces)
        return total, (head_params, x_BTD, targets_BT, weights_BT)

    def backward(saved, g):
        head_params, x_BTD, targets_BT, weights_BT = saved
        T = x_BTD.shape[1]
        C, n = slices(T, chunks)

        def body(d_head, piece):
            x_BCD, targets_BC, weights_BC = piece
            _, vjp = jax.vjp(lambda h, x, w: slice_sums(h, x, targets_BC, w),
                             head_params, x_BCD, weights_BC)
            dh, dx_BCD, dw_BC = vjp(g)
            d_head = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), d_head, dh)
            return d_head, (dx_BCD, dw_BC)

        pieces = tuple(_to_slices(a, C, n) for a in (x_BTD, targets_BT, weights_BT))
        zero = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), head_params)
        d_head, (dx, dw) = lax.scan(body, zero, pieces)
        d_head = jax.tree.map(lambda d, p: d.astype(p.dtype), d_head, head_params)
        return d_head, _from_slices(dx, T), None, _from_slices(dw, T)

    tiled.defvjp(forward, backward)
    return tiled
