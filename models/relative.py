"""T5's relative position bias: a learned scalar per head for each bucket of key position
minus query position, added to the self-attention logits.

Distances map to buckets: the first half of a direction's buckets hold distances 0, 1, 2, ...
exactly, the second half grows logarithmically up to `max_distance`, and everything
beyond shares the last bucket. An encoder (bidirectional) gives each direction half of the
buckets, keys after the query in the upper half; a decoder (causal) only looks back, so all
buckets count backwards and keys ahead share bucket 0 (the causal mask hides them).

    decoder, 8 buckets, max_distance 20: exact distances 0..3, then log-spaced:
    distance  0 1 2 3 4 5 6 7 8 9 ... 13 14 ... 100
    bucket    0 1 2 3 4 4 5 5 5 6 ...  6  7 ...   7

The bias depends only on the two positions, so the forward pass, prefill and each cached
step (query position against cache slot positions) compute it the same way.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import flax.struct
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from models.axes import named, normal_init
from models.config import TransformerConfig


@functools.lru_cache(maxsize=16)
def bucket_table(*, bidirectional: bool, num_buckets: int, max_distance: int) -> np.ndarray:
    """int32[2 * max_distance + 1]: the bucket of each relative position in
    [-max_distance, max_distance] (entry r + max_distance); every position beyond shares
    the bucket of the nearer end. Computed once on the host in float32 as the reference
    computes it, so the bucket edges (some fall exactly on a float32 rounding) do not
    depend on the accelerator's `log`."""
    relative = np.arange(-max_distance, max_distance + 1)
    if bidirectional:
        num_buckets //= 2
        offset = np.where(relative > 0, num_buckets, 0)
        distance = np.abs(relative)
    else:
        offset = 0
        distance = np.maximum(-relative, 0)
    exact = num_buckets // 2
    # (distance 0 is an exact bucket: its log is never used, so take it at 1.)
    log_ratio = (np.log(np.maximum(distance, 1).astype(np.float32) / np.float32(exact))
                 / np.float32(math.log(max_distance / exact)))
    far = exact + (log_ratio * np.float32(num_buckets - exact)).astype(np.int64)
    far = np.minimum(far, num_buckets - 1)
    return (offset + np.where(distance < exact, distance, far)).astype(np.int32)


def relative_buckets(relative_BTS: Int[Array, "B T S"], *, bidirectional: bool,
                     num_buckets: int, max_distance: int) -> Int[Array, "B T S"]:
    """The bucket of each key position minus query position (see the module docstring),
    looked up in `bucket_table`."""
    table = jnp.asarray(bucket_table(bidirectional=bidirectional, num_buckets=num_buckets,
                                     max_distance=max_distance))
    return table[jnp.clip(relative_BTS, -max_distance, max_distance) + max_distance]


@flax.struct.dataclass
class RelativeBias:
    """T5's bias of queries at `q_pos` over keys at `k_pos`, described: the [buckets, N]
    table and the positions. `materialize` gives float32[B, N, T, S] at once (the `xla`
    attention); `block` gives one block of it, so `chunked` attention never holds a whole
    T x S table. Its gradient reaches `table` through either.

    Attributes:
        table: float[buckets, N] the learned bias of each bucket and head.
        q_pos: int32[B, T] query positions; k_pos: int32[Bk, S] key positions (Bk divides
            B, as in `models.masks.MaskSpec`).
        bidirectional, num_buckets, max_distance: the bucketing (static).
    """

    table: Float[Array, "b N"]
    q_pos: Int[Array, "B T"]
    k_pos: Int[Array, "Bk S"]
    bidirectional: bool = flax.struct.field(pytree_node=False, default=True)
    num_buckets: int = flax.struct.field(pytree_node=False, default=32)
    max_distance: int = flax.struct.field(pytree_node=False, default=128)

    def _bias(self, q_pos_BT, k_pos_BS) -> Float[Array, "B N T S"]:
        B = q_pos_BT.shape[0]
        fold = B // k_pos_BS.shape[0]
        k_pos_BS = jnp.repeat(k_pos_BS, fold, axis=0) if fold > 1 else k_pos_BS
        bucket_BTS = relative_buckets(
            k_pos_BS[:, None, :] - q_pos_BT[:, :, None], bidirectional=self.bidirectional,
            num_buckets=self.num_buckets, max_distance=self.max_distance)
        bias_BTSN = jnp.take(self.table.astype(jnp.float32), bucket_BTS, axis=0)
        return bias_BTSN.transpose(0, 3, 1, 2)

    def materialize(self) -> Float[Array, "B N T S"]:
        return self._bias(self.q_pos, self.k_pos)

    def block(self, q_slice: tuple, k_slice: tuple) -> Float[Array, "B N t s"]:
        """The bias of the queries `q_slice` = (start, size) over the keys `k_slice`."""
        return self._bias(lax.dynamic_slice_in_dim(self.q_pos, *q_slice, axis=1),
                          lax.dynamic_slice_in_dim(self.k_pos, *k_slice, axis=1))

    def rows(self, fold: int) -> RelativeBias:
        """Query positions folded to [Bk, fold * T], as `MaskSpec.rows`."""
        if fold == 1:
            return self
        return self.replace(q_pos=self.q_pos.reshape(self.q_pos.shape[0] // fold, -1))


class RelativePositionBias(nn.Module):
    """The bias of queries at `q_pos_BT` over keys at `k_pos_BS`, described (a
    `RelativeBias` over one [buckets, N] table, named "embedding" under this module)."""

    config: TransformerConfig
    bidirectional: bool

    @nn.compact
    def __call__(self, q_pos_BT: Int[Array, "B T"], k_pos_BS: Int[Array, "B S"]) -> RelativeBias:
        cfg = self.config
        table_bN = self.param(
            "embedding", named(normal_init(1.0), "buckets", "heads"),
            (cfg.relative_buckets, cfg.num_heads),
            cfg.param_dtype)
        return RelativeBias(table_bN, q_pos_BT, k_pos_BS, bidirectional=self.bidirectional,
                            num_buckets=cfg.relative_buckets,
                            max_distance=cfg.relative_max_distance)
