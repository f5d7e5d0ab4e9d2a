"""The KV cache: an explicit pytree that goes into the model and comes back updated.

Self-attention keys/values are preallocated to a fixed length S and stacked over the L
decoder layers, heads before slots ([L, B, K, S, H]: the layout the attention dot reads
without a transposed copy); `lengths` says how many slots of each row are filled, which is
also where that row's next token goes. Cross-attention keys/values (encoder-decoder only)
live in their own fields: projected once from the encoder output, never written again.

Writing T new tokens into a row with `lengths[b] = 3` fills slots 3 .. 3+T-1:

    lengths = [3, 1]    step (T=1)   lengths = [4, 2]
    row 0: a b c _ _    ------->     row 0: a b c d _
    row 1: a _ _ _ _                 row 1: a b _ _ _

Slots at or beyond `lengths[b]` may hold stale values (the padding of a right-padded prompt
after prefill); the causal mask over absolute positions never lets a query read them,
because every step writes its slot before it reads.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from models.config import TransformerConfig
from models.errors import UserError, check_positive_int, is_int


@flax.struct.dataclass
class KVCache:
    """Decoding state of a transformer decoder.

    Attributes:
        k: float[L, B, K, S, H] self-attention keys, stacked over layers.
        v: float[L, B, K, S, H] self-attention values.
        lengths: int32[B] filled slots per row (= the position of its next token).
        cross_k: float[L, Bs, K, Ssrc, H] cross-attention keys, or None (decoder-only).
            Bs divides B: beams of one source share its rows (B = Bs * beams).
        cross_v: float[L, Bs, K, Ssrc, H] cross-attention values, or None.
        cross_mask: bool[Bs, Ssrc] True at real (non-padding) source tokens, or None.
    """

    k: Float[Array, "L B K S H"]
    v: Float[Array, "L B K S H"]
    lengths: Int[Array, " B"]
    cross_k: Float[Array, "L Bs K Ssrc H"] | None = None
    cross_v: Float[Array, "L Bs K Ssrc H"] | None = None
    cross_mask: Bool[Array, "Bs Ssrc"] | None = None

    @classmethod
    def create(cls, config: TransformerConfig, batch_size: int,
               cache_len: int | None = None) -> KVCache:
        """An empty cache of `cache_len` slots (default `config.max_len`) per row."""
        cache_len = config.max_len if cache_len is None else cache_len
        batch_size = check_positive_int(batch_size, "batch_size")
        if not is_int(cache_len) or not 1 <= cache_len <= config.max_len:
            raise UserError(
                f"cache_len={cache_len!r} must be an int in [1, max_len={config.max_len}]")
        cache_len = int(cache_len)
        shape = (config.decoder_layers, batch_size, config.num_kv_heads, cache_len,
                 config.head_dim)
        zeros = jnp.zeros(shape, config.dtype)
        return cls(k=zeros, v=zeros, lengths=jnp.zeros((batch_size,), jnp.int32))

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def cache_len(self) -> int:
        return self.k.shape[3]

    def read(self, layer):
        """Keys and values of `layer` as [B, S, K, H] (a view: the swap folds into the dot)."""
        return jnp.swapaxes(self.k[layer], 1, 2), jnp.swapaxes(self.v[layer], 1, 2)

    def write(self, layer, k_BTKH, v_BTKH, positions_BT) -> KVCache:
        """Writes the new keys/values of `layer` at each row's `positions_BT`; positions
        past the last slot are not written (the padding of a block that ends there).

        A scatter of B*T slots: with the buffers donated (or carried by a loop) XLA updates
        them in place, so a step never copies the whole cache.
        """
        B = k_BTKH.shape[0]
        rows_B1 = jnp.arange(B, dtype=jnp.int32)[:, None]
        # Indices [B, 1] and [B, T] around the head slice: the update is [B, T, K, H].
        k = self.k.at[layer, rows_B1, :, positions_BT].set(k_BTKH.astype(self.k.dtype),
                                                           mode="drop")
        v = self.v.at[layer, rows_B1, :, positions_BT].set(v_BTKH.astype(self.v.dtype),
                                                           mode="drop")
        return self.replace(k=k, v=v)

    def take_rows(self, rows_B) -> KVCache:
        """Self-attention rows gathered by index (beam search reorders and duplicates rows
        this way); the cross-attention rows, one per source and shared by its beams, stay."""
        return self.replace(
            k=jnp.take(self.k, rows_B, axis=1), v=jnp.take(self.v, rows_B, axis=1),
            lengths=jnp.take(self.lengths, rows_B, axis=0))
