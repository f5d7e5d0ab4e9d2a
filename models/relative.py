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
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from models.axes import named
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


class RelativePositionBias(nn.Module):
    """The bias [B, N, T, S] of queries at `q_pos_BT` over keys at `k_pos_BS`, from one
    [buckets, N] table (named "embedding" under this module)."""

    config: TransformerConfig
    bidirectional: bool

    @nn.compact
    def __call__(self, q_pos_BT: Int[Array, "B T"],
                 k_pos_BS: Int[Array, "B S"]) -> Float[Array, "B N T S"]:
        cfg = self.config
        table_bN = self.param(
            "embedding", named(nn.initializers.normal(1.0), "buckets", "heads"),
            (cfg.relative_buckets, cfg.num_heads),
            cfg.param_dtype)
        bucket_BTS = relative_buckets(
            k_pos_BS[:, None, :] - q_pos_BT[:, :, None], bidirectional=self.bidirectional,
            num_buckets=cfg.relative_buckets, max_distance=cfg.relative_max_distance)
        bias_BTSN = jnp.take(table_bN.astype(jnp.float32), bucket_BTS, axis=0)
        return bias_BTSN.transpose(0, 3, 1, 2)
