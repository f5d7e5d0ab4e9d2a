"""The two model families and their three call modes of one set of weights.

    forward  model.apply(v, tokens)                         -> logits_BTV      (training)
    prefill  model.apply(v, tokens_BT, lengths_B, cache, method="prefill")
                                                             -> logits_BTV, cache
    step     model.apply(v, tokens_B, cache, method="step") -> logits_BV, cache

Prefill writes a right-padded block of tokens at each row's `cache.lengths` and advances
that row by its own `lengths[b]`; step is prefill of one token per row. All three give the
same logits for the same tokens (tests/test_parity.py holds them to float32 tolerance).

Encoder-decoder models first build their cache from the source:
`cache = model.apply(v, src, cache_len, method="init_cache")` encodes it and projects every
decoder layer's cross-attention keys/values once.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from models import quant
from models.attention import CrossKVProjection
from models.audio import AudioEmbedding
from models.axes import XAVIER_UNIFORM, ZEROS, PlainInit, named
from models.blocks import DecoderLayer, LayerInputs, LayerStack, SelfAttentionLayer
from models.cache import KVCache, LayerUpdates, per_layer
from models.checks import (
    check_cache_room,
    check_int_array,
    check_new_lengths,
    check_same_shape,
    check_tokens,
)
from models.config import TransformerConfig
from models.encoder_only import EncoderOnly
from models.errors import UserError, check_positive_int
from models.gated_deltanet import LinearState
from models.layers import InputEmbedding, token_embedding
from models.masks import MaskSpec, positions_like, valid_from_lengths


def _causal_spec(config: TransformerConfig, q_index_BT, k_index_BS, **fields) -> MaskSpec:
    """The decoder's self-attention: causal over the indices, within the sliding window
    and the chunks when the config has them (each layer's kind may change both)."""
    return MaskSpec(q_index_BT, k_index_BS, causal=True, window=config.sliding_window,
                    chunk=config.attention_chunk_size, **fields)


def _forward_spec(config, tokens_BT, segment_ids_BT, positions_BT):
    """Positions (given or 0..T-1) and the causal (windowed, segment) description of a
    full sequence. Within a packed segment, index distances are position distances;
    chunks start at each sequence's first position, so the chunk rule reads positions."""
    index_BT = positions_like(tokens_BT)
    chunked = {}
    if positions_BT is not None and config.attention_chunk_size is not None:
        chunked = dict(q_position=positions_BT, k_position=positions_BT)
    positions_BT = index_BT if positions_BT is None else positions_BT
    return positions_BT, _causal_spec(config, index_BT, index_BT, q_segment=segment_ids_BT,
                                      k_segment=segment_ids_BT, aligned=True, **chunked)


class _CachedDecoder(nn.Module):
    """prefill / step over a `KVCache`, shared by both families; subclasses supply
    `_hidden(tokens_BT, *, positions_BT, spec, cache, deterministic, key_positions_BS,
    read_only)`, the last hidden states and the cache (key positions: the cache slots, for
    relative positions; `read_only`: the layers' new keys/values instead of the cache)."""

    config: TransformerConfig

    def _logits(self, x_BTD) -> Float[Array, "B T V"]:
        """float32 logits of the last hidden states: optionally scaled by D ** -0.5, then
        the tied embedding or the head, then optionally the logits bias, then optionally
        soft-capped (c * tanh(logits / c), `final_logit_softcapping`)."""
        cfg = self.config
        if cfg.scale_head_input:
            x_BTD = x_BTD * jnp.asarray(cfg.d_model ** -0.5, x_BTD.dtype)
        if cfg.tie_embeddings:
            logits = self.tgt_tokens.attend(x_BTD)
        else:
            logits = self.head(x_BTD)
        logits = logits.astype(jnp.float32)
        if cfg.logits_bias:
            logits = logits + self.logits_bias.astype(jnp.float32)[None, None, :]
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = jnp.tanh(logits / cap) * cap
        return logits

    def logits_from_hidden(self, x_BTD: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """The head alone (`_logits`): what the forward makes of `hidden`'s states. It
        reads only the parameters `head_param_names()` names."""
        return self._logits(x_BTD)

    def head_param_names(self) -> tuple[str, ...]:
        """The top-level parameter entries the head reads: the output table (the tied
        token embedding, or `head`) and the logits bias if any. Needs no binding."""
        cfg = self.config
        names = (self._TIED_TABLE,) if cfg.tie_embeddings else ("head",)
        return names + (("logits_bias",) if cfg.logits_bias else ())

    def _make_head(self):
        cfg = self.config
        if not cfg.tie_embeddings:
            self.head = quant.Dense(
                cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                kernel_init=named(XAVIER_UNIFORM, "embed", "vocab"))
        if cfg.logits_bias:
            self.logits_bias = self.param(
                "logits_bias", named(ZEROS, "vocab"), (cfg.vocab_size,),
                cfg.param_dtype)

    def prefill(
        self, tokens_BT: Int[Array, "B T"], lengths_B: Int[Array, " B"], cache: KVCache,
        logits_at: Int[Array, " B"] | None = None,
    ) -> tuple[Float[Array, "B T V"] | Float[Array, "B V"], KVCache]:
        """Runs a right-padded block of tokens through the decoder, writing the cache.

        Row b's tokens go to slots cache.lengths[b] .. cache.lengths[b] + T - 1 (positions
        likewise); only its first lengths[b] count, so afterwards
        cache.lengths[b] += lengths[b] and the padding is overwritten by the next tokens.
        Slots past the cache's end are not written (the padding of a row whose tokens end
        before them).

            cache.lengths = [0, 0], tokens = [[5 6 7], [5 0 0]], lengths = [3, 1]
            -> cache.lengths = [3, 1]; the next token of row 1 goes to slot 1.

        Args:
            logits_at: None for the logits of every token, or int32[B]: one index into
                each row's block whose logits alone are computed (its last real token,
                lengths[b] - 1, for the next token), so no [B, T, V] array is made.

        Returns:
            float32 logits_BTV (row b's next-token logits are at lengths[b] - 1), or
            logits_BV at `logits_at`; and the cache.
        """
        S = cache.cache_len
        check_tokens(self.config, tokens_BT, "tokens", max_len=S)
        check_int_array(lengths_B, "lengths", 1, "int[B]")
        B, T = tokens_BT.shape
        if lengths_B.shape != (B,) or cache.batch_size != B:
            raise UserError(
                f"batch sizes differ: tokens {tokens_BT.shape}, lengths {lengths_B.shape}, "
                f"cache batch {cache.batch_size}")
        check_new_lengths(lengths_B, T)
        check_cache_room(cache.lengths, lengths_B, S)
        positions_BT = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        keys_BS = cache.key_positions()               # a slot's position (beams: per region)
        visible = cache.row_visible()
        spec = _causal_spec(self.config, positions_BT, keys_BS,
                            visible=None if visible is None else visible[:, None, :])
        x_BTD, cache = self._hidden(tokens_BT, positions_BT=positions_BT, spec=spec,
                                    cache=cache, deterministic=True, key_positions_BS=keys_BS,
                                    lengths_B=lengths_B.astype(jnp.int32))
        cache = cache.replace(lengths=cache.lengths + lengths_B.astype(jnp.int32))
        if logits_at is None:
            return self._logits(x_BTD), cache
        x_B1D = jnp.take_along_axis(x_BTD, logits_at.astype(jnp.int32)[:, None, None], axis=1)
        return self._logits(x_B1D)[:, 0], cache

    def step(self, tokens_B: Int[Array, " B"],
             cache: KVCache) -> tuple[Float[Array, "B V"], KVCache]:
        """One token per row at slot cache.lengths[b]; returns the next-token logits. Each
        layer writes its slot, then reads (see `read_step` for a loop that may skip it)."""
        check_int_array(tokens_B, "tokens", 1, "int[B]")
        ones_B = jnp.ones(tokens_B.shape, jnp.int32)
        logits_B1V, cache = self.prefill(tokens_B[:, None], ones_B, cache)
        return logits_B1V[:, 0], cache

    def read_step(self, tokens_B: Int[Array, " B"],
                  cache: KVCache) -> tuple[Float[Array, "B V"], tuple]:
        """`step` without writing the cache: the next-token logits of one token per row at
        position cache.lengths[b], attending over the filled slots and itself, and the new
        keys and values of every layer, (k_LBKH, v_LBKH), for `cache.commit`. The same
        logits as `step` (to float rounding).

        A decoding loop that may skip the model call (`lax.cond`, once every row is done)
        reads the cache inside the skippable branch and commits outside it: a branch that
        updated the cache in place would make XLA copy the whole cache into it every step.
        The commit must come after the reads (there, the branch's outputs order them).
        """
        check_int_array(tokens_B, "tokens", 1, "int[B]")
        check_tokens(self.config, tokens_B[:, None], "tokens", max_len=cache.cache_len)
        if cache.batch_size != tokens_B.shape[0]:
            raise UserError(f"batch sizes differ: tokens {tokens_B.shape}, cache batch "
                            f"{cache.batch_size}")
        positions_B1 = cache.lengths[:, None]
        keys_BS = cache.key_positions()
        visible = cache.row_visible()
        spec = _causal_spec(self.config, positions_B1, keys_BS, k_valid=cache.filled(),
                            visible=None if visible is None else visible[:, None, :])
        x_B1D, new_kv = self._hidden(
            tokens_B[:, None], positions_BT=positions_B1, spec=spec, cache=cache,
            deterministic=True, key_positions_BS=keys_BS, read_only=True,
            lengths_B=jnp.ones(tokens_B.shape, jnp.int32))
        if isinstance(new_kv, LayerUpdates):        # linear layers: a state, not a slot
            return self._logits(x_B1D)[:, 0], LayerUpdates(tuple(
                u if isinstance(u, LinearState) else (u[0][:, 0], u[1][:, 0])
                for u in new_kv.layers))
        k_LB1KH, v_LB1KH = new_kv
        return self._logits(x_B1D)[:, 0], (k_LB1KH[:, :, 0], v_LB1KH[:, :, 0])


class DecoderOnly(PlainInit, _CachedDecoder):
    """A GPT/Llama-style causal language model."""

    _TIED_TABLE = "tokens"

    def setup(self):
        cfg = self.config
        self.tgt_tokens = token_embedding(cfg, "tokens")
        self.embed = InputEmbedding(cfg, self.tgt_tokens)
        self.decoder = LayerStack(cfg, SelfAttentionLayer, cfg.num_layers, causal=True)
        self._make_head()

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        *,
        segment_ids: Int[Array, "B T"] | None = None,
        positions: Int[Array, "B T"] | None = None,
        deterministic: bool = True,
    ) -> Float[Array, "B T V"]:
        """Teacher-forced logits of every position (packed rows: give segment_ids, with
        0 for padding, and per-segment positions)."""
        return self._logits(self.hidden(tokens, segment_ids=segment_ids, positions=positions,
                                        deterministic=deterministic))

    def hidden(
        self,
        tokens: Int[Array, "B T"],
        *,
        segment_ids: Int[Array, "B T"] | None = None,
        positions: Int[Array, "B T"] | None = None,
        deterministic: bool = True,
    ) -> Float[Array, "B T D"]:
        """The last hidden states the head reads (arguments as the forward's)."""
        check_tokens(self.config, tokens, "tokens")
        check_same_shape(segment_ids, tokens, "segment_ids", "tokens")
        check_same_shape(positions, tokens, "positions", "tokens")
        positions, spec = _forward_spec(self.config, tokens, segment_ids, positions)
        x_BTD, _ = self._hidden(tokens, positions_BT=positions, spec=spec, cache=None,
                                deterministic=deterministic)
        return x_BTD

    def _hidden(self, tokens_BT, *, positions_BT, spec, cache, deterministic,
                key_positions_BS=None, read_only=False, lengths_B=None):
        x_BTD = self.embed(tokens_BT, positions_BT, deterministic)
        inputs = LayerInputs(spec, positions_BT, key_positions=key_positions_BS,
                             deterministic=deterministic, read_only=read_only,
                             lengths=lengths_B)
        return self.decoder(x_BTD, inputs, cache)


class EncoderDecoder(PlainInit, _CachedDecoder):
    """A Vaswani/T5/BART-style sequence-to-sequence model. The decoder input starts with
    `config.bos_id` (targets shifted right). Source padding is given by `src_lengths`
    (right-padded rows) or segment ids (0 = padding), never by a pad id."""

    @property
    def _TIED_TABLE(self) -> str:
        return "src_tokens" if self.config.share_embeddings else "tgt_tokens"

    def setup(self):
        cfg = self.config
        if cfg.audio is None:
            self.src_tokens = token_embedding(cfg, "src_tokens")
            self.src_embed = InputEmbedding(cfg, self.src_tokens)
        else:                                   # features in, no source token table
            self.src_embed = AudioEmbedding(cfg)
        self.tgt_tokens = (
            self.src_tokens if cfg.share_embeddings else token_embedding(cfg, "tgt_tokens"))
        self.tgt_embed = InputEmbedding(cfg, self.tgt_tokens)
        self.encoder = LayerStack(cfg, SelfAttentionLayer, cfg.num_encoder_layers, causal=False)
        self.cross_kv = CrossKVProjection(cfg, cfg.num_decoder_layers)
        self.decoder = LayerStack(cfg, DecoderLayer, cfg.num_decoder_layers, causal=True)
        self._make_head()

    def encode(
        self,
        src: Int[Array, "B S"],
        *,
        lengths: Int[Array, " B"] | None = None,
        segment_ids: Int[Array, "B S"] | None = None,
        positions: Int[Array, "B S"] | None = None,
        deterministic: bool = True,
    ) -> Float[Array, "B S D"]:
        """The encoder output; padding (past `lengths`, or segment id 0) neither sees nor
        is seen. With `config.audio`, `src` is float features [B, M, F] and every one of
        the F / 2 encoder positions is real (`models.audio`)."""
        cfg = self.config
        if cfg.audio is not None:
            return self._encode_audio(src, lengths, segment_ids, positions, deterministic)
        check_tokens(cfg, src, "src")
        check_same_shape(segment_ids, src, "src_segment_ids", "src")
        check_same_shape(positions, src, "src_positions", "src")
        positions = positions_like(src) if positions is None else positions
        valid_BS = valid_from_lengths(src, lengths, "src_lengths")
        index_BS = positions_like(src)                  # for a sliding layer's window
        spec = MaskSpec(index_BS, index_BS, q_segment=segment_ids, k_segment=segment_ids,
                        q_valid=valid_BS, k_valid=valid_BS, aligned=True)
        x_BSD = self.src_embed(src, positions, deterministic)
        x_BSD, _ = self.encoder(x_BSD, LayerInputs(spec, positions, deterministic=deterministic))
        return x_BSD

    def _encode_audio(self, features_BMF, lengths, segment_ids, positions, deterministic):
        given = [name for name, value in (("src_lengths", lengths), ("src_segment_ids",
                 segment_ids), ("src_positions", positions)) if value is not None]
        if given:
            raise UserError(f"an audio encoder attends to every frame of its window and "
                            f"takes no {given} (pad or trim the audio instead)")
        x_BSD = self.src_embed(features_BMF, deterministic)
        positions_BS = positions_like(x_BSD[:, :, 0])
        valid_BS = jnp.ones(x_BSD.shape[:2], bool)
        spec = MaskSpec(q_valid=valid_BS, k_valid=valid_BS, aligned=True)
        x_BSD, _ = self.encoder(x_BSD, LayerInputs(spec, positions_BS,
                                                   deterministic=deterministic))
        return x_BSD

    def _source_valid(self, src, src_lengths):
        """bool[B, S] of the encoder positions that cross-attention reads."""
        audio = self.config.audio
        if audio is None:
            return valid_from_lengths(src, src_lengths, "src_lengths")
        return jnp.ones((src.shape[0], audio.max_source_positions), bool)

    def __call__(
        self,
        src: Int[Array, "B S"],
        tgt_in: Int[Array, "B T"],
        *,
        src_lengths: Int[Array, " B"] | None = None,
        src_segment_ids: Int[Array, "B S"] | None = None,
        tgt_segment_ids: Int[Array, "B T"] | None = None,
        src_positions: Int[Array, "B S"] | None = None,
        tgt_positions: Int[Array, "B T"] | None = None,
        deterministic: bool = True,
    ) -> Float[Array, "B T V"]:
        """Teacher-forced logits for decoder inputs `tgt_in` (BOS + targets[:-1]).

        Source padding: `src_lengths` for right-padded rows, or `src_segment_ids` (packed
        rows, 0 = padding); neither means every source token is real."""
        return self._logits(self.hidden(
            src, tgt_in, src_lengths=src_lengths, src_segment_ids=src_segment_ids,
            tgt_segment_ids=tgt_segment_ids, src_positions=src_positions,
            tgt_positions=tgt_positions, deterministic=deterministic))

    def hidden(
        self,
        src: Int[Array, "B S"],
        tgt_in: Int[Array, "B T"],
        *,
        src_lengths: Int[Array, " B"] | None = None,
        src_segment_ids: Int[Array, "B S"] | None = None,
        tgt_segment_ids: Int[Array, "B T"] | None = None,
        src_positions: Int[Array, "B S"] | None = None,
        tgt_positions: Int[Array, "B T"] | None = None,
        deterministic: bool = True,
    ) -> Float[Array, "B T D"]:
        """The decoder's last hidden states, which the head reads (arguments as the
        forward's)."""
        cfg = self.config
        check_tokens(cfg, tgt_in, "tgt_in")
        if tgt_in.shape[0] != src.shape[0]:
            raise UserError(f"batch sizes differ: src {src.shape}, tgt_in {tgt_in.shape}")
        check_same_shape(tgt_segment_ids, tgt_in, "tgt_segment_ids", "tgt_in")
        check_same_shape(tgt_positions, tgt_in, "tgt_positions", "tgt_in")
        if (src_segment_ids is None) != (tgt_segment_ids is None):
            raise UserError("give both src_segment_ids and tgt_segment_ids, or neither")
        encoded_BSD = self.encode(
            src, lengths=src_lengths, segment_ids=src_segment_ids, positions=src_positions,
            deterministic=deterministic)
        cross_k, cross_v = self.cross_kv(encoded_BSD, deterministic)
        cross_spec = MaskSpec(q_segment=tgt_segment_ids, k_segment=src_segment_ids,
                              k_valid=self._source_valid(src, src_lengths))
        positions, self_spec = _forward_spec(cfg, tgt_in, tgt_segment_ids, tgt_positions)
        x_BTD = self.tgt_embed(tgt_in, positions, deterministic)
        inputs = LayerInputs(self_spec, positions, cross_k, cross_v, cross_spec,
                             deterministic=deterministic)
        x_BTD, _ = self.decoder(x_BTD, inputs)
        return x_BTD

    def init_cache(self, src: Int[Array, "B S"], cache_len: int, beams: int = 1, *,
                   src_lengths: Int[Array, " B"] | None = None,
                   kv_cache_dtype: str = "auto") -> KVCache:
        """Encodes `src` once and returns an empty cache of `cache_len` decoder slots, with
        the cross-attention keys/values of every layer filled in.

        `src_lengths` are the right-padded sources' true lengths (None: no padding). With
        `beams` > 1 the self-attention part has B * beams rows (row b * beams + w is beam w
        of source b) while the cross-attention part keeps B rows, shared by beams.
        `kv_cache_dtype` is the self-attention part's (`KVCache.create`'s dtype: "auto" or
        "int8"); the cross-attention keys/values stay in the config's dtype.
        """
        beams = check_positive_int(beams, "beams")
        encoded_BSD = self.encode(src, lengths=src_lengths)
        cross_k, cross_v = self.cross_kv(encoded_BSD)
        cache = KVCache.create(self.config, src.shape[0] * beams, cache_len,
                               dtype=kv_cache_dtype)
        looped = not self.config.scan_layers                  # the cache's layout
        return cache.replace(cross_k=per_layer(cross_k, looped),
                             cross_v=per_layer(cross_v, looped),
                             cross_mask=self._source_valid(src, src_lengths))

    def _hidden(self, tokens_BT, *, positions_BT, spec, cache, deterministic,
                key_positions_BS=None, read_only=False, lengths_B=None):
        del lengths_B                      # read by linear layers, which are decoder-only
        if cache.cross_k is None:
            raise UserError("encoder-decoder cache has no cross-attention keys: build it "
                            "with model.apply(params, src, cache_len, method='init_cache')")
        # One source row for the beams that share it: the key side has Bs rows.
        cross_spec = MaskSpec(k_valid=cache.cross_mask)
        x_BTD = self.tgt_embed(tokens_BT, positions_BT, deterministic)
        inputs = LayerInputs(spec, positions_BT, cache.cross_k, cache.cross_v,
                             cross_spec, key_positions_BS, deterministic=deterministic,
                             read_only=read_only)
        return self.decoder(x_BTD, inputs, cache)


def build(config: TransformerConfig) -> nn.Module:
    """The linen module for `config`: `EncoderDecoder`, `DecoderOnly` or `EncoderOnly`."""
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"build() takes a TransformerConfig, got {type(config).__name__}")
    family = {"encoder_decoder": EncoderDecoder, "decoder_only": DecoderOnly,
              "encoder_only": EncoderOnly}
    return family[config.architecture](config)
