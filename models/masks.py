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

import flax.struct
import jax.numpy as jnp
from jax import lax
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
                window: int, *, both_sides: bool = False) -> Bool[Array, "B T S"]:
    """Sliding-window attention: a query at position p sees the keys at positions above
    p - window (with `causal_mask`: the `window` most recent positions, p included).

        window 2, positions 0..3:  [[1 1 1 1]    with causal:  [[1 0 0 0]
                                    [1 1 1 1]                   [1 1 0 0]
                                    [0 1 1 1]                   [0 1 1 0]
                                    [0 0 1 1]]                  [0 0 1 1]]

    `both_sides` (a bidirectional encoder's, as transformers' T5Gemma): the keys within
    `window` positions on either side, |k - p| <= window.
    """
    if both_sides:
        return jnp.abs(k_pos_BS[:, None, :] - q_pos_BT[:, :, None]) <= window
    return k_pos_BS[:, None, :] > q_pos_BT[:, :, None] - window


def chunk_mask(q_pos_BT: Int[Array, "B T"], k_pos_BS: Int[Array, "B S"],
               chunk: int) -> Bool[Array, "B T S"]:
    """Chunked local attention (Llama 4): a query sees only the keys of its own chunk,
    positions [c * chunk, (c + 1) * chunk) (with `causal_mask`: from its chunk's start to
    itself).

        chunk 2, positions 0..3:  [[1 1 0 0]    with causal:  [[1 0 0 0]
                                   [1 1 0 0]                   [1 1 0 0]
                                   [0 0 1 1]                   [0 0 1 0]
                                   [0 0 1 1]]                  [0 0 1 1]]
    """
    return k_pos_BS[:, None, :] // chunk == q_pos_BT[:, :, None] // chunk


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


@flax.struct.dataclass
class MaskSpec:
    """Which keys each query may see, described rather than materialised.

    Every attention implementation reads this one description: `xla` materialises it
    (`materialize`), `chunked` evaluates one block of it at a time (`block`), so no
    `[B, T, S]` array exists unless an implementation asks for one. A query sees a key when
    every rule given holds:

        causal    k_index <= q_index                          (static flag)
        window    k_index >  q_index - window                 (static; with causal: the
                                                               `window` most recent keys;
                  |k_index - q_index| <= window                without: either side)
        chunk     k_position // chunk == q_position // chunk  (static; Llama 4's local
                                                               layers: the query's chunk)
        segments  q_segment == k_segment and q_segment > 0    (packed rows; 0 is padding)
        validity  q_valid and k_valid                         (right padding, by lengths)
        visible   visible[b, t, s]                            (a beam's own line of
                                                               descent, `BeamKVCache`)

    Query-side arrays are [B, T]; key-side arrays are [Bk, S], where Bk divides B: the
    B / Bk consecutive query rows of one key row (the beams of one source) share its keys.
    Indices are the order positions of tokens in their row (0 .. T-1 for a teacher-forced
    sequence; absolute positions and cache slots when decoding), not per-segment
    positions.

        causal, q_index [[0 1 2]], k_index [[0 1 2]]   ->   [[1 0 0]
                                                             [1 1 0]
                                                             [1 1 1]]

    Attributes:
        q_index, k_index: int32 [B, T] and [Bk, S], needed by causal and window.
        q_segment, k_segment: int32 [B, T] and [Bk, S] segment ids, or None.
        q_valid, k_valid: bool [B, T] and [Bk, S], or None (all real).
        causal: keys after the query are hidden.
        window: None, or W: only keys with k_index > q_index - W are seen.
        aligned: the indices are 0 .. T-1 and 0 .. S-1 in every row (a teacher-forced
            sequence, T = S), which fused kernels' own causal masks assume.
        visible: bool[B, T or 1, S] the keys each query may read, or None: a table of its
            own, given only where no rule above expresses it (beams, whose keys lie in the
            regions their ancestry table names; one row of S per query row).
        window_on: None, or a traced bool scalar: the window rule holds only where it is
            True (one layer's kind in a scanned stack of sliding and full layers, where
            `window` cannot change per layer).
        chunk: None, or C: only keys in the query's chunk of C positions are seen.
        chunk_on: None, or a traced bool scalar: the chunk rule holds only where it is
            True (as `window_on`).
        q_position, k_position: int32 [B, T] and [Bk, S] positions of the chunk rule, or
            None: the indices (they differ in packed rows, where each sequence's chunks
            start at its first token).
    """

    q_index: Int[Array, "B T"] | None = None
    k_index: Int[Array, "Bk S"] | None = None
    q_segment: Int[Array, "B T"] | None = None
    k_segment: Int[Array, "Bk S"] | None = None
    q_valid: Bool[Array, "B T"] | None = None
    k_valid: Bool[Array, "Bk S"] | None = None
    causal: bool = flax.struct.field(pytree_node=False, default=False)
    window: int | None = flax.struct.field(pytree_node=False, default=None)
    aligned: bool = flax.struct.field(pytree_node=False, default=False)
    visible: Bool[Array, "B T S"] | None = None
    window_on: Bool[Array, ""] | None = None
    chunk: int | None = flax.struct.field(pytree_node=False, default=None)
    chunk_on: Bool[Array, ""] | None = None
    q_position: Int[Array, "B T"] | None = None
    k_position: Int[Array, "Bk S"] | None = None

    @property
    def is_empty(self) -> bool:
        """No rule at all: every query sees every key."""
        return (not self.causal and self.window is None and self.chunk is None
                and self.q_segment is None
                and self.q_valid is None and self.k_valid is None and self.visible is None)

    def rows(self, fold: int) -> MaskSpec:
        """The spec with each query-side array folded to [Bk, fold * T]: query row b's
        tokens follow row b - 1's within its key row (as the attention core folds the
        beams that share one source's keys)."""
        if fold == 1:
            return self

        def f(x):
            return None if x is None else x.reshape(x.shape[0] // fold, -1)
        visible = self.visible
        if visible is not None:
            B, _, S = visible.shape
            T = next((x.shape[1] for x in (self.q_index, self.q_segment, self.q_valid)
                      if x is not None), 1)
            visible = jnp.broadcast_to(visible, (B, T, S)).reshape(B // fold, fold * T, S)
        return self.replace(q_index=f(self.q_index), q_segment=f(self.q_segment),
                            q_valid=f(self.q_valid), q_position=f(self.q_position),
                            visible=visible)

    def block(self, q_slice: tuple, k_slice: tuple) -> Bool[Array, "B t s"] | None:
        """bool[B, t, s] of the queries `q_slice` = (start, size) and the keys `k_slice`,
        starts traced or static (a `lax.dynamic_slice` of each array); None when the spec
        hides nothing."""
        def q(x):
            return None if x is None else _slice(x, q_slice)

        def k(x):
            return None if x is None else _slice(x, k_slice)
        visible = self.visible
        if visible is not None:
            if visible.shape[1] > 1:
                visible = lax.dynamic_slice_in_dim(visible, *q_slice, axis=1)
            visible = lax.dynamic_slice_in_dim(visible, *k_slice, axis=2)
        return _visible(self, q(self.q_index), k(self.k_index), q(self.q_segment),
                        k(self.k_segment), q(self.q_valid), k(self.k_valid), visible,
                        q(self.q_position), k(self.k_position))

    def materialize(self) -> Bool[Array, "B T S"] | None:
        """The whole bool[B, T, S] mask (query and key rows equal in number), or None
        when it hides nothing."""
        return _visible(self, self.q_index, self.k_index, self.q_segment, self.k_segment,
                        self.q_valid, self.k_valid, self.visible, self.q_position,
                        self.k_position)

    def key_rows(self, f) -> MaskSpec:
        """The spec with `f` applied to each key-side array ([Bk, S], None kept)."""
        def g(x):
            return None if x is None else f(x)
        return self.replace(k_index=g(self.k_index), k_segment=g(self.k_segment),
                            k_valid=g(self.k_valid), k_position=g(self.k_position))


def _slice(x, where: tuple):
    start, size = where
    return lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _visible(spec: MaskSpec, *arrays):
    """The rules of `spec` on (slices of) its arrays, ANDed; None when none applies."""
    (q_index, k_index, q_segment, k_segment, q_valid, k_valid, visible, q_position,
     k_position) = arrays
    rules = [] if visible is None else [visible]
    if spec.causal:
        rules.append(causal_mask(q_index, k_index))
    if spec.window is not None:
        in_window = window_mask(q_index, k_index, spec.window, both_sides=not spec.causal)
        if spec.window_on is not None:
            in_window = in_window | ~spec.window_on
        rules.append(in_window)
    if spec.chunk is not None:
        in_chunk = chunk_mask(q_index if q_position is None else q_position,
                              k_index if k_position is None else k_position, spec.chunk)
        if spec.chunk_on is not None:
            in_chunk = in_chunk | ~spec.chunk_on
        rules.append(in_chunk)
    if q_segment is not None:
        rules.append(segment_mask(q_segment, k_segment))
    if q_valid is not None or k_valid is not None:
        q_ok = True if q_valid is None else q_valid[:, :, None]
        k_ok = True if k_valid is None else k_valid[:, None, :]
        rules.append(jnp.logical_and(q_ok, k_ok))
    return combine_masks(*rules)
