"""A paged KV cache: the keys and values of many sequences in one pool of fixed-size pages.

A `KVCache` reserves S slots per row whether a row uses them or not. Here every layer has
one pool of P pages of `page_size` tokens ([P, K, page, H], heads before slots as in
`KVCache`), and each row (a serving slot) has a page table: its m-th entry is the page
that holds the row's positions m * page .. (m + 1) * page - 1. Pages are handed out by the
host as a sequence grows (`serve.pages`) and returned when it ends, so memory holds the
tokens in flight. Entries past a row's last page hold `num_pages`, which is no page: a
write there is dropped, a read there is clamped to some page and hidden by the causal
rule (a query never sees a position after its own, and every position up to it is
written).

    page = 4, page table of row 0: [7, 2, P, P]     lengths[0] = 6
    position 5 -> page table[5 // 4] = 2, offset 5 % 4 = 1: pool[2, :, 1]

To the model it is another cache pytree with `KVCache`'s interface (`write`, `read`,
`key_positions`, `filled`, `lengths`, the cross-attention fields), so `prefill` and `step`
run on it unchanged. `read` gathers each row's pages into a [B, M * page, K, H] view in
the jitted computation: what attention reads anyway (a paged attention kernel would read
the pages in place, behind the same interface). Cross-attention keys/values belong to the
row for its life: [B, K, Ssrc, H] per layer, written once per request (`set_cross`).

An int8 pool (`create(..., dtype="int8")`, `models.cache_int8`) pages int8 keys and values
and their scales ([P, K, page, 1] per layer) alike: a write quantizes each token into its
page, a read gathers the int8 pages and dequantizes them.

A linear (Gated DeltaNet) layer keeps no keys or values (its pool has no heads): its state
does not grow with the sequence, so it is not paged. Each row holds one state per linear
layer (`linear`, as `KVCache.linear`), which prefill carries on from and writes back to
each row's length: the serving engine keeps one per slot and gives a row a zero state
when it starts at position 0 (`serve.step`), as after a preemption.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from models.cache import (
    Layers,
    LayerUpdates,
    commit_layers,
    layer_shape,
    linear_states,
    written,
)
from models.cache_int8 import as_cached, empty_self, read_kv
from models.config import TransformerConfig
from models.errors import UserError, check_positive_int


@flax.struct.dataclass
class PagedKVCache:
    """Decoding state of B rows over a shared pool of pages.

    Attributes:
        k: self-attention keys, per layer [P, K, page, H] (a tuple of L arrays, or one
            [L, P, K, page, H] array for a scanned stack, as `KVCache`).
        v: self-attention values, likewise.
        page_table: int32[B, M] the page holding each row's positions m * page ..
            (m + 1) * page - 1; P (no page) past its last.
        lengths: int32[B] filled positions per row (= the position of its next token).
        cross_k, cross_v: cross-attention keys/values per layer [B, K, Ssrc, H], or None.
        cross_mask: bool[B, Ssrc] the real source positions of each row, or None.
        k_scale, v_scale: an int8 pool's scales per layer [P, K, page, 1], or None.
        linear: None, or with linear layers one entry per layer: a linear layer's
            `models.gated_deltanet.LinearState` per row, None for an attention layer.
    """

    k: Layers
    v: Layers
    page_table: Int[Array, "B M"]
    lengths: Int[Array, " B"]
    cross_k: Layers | None = None
    cross_v: Layers | None = None
    cross_mask: Bool[Array, "B Ssrc"] | None = None
    k_scale: Layers | None = None
    v_scale: Layers | None = None
    linear: tuple | None = None

    @classmethod
    def create(cls, config: TransformerConfig, *, rows: int, num_pages: int, page_size: int,
               pages_per_row: int, source_len: int | None = None,
               dtype: str = "auto") -> PagedKVCache:
        """An empty pool of `num_pages` pages of `page_size` tokens per layer and `rows`
        page tables of `pages_per_row` entries (all no page); with `source_len` (an
        encoder-decoder) zero cross-attention regions of that many positions per row.
        `dtype`: "auto" pages keys and values in the config's dtype, "int8" as int8 with a
        scale per token per kv head (`models.cache_int8`). Linear layers get a zero state
        per row.

        Raises:
            UserError: a size that is not a positive int, rows whose pages would reach
                past the model's max_len, or a dtype not in `KV_CACHE_DTYPES`.
        """
        rows = check_positive_int(rows, "rows")
        num_pages = check_positive_int(num_pages, "num_pages")
        page_size = check_positive_int(page_size, "page_size")
        pages_per_row = check_positive_int(pages_per_row, "pages_per_row")
        if (pages_per_row - 1) * page_size >= config.max_len:
            raise UserError(f"pages_per_row={pages_per_row} of page_size={page_size} reach "
                            f"past the model's max_len {config.max_len}")
        cache = cls(**empty_self(config, num_pages, page_size, dtype),  # apart: donated
                    page_table=jnp.full((rows, pages_per_row), num_pages, jnp.int32),
                    lengths=jnp.zeros((rows,), jnp.int32),
                    linear=linear_states(config, rows))
        if source_len is None:
            return cache
        cross = (rows, config.num_kv_heads, source_len, config.head_dim)
        return cache.replace(cross_k=_layers(config, cross), cross_v=_layers(config, cross),
                             cross_mask=jnp.zeros((rows, source_len), bool))

    @property
    def num_pages(self) -> int:
        return layer_shape(self.k)[0]

    @property
    def page_size(self) -> int:
        return layer_shape(self.k)[2]

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    @property
    def cache_len(self) -> int:
        """S = M * page: the positions a row can address."""
        return self.page_table.shape[1] * self.page_size

    def _pages(self, positions_BT):
        """(pages, offsets) of each row's positions; no page (P) past its table."""
        page = self.page_size
        index_BT = positions_BT // page
        inside = index_BT < self.page_table.shape[1]
        pages_BT = jnp.take_along_axis(
            self.page_table, jnp.minimum(index_BT, self.page_table.shape[1] - 1), axis=1)
        return jnp.where(inside, pages_BT, self.num_pages), positions_BT % page

    def write(self, layer, k_BTKH, v_BTKH, positions_BT) -> PagedKVCache:
        """Writes the new keys/values of `layer` at each row's positions, into the pages
        its table names; a position without a page is not written."""
        pages_BT, offsets_BT = self._pages(positions_BT)
        return self.replace(**written(self, layer, pages_BT, offsets_BT, k_BTKH, v_BTKH))

    def commit(self, new_kv, active_B=None) -> PagedKVCache:
        """Writes one token per row, every layer's (k_LBKH, v_LBKH) (or, with linear
        layers, a `LayerUpdates`), at position lengths[b], and advances the rows (only the
        `active_B` ones, when given)."""
        pages_B1, offsets_B1 = self._pages(self.lengths[:, None])
        step = 1 if active_B is None else active_B.astype(jnp.int32)
        if isinstance(new_kv, LayerUpdates):
            return commit_layers(self, new_kv, pages_B1[:, 0], offsets_B1[:, 0],
                                  active_B).replace(lengths=self.lengths + step)
        k_LBKH, v_LBKH = new_kv
        return self.replace(
            **written(self, None, pages_B1[:, 0], offsets_B1[:, 0], k_LBKH, v_LBKH),
            lengths=self.lengths + step)

    def read(self, layer):
        """Keys and values of `layer` as [B, M * page, K, H]: each row's pages gathered in
        its table's order (an entry without a page reads some page, never seen)."""
        table_BM = jnp.minimum(self.page_table, self.num_pages - 1)

        def gather(x, layer):
            pages_BMKpH = jnp.take(x[layer], table_BM, axis=0)
            B, M, K, page, H = pages_BMKpH.shape
            return pages_BMKpH.transpose(0, 1, 3, 2, 4).reshape(B, M * page, K, H)
        return read_kv(self, layer, gather)

    def as_cached(self, k_BTKH, v_BTKH):
        """New keys and values as a read will give them back once written
        (`models.cache_int8.as_cached`)."""
        return as_cached(self, k_BTKH, v_BTKH)

    def key_positions(self) -> Int[Array, "B S"]:
        """Slot s of the gathered view holds position s."""
        return jnp.broadcast_to(jnp.arange(self.cache_len, dtype=jnp.int32)[None, :],
                                (self.batch_size, self.cache_len))

    def row_visible(self) -> None:
        return None

    def filled(self) -> Bool[Array, "B S"]:
        """The positions written so far: s < lengths[b]."""
        return self.key_positions() < self.lengths[:, None]

    def set_cross(self, rows_R, cross_k, cross_v, mask_RS) -> PagedKVCache:
        """Gives rows `rows_R` (int32[R]; an index >= B is dropped) their sources' cross-
        attention keys/values ([L, R, K, Ssrc', H] each, Ssrc' <= the region's length,
        as `CrossKVProjection` returns them) and mask (bool[R, Ssrc']); the rest of each
        region is cleared."""
        region = self.cross_mask.shape[1]
        width = mask_RS.shape[1]
        if width > region:
            raise UserError(f"a source of {width} positions does not fit the cache's "
                            f"{region}-position cross-attention region")
        pad = region - width

        def put(x, new_LRKSH):
            new_LRKSH = jnp.pad(new_LRKSH, [(0, 0)] * 3 + [(0, pad), (0, 0)])
            if isinstance(x, tuple):
                return tuple(b.at[rows_R].set(n.astype(b.dtype), mode="drop")
                             for b, n in zip(x, new_LRKSH, strict=True))
            return x.at[:, rows_R].set(new_LRKSH.astype(x.dtype), mode="drop")
        mask = jnp.pad(mask_RS, ((0, 0), (0, pad)))
        return self.replace(cross_k=put(self.cross_k, cross_k),
                            cross_v=put(self.cross_v, cross_v),
                            cross_mask=self.cross_mask.at[rows_R].set(mask, mode="drop"))


def _layers(config: TransformerConfig, shape) -> Layers:
    """Zeros of `shape` per decoder layer, in the layout of the config's stack."""
    if config.scan_layers:
        return jnp.zeros((config.decoder_layers, *shape), config.dtype)
    return tuple(jnp.zeros(shape, config.dtype) for _ in range(config.decoder_layers))


__all__ = ["PagedKVCache"]
