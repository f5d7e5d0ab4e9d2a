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

    def key_positions(self) -> Int[Array, "B S"]:
        """The position of each slot's key: slot s holds position s."""
        return jnp.broadcast_to(jnp.arange(self.cache_len, dtype=jnp.int32)[None, :],
                                (self.batch_size, self.cache_len))

    def row_visible(self) -> None:
        """Which slots each row may read beyond the causal rule: all of its own (None)."""
        return None

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


@flax.struct.dataclass
class BeamKVCache:
    """Decoding state of W beams per source whose keys and values never move.

    Beam search reorders its beams every step: a beam continues another's sequence. A
    `KVCache` follows by gathering every layer's rows by parent beam, reading and writing
    the whole cache per step. Here each beam writes only its new token's keys and values,
    into its own region of its source's row, and a table says, for each beam and each of
    its positions, which beam's region holds that position's keys and values: the beam
    that occupied its line of descent at that step. Reordering then moves that table
    ([Bs, W, S] ints), never the keys and values, and attention reads all W regions of
    the source at once, each beam seeing the slots its table points to.

        W = 2, after 3 steps; beam 1's parent at step 2 was beam 0:
        region 0: a0 b0 c0      origin[beam 0] = [0 0 0 ...]   reads a0 b0 c0
        region 1: a1 b1 c1      origin[beam 1] = [0 0 1 ...]   reads a0 b0 c1

    Row r = b * W + w is beam w of source b (as a `KVCache` of B = Bs * W rows).

    Attributes:
        k, v: float[L, Bs, K, W * S, H]; slot w * S + s holds position s of region w.
        lengths: int32[Bs * W] filled positions per beam (= the position of its next token).
        origin: int32[Bs, W, S] the region holding each beam's position s.
        cross_k, cross_v, cross_mask: as in `KVCache` (one row per source).
        beams: W (static).
    """

    k: Float[Array, "L Bs K WS H"]
    v: Float[Array, "L Bs K WS H"]
    lengths: Int[Array, " R"]
    origin: Int[Array, "Bs W S"]
    cross_k: Float[Array, "L Bs K Ssrc H"] | None = None
    cross_v: Float[Array, "L Bs K Ssrc H"] | None = None
    cross_mask: Bool[Array, "Bs Ssrc"] | None = None
    beams: int = flax.struct.field(pytree_node=False, default=1)

    @classmethod
    def from_cache(cls, cache: KVCache, beams: int) -> BeamKVCache:
        """The W beams of each row of `cache` (a prompt or a start token, prefilled once per
        source): the row becomes region 0 of its source, which every beam reads up to its
        length; regions 1 .. W-1 start empty."""
        W = check_positive_int(beams, "beams")
        L, Bs, K, S, H = cache.k.shape
        if cache.cross_mask is not None and cache.cross_mask.shape[0] != Bs:
            raise UserError(f"a beam cache starts from one row per source; this cache has "
                            f"{Bs} rows for {cache.cross_mask.shape[0]} sources")

        def regions(x):
            return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, (W - 1) * S), (0, 0)))
        lengths = jnp.repeat(cache.lengths, W)
        return cls(k=regions(cache.k), v=regions(cache.v), lengths=lengths,
                   origin=_own_after(jnp.zeros((Bs, W, S), jnp.int32), cache.lengths),
                   cross_k=cache.cross_k, cross_v=cache.cross_v, cross_mask=cache.cross_mask,
                   beams=W)

    @property
    def batch_size(self) -> int:
        """Rows of the decoding batch: Bs * W beams."""
        return self.k.shape[1] * self.beams

    @property
    def cache_len(self) -> int:
        """S: positions per beam."""
        return self.origin.shape[-1]

    def read(self, layer):
        """Keys and values of `layer` as [Bs, W * S, K, H]: every region of a source, read
        by its W beams (the attention core's keys shared by several query rows)."""
        return jnp.swapaxes(self.k[layer], 1, 2), jnp.swapaxes(self.v[layer], 1, 2)

    def write(self, layer, k_RTKH, v_RTKH, positions_RT) -> BeamKVCache:
        """Writes each beam's new keys/values of `layer` into its own region at
        `positions_RT`; positions past the last slot are not written."""
        Bs, W, S = self.origin.shape
        R, T = positions_RT.shape
        region_R1 = jnp.tile(jnp.arange(W, dtype=jnp.int32), Bs)[:, None]
        slots = jnp.where(positions_RT < S, region_R1 * S + positions_RT, W * S)
        rows_B1 = jnp.arange(Bs, dtype=jnp.int32)[:, None]

        def put(buffer, new_RTKH):
            new = new_RTKH.astype(buffer.dtype).reshape(Bs, W * T, *new_RTKH.shape[2:])
            return buffer.at[layer, rows_B1, :, slots.reshape(Bs, W * T)].set(new, mode="drop")
        return self.replace(k=put(self.k, k_RTKH), v=put(self.v, v_RTKH))

    def key_positions(self) -> Int[Array, "Bs WS"]:
        """The position of each slot's key: slot w * S + s holds position s."""
        Bs, W, S = self.origin.shape
        return jnp.broadcast_to(jnp.tile(jnp.arange(S, dtype=jnp.int32), W)[None, :],
                                (Bs, W * S))

    def row_visible(self) -> Bool[Array, "R WS"]:
        """bool[Bs * W, W * S]: beam w of source b reads slot v * S + s when its position s
        lies in region v (`origin[b, w, s] == v`)."""
        Bs, W, S = self.origin.shape
        region = jnp.arange(W, dtype=jnp.int32)[None, None, :, None]
        return (self.origin[:, :, None, :] == region).reshape(Bs * W, W * S)

    def reorder(self, parents_BW) -> BeamKVCache:
        """The beams continuing `parents_BW` (int32[Bs, W]: beam w continues beam
        parents[b, w] of its source): each takes its parent's table and length, and owns
        its positions from its length on. No keys or values move.

            origin [[0 0 0 _], [0 0 1 _]], length 3, parents [1, 1]
            -> [[0 0 1 0], [0 0 1 1]]: both continue beam 1, each writing on in its own region
        """
        origin = jnp.take_along_axis(self.origin, parents_BW[:, :, None], axis=1)
        Bs, W, _ = origin.shape
        lengths = jnp.take_along_axis(self.lengths.reshape(Bs, W), parents_BW, axis=1)
        return self.replace(origin=_own_after(origin, lengths.reshape(-1)),
                            lengths=lengths.reshape(-1))


def _own_after(origin_BWS, lengths):
    """Each beam's table with its own region from its length on (where it writes next).
    `lengths`: int32[Bs * W] per beam, or int32[Bs] shared by a source's beams."""
    Bs, W, S = origin_BWS.shape
    lengths_BW = lengths.reshape(Bs, -1)
    own_BW1 = jnp.arange(W, dtype=jnp.int32)[None, :, None]
    future_BWS = jnp.arange(S, dtype=jnp.int32)[None, None, :] >= lengths_BW[:, :, None]
    return jnp.where(future_BWS, own_BW1, origin_BWS)
