"""Attention masks: boolean arrays where True means "this query may see this key".

Every builder returns `bool[B, T, S]` (T queries, S keys), broadcast over heads by the
attention core; `combine_masks` ANDs any number of them, skipping None.

    >>> causal_mask(jnp.array([[0, 1, 2]]), jnp.array([[0, 1, 2]]))[0].astype(int)
    [[1 0 0]
     [1 1 0]
     [1 1 1]]
    >>> segment_mask(jnp.array([[1, 1, 2]]), jnp.array([[1, 1, 2]]))[0].astype(int)
    [[1 1 0]
     [1 1 0]
     [0 0 1]]
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from models.checks import check_int_array, check_new_lengths
from models.errors import UserError


def causal_mask(q_pos_BT: Int[Array, "B T"], k_pos_BS: Int[Array, "B S"]) -> Bool[Array, "B T S"]:
    """A query at position p sees the keys at positions <= p.

    With a cache, queries are the new tokens at their absolute positions and keys are the
    cache slots 0 .. S-1, so the same rule hides every slot not yet written.
    """
    return k_pos_BS[:, None, :] <= q_pos_BT[:, :, None]


def window_mask(q_pos_BT: Int[Array, "B T"], k_pos_BS: Int[Array, "B S"],
                window: int) -> Bool[Array, "B T S"]:
    """Sliding-window attention: a query at position p sees the keys at positions above
    p - window (with `causal_mask`: the `window` most recent positions, p included).

        window 2, positions 0..3:  [[1 1 1 1]    with causal:  [[1 0 0 0]
                                    [1 1 1 1]                   [1 1 0 0]
                                    [0 1 1 1]                   [0 1 1 0]
                                    [0 0 1 1]]                  [0 0 1 1]]
    """
    return k_pos_BS[:, None, :] > q_pos_BT[:, :, None] - window


def length_mask(lengths_B: Int[Array, " B"], width: int) -> Bool[Array, "B W"]:
    """True at the first lengths[b] positions of each row: the real tokens of a
    right-padded batch."""
    return jnp.arange(width, dtype=jnp.int32)[None, :] < lengths_B[:, None]


def valid_from_lengths(tokens_BS: Int[Array, "B S"], lengths_B: Int[Array, " B"] | None,
                       name: str) -> Bool[Array, "B S"]:
    """bool[B, S]: the real tokens of right-padded rows, from their `lengths` (checked and
    named `name` in errors); None means every token is real."""
    if lengths_B is None:
        return jnp.ones(tokens_BS.shape, bool)
    check_int_array(lengths_B, name, 1, "int[B]")
    if lengths_B.shape != tokens_BS.shape[:1]:
        raise UserError(f"{name} has shape {lengths_B.shape}, but the tokens have "
                         f"{tokens_BS.shape}")
    check_new_lengths(lengths_B, tokens_BS.shape[1], name)
    return length_mask(lengths_B, tokens_BS.shape[1])


def padding_mask(q_valid_BT: Bool[Array, "B T"],
                 k_valid_BS: Bool[Array, "B S"]) -> Bool[Array, "B T S"]:
    """Only real (non-padding) queries see only real keys."""
    return q_valid_BT[:, :, None] & k_valid_BS[:, None, :]


def segment_mask(q_seg_BT: Int[Array, "B T"], k_seg_BS: Int[Array, "B S"]) -> Bool[Array, "B T S"]:
    """In packed rows, tokens see only tokens of their own segment (ids > 0; 0 is padding)."""
    same = q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
    return same & (q_seg_BT[:, :, None] > 0)


def combine_masks(*masks: Bool[Array, "B T S"] | None) -> Bool[Array, "B T S"] | None:
    """The logical AND of the masks that are not None (None if all are)."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    return functools.reduce(jnp.logical_and, present)


def positions_like(tokens_BT: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """0, 1, ..., T-1 for every row."""
    B, T = tokens_BT.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
