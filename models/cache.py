"""The KV cache: an explicit pytree that goes into the model and comes back updated.

Self-attention keys/values are preallocated to a fixed length S per decoder layer, heads
before slots ([B, K, S, H]: the layout the attention dot reads without a transposed copy);
`lengths` says how many slots of each row are filled, which is also where that row's next
token goes. Cross-attention keys/values (encoder-decoder only) live in their own fields:
projected once from the encoder output, never written again.

Two layouts of the L layers, chosen by the config's `scan_layers` (`KVCache.create`):

    looped stack   a tuple of L arrays [B, K, S, H]: each layer reads its own buffer whole.
    scanned stack  one array [L, B, K, S, H]: the scan indexes it by a traced layer.

A step reads every filled slot of every layer, so on a CPU the looped layout is the faster:
a layer sliced out of a stacked array is copied before the attention dot reads it (XLA's
CPU backend cannot hand a dot part of a buffer), which a buffer of its own avoids.

Writing T new tokens into a row with `lengths[b] = 3` fills slots 3 .. 3+T-1:

    lengths = [3, 1]    step (T=1)   lengths = [4, 2]
    row 0: a b c _ _    ------->     row 0: a b c d _
    row 1: a _ _ _ _                 row 1: a b _ _ _

Slots at or beyond `lengths[b]` may hold stale values (the padding of a right-padded prompt
after prefill); a query reads only slots before its own position (causal over absolute
positions, and a decoding step's `filled` slots).

A latent-attention model's cache (`config.latent`, `models.latent_attention`) has one
"head" whose key is the token's compressed latent and rotated key, and values of width 0
(the attention reads them from the key): `config.cache_shape` gives (K, key H, value H).

An int8 cache (`create(..., dtype="int8")`, `models.cache_int8`) holds int8 keys and values
and their scales, `k_scale` and `v_scale` ([B, K, S, 1] per layer: the layout of `k` and
`v` with H = 1), quantized by `write` and `commit` and dequantized by `read`. Every other
operation treats the four self-attention leaves alike (`SELF_FIELDS`).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from models.cache_int8 import as_cached, empty_self, layers_dtype, quantize, read_kv
from models.config import TransformerConfig
from models.errors import UserError, check_positive_int, is_int
from models.gated_deltanet import LinearState

Layers = Float[Array, "L B K S H"] | tuple[Float[Array, "B K S H"], ...]

# The self-attention leaves of every cache, laid out alike per layer (the scales, present
# only in an int8 cache, with H = 1): written at the same rows and slots, gathered by the
# same rows, padded into the same beam regions, paged into the same pages.
SELF_FIELDS = ("k", "v", "k_scale", "v_scale")


def per_layer(x_L, looped: bool):
    """A stacked [L, ...] array as the layout of a looped (a tuple of L arrays) or scanned
    (the array) stack."""
    return tuple(x_L[i] for i in range(x_L.shape[0])) if looped else x_L


def layer_shape(x: Layers) -> tuple[int, ...]:
    """The shape of one layer's buffer, in either layout."""
    return x[0].shape if isinstance(x, tuple) else x.shape[1:]


def map_layers(fn, x: Layers) -> Layers:
    """`fn` applied to each layer's [B, ...] buffer (one call over the stack when stacked,
    with the layer axis first: `fn` must take a leading axis it leaves alone)."""
    if isinstance(x, tuple):
        return tuple(fn(layer) for layer in x)
    return fn(x)


def _set_rows(x: Layers, layer, rows, slots, new) -> Layers:
    """x[layer][rows, :, slots] = new, in place when `x` is carried or donated; slots past
    the end are not written. `rows` and `slots` are index arrays of one shape, so the
    update is [*that shape, K, H]. `layer` None writes every layer ([L, *shape, K, H])."""
    if isinstance(x, tuple):
        if layer is None:
            return tuple(b.at[rows, :, slots].set(n.astype(b.dtype), mode="drop")
                         for b, n in zip(x, new, strict=True))
        x = list(x)
        x[layer] = x[layer].at[rows, :, slots].set(new.astype(x[layer].dtype), mode="drop")
        return tuple(x)
    if layer is None:       # index arrays apart from each other put their dimensions first
        new = jnp.moveaxis(new, 0, rows.ndim)
        return x.at[:, rows, :, slots].set(new.astype(x.dtype), mode="drop")
    return x.at[layer, rows, :, slots].set(new.astype(x.dtype), mode="drop")


def _read(x: Layers, layer):
    """Layer `layer`'s keys (or values) as [B, S, K, H] (a view: the swap folds into the
    dot)."""
    return jnp.swapaxes(x[layer], 1, 2)


def self_leaves(cache) -> dict:
    """The cache's self-attention leaves by name (`SELF_FIELDS`; the scales only when it
    is int8)."""
    return {n: getattr(cache, n) for n in SELF_FIELDS if getattr(cache, n) is not None}


def map_self(fn, cache) -> dict:
    """`fn` applied to every layer of every self-attention leaf (`map_layers`), as
    `replace` keywords."""
    return {n: map_layers(fn, x) for n, x in self_leaves(cache).items()}


def written(cache, layer, rows, slots, k_new, v_new) -> dict:
    """The self-attention leaves with `k_new` / `v_new` written at (rows, slots) of `layer`
    (`_set_rows`), as `replace` keywords; an int8 cache quantizes them first and writes
    their scales at the same places."""
    if cache.k_scale is None:
        return dict(k=_set_rows(cache.k, layer, rows, slots, k_new),
                    v=_set_rows(cache.v, layer, rows, slots, v_new))
    out, dtype = {}, layers_dtype(cache.k_scale)
    for name, new in (("k", k_new), ("v", v_new)):
        q, scale = quantize(new, dtype)
        out[name] = _set_rows(getattr(cache, name), layer, rows, slots, q)
        out[f"{name}_scale"] = _set_rows(getattr(cache, f"{name}_scale"), layer, rows, slots,
                                         scale)
    return out


def linear_states(config, rows: int) -> tuple | None:
    """A zero `LinearState` of `rows` rows per linear layer (None per attention layer), or
    None for a stack without linear layers: a cache's `linear` before any token."""
    if not config.has_linear_layers:
        return None
    return tuple(LinearState.zeros(config, rows) if kind == "linear" else None
                 for kind in config.layer_types)


class LayerUpdates(NamedTuple):
    """A `read_step`'s new entries of a stack with linear layers, one per layer: an
    attention layer's (k_BKH, v_BKH), a linear layer's `LinearState`, for
    `KVCache.commit`. (A stack without linear layers gives (k_LBKH, v_LBKH).)"""

    layers: tuple


def commit_layers(cache, updates: LayerUpdates, rows, slots, active_R):
    """`commit` of a stack with linear layers, either cache: each attention layer's
    (k_RKH, v_RKH) written at (rows, slots), each linear layer's `LinearState` taken for
    the active rows (all when `active_R` is None). Lengths are the caller's."""
    out, linear = cache, list(cache.linear)
    for layer, update in enumerate(updates.layers):
        if isinstance(update, LinearState):
            linear[layer] = update if active_R is None else jax.tree.map(
                lambda new, old: jnp.where(
                    active_R.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
                update, cache.linear[layer])
        else:
            out = out.replace(**written(out, layer, rows, slots, *update))
    return out.replace(linear=tuple(linear))


@flax.struct.dataclass
class KVCache:
    """Decoding state of a transformer decoder.

    Attributes:
        k: self-attention keys, per layer [B, K, S, H] (see the module docstring for the
            looped and scanned layouts).
        v: self-attention values, likewise.
        lengths: int32[B] filled slots per row (= the position of its next token).
        cross_k: cross-attention keys per layer [Bs, K, Ssrc, H], or None (decoder-only).
            Bs divides B: beams of one source share its rows (B = Bs * beams).
        cross_v: cross-attention values, likewise, or None.
        cross_mask: bool[Bs, Ssrc] True at real (non-padding) source tokens, or None.
        k_scale, v_scale: an int8 cache's scales per layer [B, K, S, 1] (k and v then
            int8); None in a float cache.
        linear: None, or with linear (Gated DeltaNet) layers one entry per layer: a
            linear layer's `models.gated_deltanet.LinearState` (its recurrent state and
            convolution window, the same size whatever the length), None for an
            attention layer. A linear layer's k and v have no heads.
    """

    k: Layers
    v: Layers
    lengths: Int[Array, " B"]
    cross_k: Layers | None = None
    cross_v: Layers | None = None
    cross_mask: Bool[Array, "Bs Ssrc"] | None = None
    k_scale: Layers | None = None
    v_scale: Layers | None = None
    linear: tuple | None = None

    @classmethod
    def create(cls, config: TransformerConfig, batch_size: int,
               cache_len: int | None = None, *, dtype: str = "auto") -> KVCache:
        """An empty cache of `cache_len` slots (default `config.max_len`) per row, in the
        layout of the config's stack: keys and values in the config's dtype ("auto"), or
        int8 with a scale per token per kv head ("int8", `models.cache_int8`).

        Raises:
            UserError: a size out of range, or a dtype not in `KV_CACHE_DTYPES`.
        """
        cache_len = config.max_len if cache_len is None else cache_len
        batch_size = check_positive_int(batch_size, "batch_size")
        if not is_int(cache_len) or not 1 <= cache_len <= config.max_len:
            raise UserError(
                f"cache_len={cache_len!r} must be an int in [1, max_len={config.max_len}]")
        return cls(**empty_self(config, batch_size, int(cache_len), dtype),
                   lengths=jnp.zeros((batch_size,), jnp.int32),
                   linear=linear_states(config, batch_size))

    @property
    def batch_size(self) -> int:
        return layer_shape(self.k)[0]

    @property
    def cache_len(self) -> int:
        return layer_shape(self.k)[2]

    def read(self, layer):
        """Keys and values of `layer` as [B, S, K, H]."""
        return read_kv(self, layer, _read)

    def as_cached(self, k_BTKH, v_BTKH):
        """New keys and values as a read gives them back once written
        (`models.cache_int8.as_cached`)."""
        return as_cached(self, k_BTKH, v_BTKH)

    def key_positions(self) -> Int[Array, "B S"]:
        """The position of each slot's key: slot s holds position s."""
        return jnp.broadcast_to(jnp.arange(self.cache_len, dtype=jnp.int32)[None, :],
                                (self.batch_size, self.cache_len))

    def row_visible(self) -> None:
        """Which slots each row may read beyond the causal rule: all of its own (None)."""
        return None

    def filled(self) -> Bool[Array, "B S"]:
        """The slots written so far: s < lengths[b]."""
        return self.key_positions() < self.lengths[:, None]

    def write(self, layer, k_BTKH, v_BTKH, positions_BT) -> KVCache:
        """Writes the new keys/values of `layer` at each row's `positions_BT`; positions
        past the last slot are not written (the padding of a block that ends there).

        A scatter of B*T slots: with the buffers donated (or carried by a loop) XLA updates
        them in place, so a step never copies the whole cache.
        """
        rows_BT = jnp.broadcast_to(jnp.arange(k_BTKH.shape[0], dtype=jnp.int32)[:, None],
                                   positions_BT.shape)
        return self.replace(**written(self, layer, rows_BT, positions_BT, k_BTKH, v_BTKH))

    def commit(self, new_kv, active_B=None) -> KVCache:
        """Writes one token per row, every layer's (k_LBKH, v_LBKH) from a `read_step`, at
        slot lengths[b], and advances the rows by one (only the `active_B` ones, when
        given); a slot past the end is not written.

            lengths [3, 1], active [True, False] -> slots 3 and 1 written, lengths [4, 1]
        """
        rows_B = jnp.arange(self.batch_size, dtype=jnp.int32)
        step = 1 if active_B is None else active_B.astype(jnp.int32)
        if isinstance(new_kv, LayerUpdates):
            return commit_layers(self, new_kv, rows_B, self.lengths, active_B).replace(
                lengths=self.lengths + step)
        k_LBKH, v_LBKH = new_kv
        return self.replace(**written(self, None, rows_B, self.lengths, k_LBKH, v_LBKH),
                            lengths=self.lengths + step)

    def take_rows(self, rows_B) -> KVCache:
        """Self-attention rows gathered by index (beam search's start duplicates a prompt's
        row this way); the cross-attention rows, one per source and shared by its beams,
        stay."""
        axis = 0 if isinstance(self.k, tuple) else 1

        def take(x):
            return jnp.take(x, rows_B, axis=axis)
        linear = None if self.linear is None else jax.tree.map(
            lambda x: jnp.take(x, rows_B, axis=0), self.linear)
        return self.replace(**map_self(take, self), linear=linear,
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
        k, v: per layer [Bs, K, W * S, H] (layouts as `KVCache`); slot w * S + s holds
            position s of region w.
        lengths: int32[Bs * W] filled positions per beam (= the position of its next token).
        origin: int32[Bs, W, S] the region holding each beam's position s.
        cross_k, cross_v, cross_mask: as in `KVCache` (one row per source).
        k_scale, v_scale: an int8 cache's scales, per layer [Bs, K, W * S, 1], or None.
        linear: as in `KVCache`, one state per beam (row r): a recurrent state cannot be
            shared by reference, so `reorder` gathers it by parent beam (it is the same
            size at any length, unlike the keys and values the table spares).
        beams: W (static).
    """

    k: Layers
    v: Layers
    lengths: Int[Array, " R"]
    origin: Int[Array, "Bs W S"]
    cross_k: Layers | None = None
    cross_v: Layers | None = None
    cross_mask: Bool[Array, "Bs Ssrc"] | None = None
    k_scale: Layers | None = None
    v_scale: Layers | None = None
    linear: tuple | None = None
    beams: int = flax.struct.field(pytree_node=False, default=1)

    @classmethod
    def from_cache(cls, cache: KVCache, beams: int) -> BeamKVCache:
        """The W beams of each row of `cache` (a prompt or a start token, prefilled once per
        source): the row becomes region 0 of its source, which every beam reads up to its
        length; regions 1 .. W-1 start empty."""
        W = check_positive_int(beams, "beams")
        Bs, _, S, _ = layer_shape(cache.k)
        if cache.cross_mask is not None and cache.cross_mask.shape[0] != Bs:
            raise UserError(f"a beam cache starts from one row per source; this cache has "
                            f"{Bs} rows for {cache.cross_mask.shape[0]} sources")

        def regions(x):
            pad = [(0, 0)] * x.ndim
            pad[-2] = (0, (W - 1) * S)
            return jnp.pad(x, pad)
        linear = None if cache.linear is None else jax.tree.map(
            lambda x: jnp.repeat(x, W, axis=0), cache.linear)
        return cls(**map_self(regions, cache), lengths=jnp.repeat(cache.lengths, W),
                   origin=_own_after(jnp.zeros((Bs, W, S), jnp.int32), cache.lengths),
                   cross_k=cache.cross_k, cross_v=cache.cross_v, cross_mask=cache.cross_mask,
                   linear=linear, beams=W)

    @property
    def batch_size(self) -> int:
        """Rows of the decoding batch: Bs * W beams."""
        return layer_shape(self.k)[0] * self.beams

    @property
    def cache_len(self) -> int:
        """S: positions per beam."""
        return self.origin.shape[-1]

    def read(self, layer):
        """Keys and values of `layer` as [Bs, W * S, K, H]: every region of a source, read
        by its W beams (the attention core's keys shared by several query rows)."""
        return read_kv(self, layer, _read)

    def as_cached(self, k_RTKH, v_RTKH):
        """New keys and values as a read gives them back once written
        (`models.cache_int8.as_cached`)."""
        return as_cached(self, k_RTKH, v_RTKH)

    def _slots(self, positions_RT):
        """(source rows, slots) of each beam's positions: slot w * S + s of row b."""
        Bs, W, S = self.origin.shape
        region_R1 = jnp.tile(jnp.arange(W, dtype=jnp.int32), Bs)[:, None]
        slots = jnp.where(positions_RT < S, region_R1 * S + positions_RT, W * S)
        rows = jnp.broadcast_to(jnp.repeat(jnp.arange(Bs, dtype=jnp.int32), W)[:, None],
                                positions_RT.shape)
        return rows, slots

    def write(self, layer, k_RTKH, v_RTKH, positions_RT) -> BeamKVCache:
        """Writes each beam's new keys/values of `layer` into its own region at
        `positions_RT`; positions past the last slot are not written."""
        rows, slots = self._slots(positions_RT)
        return self.replace(**written(self, layer, rows, slots, k_RTKH, v_RTKH))

    def commit(self, new_kv, active_R=None) -> BeamKVCache:
        """Writes each beam's new token, every layer's (k_LRKH, v_LRKH), into its own region
        at its length, and advances the beams (only the `active_R` ones, when given)."""
        rows, slots = self._slots(self.lengths[:, None])
        step = 1 if active_R is None else active_R.astype(jnp.int32)
        if isinstance(new_kv, LayerUpdates):
            return commit_layers(self, new_kv, rows[:, 0], slots[:, 0], active_R).replace(
                lengths=self.lengths + step)
        k_LRKH, v_LRKH = new_kv
        return self.replace(**written(self, None, rows[:, 0], slots[:, 0], k_LRKH, v_LRKH),
                            lengths=self.lengths + step)

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

    def filled(self) -> Bool[Array, "Bs WS"]:
        """The slots written so far: position s < the source's length, in every region
        (a source's beams share their length)."""
        Bs, W, _ = self.origin.shape
        return self.key_positions() < self.lengths.reshape(Bs, W)[:, :1]

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
        linear = None if self.linear is None else jax.tree.map(
            lambda x: jnp.take(x, (jnp.arange(Bs)[:, None] * W + parents_BW).reshape(-1),
                               axis=0), self.linear)
        return self.replace(origin=_own_after(origin, lengths.reshape(-1)),
                            lengths=lengths.reshape(-1), linear=linear)


def _own_after(origin_BWS, lengths):
    """Each beam's table with its own region from its length on (where it writes next).
    `lengths`: int32[Bs * W] per beam, or int32[Bs] shared by a source's beams."""
    Bs, W, S = origin_BWS.shape
    lengths_BW = lengths.reshape(Bs, -1)
    own_BW1 = jnp.arange(W, dtype=jnp.int32)[None, :, None]
    future_BWS = jnp.arange(S, dtype=jnp.int32)[None, None, :] >= lengths_BW[:, :, None]
    return jnp.where(future_BWS, own_BW1, origin_BWS)
