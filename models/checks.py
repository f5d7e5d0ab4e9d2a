"""Input checks shared by the models' entry points.

Shapes and dtypes are checked always (they are static). Values (token ids, lengths) are
checked when the arrays are concrete, i.e. when a user calls `model.apply` eagerly; under
`jax.jit` values are abstract, so jitted callers such as `decode.generate` check them on
the host before entering the compiled function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.errors import UserError


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_int_array(x, name: str, rank: int, shape_doc: str) -> None:
    if not hasattr(x, "ndim") or x.ndim != rank:
        shape = getattr(x, "shape", type(x).__name__)
        raise UserError(f"{name} must be {shape_doc} (rank {rank}), got shape {shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise UserError(f"{name} must have an integer dtype, got {x.dtype}")


def check_tokens(config, tokens, name: str, max_len: int | None = None) -> None:
    """`tokens` is int[B, T] with 1 <= T <= max_len (a `TransformerConfig`'s, unless given)
    and ids in [0, vocab_size)."""
    check_int_array(tokens, name, 2, "int[B, T]")
    limit = config.max_len if max_len is None else max_len
    B, T = tokens.shape
    if B < 1 or T < 1:
        raise UserError(f"{name} has an empty dimension: shape {tokens.shape}")
    if T > limit:
        raise UserError(f"{name} has length {T}, beyond the limit {limit} "
                         "(max_len or cache length)")
    if is_concrete(tokens):
        values = np.asarray(tokens)
        bad = values[(values < 0) | (values >= config.vocab_size)]
        if bad.size:
            raise UserError(
                f"{name} holds token id {int(bad[0])} outside [0, vocab_size={config.vocab_size})")


def check_same_shape(x, like, name: str, like_name: str) -> None:
    if x is not None and tuple(x.shape) != tuple(like.shape):
        raise UserError(f"{name} has shape {x.shape}, but {like_name} has shape {like.shape}")


def check_new_lengths(lengths, width: int, name: str = "lengths") -> None:
    """Each row's count of real tokens is in [0, width] (when concrete)."""
    if is_concrete(lengths):
        n = np.asarray(lengths)
        bad = np.nonzero((n < 0) | (n > width))[0]
        if bad.size:
            b = int(bad[0])
            raise UserError(f"{name}[{b}]={int(n[b])} must be in [0, tokens width {width}]")


def check_cache_room(cache_lengths, new_lengths, cache_len: int) -> None:
    """Every row has room for its new tokens: lengths + new <= cache_len (when concrete)."""
    if is_concrete(cache_lengths) and is_concrete(new_lengths):
        end = np.asarray(cache_lengths) + np.asarray(new_lengths)
        if end.size and end.max() > cache_len:
            row = int(end.argmax())
            raise UserError(
                f"cache full: row {row} would reach {int(end[row])} tokens, beyond the cache "
                f"length {cache_len}")
