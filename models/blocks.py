"""Transformer layers and the stack that runs them, looped or scanned.

A layer maps a carry `(x_BTD, cache, layer)` to the next one: the cache goes in and comes
back (None without one), `layer` is the index of the stacked cache slice it owns. The same
layer code therefore runs under a Python loop (static `layer`) and under `nn.scan` (traced
`layer`, parameters stacked over layers), and in both the cache buffers are carried and
updated in place, never sliced into per-layer outputs that would be copied every step.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from models.attention import CrossAttention, SelfAttention
from models.cache import LayerUpdates
from models.config import TransformerConfig
from models.errors import UserError
from models.gated_deltanet import GatedDeltaNet
from models.latent_attention import LatentSelfAttention
from models.layers import MLP, make_norm, residual
from models.masks import MaskSpec
from models.moe import ROUTER_COLLECTION, MoeMLP
from models.relative import RelativeBias, RelativePositionBias

# What a rematerialised layer keeps for its backward pass (`TransformerConfig.remat_policy`).
REMAT_POLICIES = {
    "full": None,                                 # nothing but the layer's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "names": jax.checkpoint_policies.save_only_these_names("attention_out", "mlp_in"),
}


@flax.struct.dataclass
class LayerInputs:
    """What every layer of a stack reads and nobody writes (broadcast under `nn.scan`).

    Attributes:
        self_spec: what each self-attention query sees (S = T without a cache).
        positions: int32[B, T] positions of the T tokens (for rotary and relative
            positions).
        key_positions: int32[B, S] positions of the self-attention keys (the cache slots
            when decoding), or None: the same tokens as the queries.
        cross_k, cross_v: cross-attention keys/values of all layers, [L, Bs, K, Ssrc, H]
            or a `KVCache`'s per-layer tuple, or None in a stack without cross-attention.
        cross_spec: what each cross-attention query sees of the source, or None.
        self_bias: the relative position bias of self-attention (the stack describes
            it), or None.
        deterministic: no dropout (static).
        read_only: a decoding step that reads the cache and returns each layer's new
            keys/values instead of writing them (static; see `SelfAttention`).
        lengths: int32[B] each row's real tokens of the T (the rest right padding) when
            decoding with a cache, else None: linear layers keep their state to them.
    """

    self_spec: MaskSpec
    positions: Int[Array, "B T"]
    cross_k: Float[Array, "L Bs K Ssrc H"] | tuple | None = None
    cross_v: Float[Array, "L Bs K Ssrc H"] | tuple | None = None
    cross_spec: MaskSpec | None = None
    key_positions: Int[Array, "B S"] | None = None
    self_bias: RelativeBias | None = None
    deterministic: bool = flax.struct.field(pytree_node=False, default=True)
    read_only: bool = flax.struct.field(pytree_node=False, default=False)
    lengths: Int[Array, " B"] | None = None


def _out_norm(cfg, name: str):
    """The norm of a sublayer's output (`sublayer_output_norm`), or None."""
    return make_norm(cfg, f"{name}_output_norm") if cfg.sublayer_output_norm else None


def _self_attention_sublayer(cfg, x_BTD, inputs: LayerInputs, cache, layer, *, kind=None,
                             normed: bool = True):
    """The residual self-attention sublayer; returns (x_BTD, cache), or with
    `inputs.read_only` (x_BTD, cache, the layer's new (k_BTKH, v_BTKH)). `kind`: the
    layer's `LayerKind` (`SelfAttention`); `normed` False: no norm before it."""
    attn = (LatentSelfAttention if cfg.latent else SelfAttention)(cfg, name="self_attention")
    x_BTD, out = residual(
        cfg, x_BTD,
        lambda y: attn(y, spec=inputs.self_spec, positions_BT=inputs.positions, cache=cache,
                       layer=layer, deterministic=inputs.deterministic, bias=inputs.self_bias,
                       read_only=inputs.read_only, kind=kind),
        make_norm(cfg, "self_attention_norm") if normed else (lambda y: y),
        deterministic=inputs.deterministic, out_norm=_out_norm(cfg, "self_attention"))
    return (x_BTD, cache, out) if inputs.read_only else (x_BTD, out, None)


def _linear_attention_sublayer(cfg, x_BTD, inputs: LayerInputs, cache, layer,
                               normed: bool = True):
    """The residual Gated DeltaNet sublayer of a "linear" layer (`models.gated_deltanet`),
    in the place of self-attention, with the same norms around it; returns
    `_self_attention_sublayer`'s triple. With a cache it starts from the layer's state
    there (`KVCache.linear`) and keeps it to each row's `inputs.lengths`: written into
    the cache, or with `inputs.read_only` returned in place of a slot's keys/values."""
    mixer = GatedDeltaNet(cfg, name="linear_attention")
    if cache is None:
        def sublayer(y):                        # packed rows: each sequence restarts
            return mixer(y, deterministic=inputs.deterministic,
                         segment_ids=inputs.self_spec.q_segment), None
    else:
        if inputs.lengths is None:
            raise UserError("a linear-attention layer decoding with a cache needs each row's "
                            "number of new tokens (LayerInputs.lengths)")

        def sublayer(y):
            return mixer(y, deterministic=inputs.deterministic, lengths_B=inputs.lengths,
                         state=cache.linear[layer])
    x_BTD, state = residual(
        cfg, x_BTD, sublayer,
        make_norm(cfg, "self_attention_norm") if normed else (lambda y: y),
        deterministic=inputs.deterministic, out_norm=_out_norm(cfg, "self_attention"))
    if cache is None or inputs.read_only:
        return x_BTD, cache, state
    linear = list(cache.linear)
    linear[layer] = state
    return x_BTD, cache.replace(linear=tuple(linear)), None


def _sliced_mlp(cfg):
    """The dense MLP ("mlp") over `cfg.mlp_chunks` slices of the sequence, so that its
    [B, T, F] activations are held one slice at a time in the backward pass (a long
    sequence's largest per-layer arrays once attention is chunked and the loss sliced);
    the same parameters and numbers as one call. In a rematerialised layer (`remat`) the
    layer's recomputation already frees each slice's activations before the next; without
    it each slice is rematerialised on its own. A sequence shorter than the slices (a
    decoding step) is one slice."""
    one = (MLP if cfg.remat else nn.remat(MLP, static_argnums=(2,)))(cfg, name="mlp")

    def call(x_BTD, deterministic):
        T = x_BTD.shape[1]
        n = min(cfg.mlp_chunks, T)
        ends = [T * i // n for i in range(n + 1)]
        return jnp.concatenate([one(x_BTD[:, a:b], deterministic)
                                for a, b in zip(ends, ends[1:], strict=False)], axis=1)
    return call


def _mlp_sublayer(cfg, x_BTD, inputs: LayerInputs, experts: bool | None = None):
    """The residual MLP sublayer: the dense MLP (over slices of the sequence with
    `mlp_chunks`), or with `num_experts` the mixture of experts (`models.moe`); `experts`
    says which for this layer (None: `num_experts`)."""
    experts = bool(cfg.num_experts) if experts is None else experts
    if experts:
        mlp = MoeMLP(cfg, name="mlp")
    elif cfg.mlp_chunks > 1:
        mlp = _sliced_mlp(cfg)
    else:
        mlp = MLP(cfg, name="mlp")
    x_BTD, _ = residual(cfg, x_BTD, lambda y: (mlp(y, inputs.deterministic), None),
                        make_norm(cfg, "mlp_norm"), deterministic=inputs.deterministic,
                        out_norm=_out_norm(cfg, "mlp"))
    return x_BTD


class SelfAttentionLayer(nn.Module):
    """Self-attention then MLP: an encoder layer (bidirectional mask) or a decoder-only
    layer (causal mask, optionally with a cache). `kind` is the layer's `LayerKind` (see
    `LayerStack`), else None; `experts` whether its MLP is the mixture (None: as
    `num_experts` says; `moe_layers` mixes them); `attention_norm` False: none before the
    attention (`first_attention_norm`); `linear` True: a Gated DeltaNet in the place of
    self-attention (a "linear" layer of `layer_types`; `kind` then unread)."""

    config: TransformerConfig
    experts: bool | None = None
    attention_norm: bool = True
    linear: bool = False

    @nn.compact
    def __call__(self, carry, inputs: LayerInputs, kind=None):
        x_BTD, cache, layer = carry
        sublayer = _linear_attention_sublayer if self.linear else functools.partial(
            _self_attention_sublayer, kind=kind)
        x_BTD, cache, new_kv = sublayer(self.config, x_BTD, inputs, cache, layer,
                                        normed=self.attention_norm)
        x_BTD = _mlp_sublayer(self.config, x_BTD, inputs, self.experts)
        return (x_BTD, cache, layer + 1), new_kv


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over the encoder output, then MLP; `kind`
    as `SelfAttentionLayer`'s."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, carry, inputs: LayerInputs, kind=None):
        cfg, det = self.config, inputs.deterministic
        x_BTD, cache, layer = carry
        x_BTD, cache, new_kv = _self_attention_sublayer(cfg, x_BTD, inputs, cache, layer,
                                                        kind=kind)
        cross = CrossAttention(cfg, name="cross_attention")
        k_BSKH = jnp.swapaxes(inputs.cross_k[layer], 1, 2)
        v_BSKH = jnp.swapaxes(inputs.cross_v[layer], 1, 2)
        x_BTD, _ = residual(
            cfg, x_BTD,
            lambda y: (cross(y, k_BSKH, v_BSKH, spec=inputs.cross_spec, deterministic=det), None),
            make_norm(cfg, "cross_attention_norm"), deterministic=det,
            out_norm=_out_norm(cfg, "cross_attention"))
        x_BTD = _mlp_sublayer(cfg, x_BTD, inputs)
        return (x_BTD, cache, layer + 1), new_kv


class LayerStack(nn.Module):
    """`num_layers` layers of one kind, then the final norm of a pre-norm stack.

    With `config.scan_layers` the layers run as one `nn.scan` (compiles once, parameters
    under "layers" with a leading L axis); otherwise as "layer_0" .. "layer_{L-1}".
    `config.remat` rematerialises each layer in the backward pass, keeping what
    `config.remat_policy` names (`REMAT_POLICIES`). It returns (x_BTD, cache); with
    `inputs.read_only`, (x_BTD, (k_LBTKH, v_LBTKH)): every layer's new keys/values, the
    cache unchanged. With relative positions the stack
    describes the position bias once ("relative_bias", bidirectional unless `causal`) and
    every layer adds it.

    With `config.layer_types` or `nope_layers` each layer learns its `LayerKind`
    (sliding, chunked, rotating): looped, as static Python bools; scanned, as bools scanned
    over the layers (one element a layer), so one compiled layer serves every kind. With
    `moe_layers` (looped only) each layer learns whether its MLP is the mixture, and with
    "linear" kinds (looped only) whether it is a Gated DeltaNet.
    """

    config: TransformerConfig
    layer_type: Any
    num_layers: int
    causal: bool

    @nn.compact
    def __call__(self, x_BTD, inputs: LayerInputs, cache=None):
        cfg = self.config
        if cfg.positions == "relative":
            keys = inputs.positions if inputs.key_positions is None else inputs.key_positions
            bias = RelativePositionBias(cfg, bidirectional=not self.causal,
                                        name="relative_bias")(inputs.positions, keys)
            inputs = inputs.replace(self_bias=bias)
        layer_type = self.layer_type
        kinds = cfg.layer_kinds()
        if cfg.remat:
            layer_type = nn.remat(layer_type, prevent_cse=not cfg.scan_layers,
                                  policy=REMAT_POLICIES[cfg.remat_policy],
                                  static_argnums=() if cfg.scan_layers or not kinds else (3,))
        if cfg.scan_layers:
            scanned = nn.scan(
                layer_type,
                variable_axes={"params": 0, "intermediates": 0, ROUTER_COLLECTION: 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=nn.broadcast if kinds is None else (nn.broadcast, 0),
                length=self.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            carry = (x_BTD, cache, jnp.zeros((), jnp.int32))
            per_layer_args = () if kinds is None else (
                jax.tree.map(lambda *flags: jnp.asarray(flags, bool), *kinds),)
            (x_BTD, cache, _), new_kv = scanned(cfg, name="layers")(carry, inputs,
                                                                    *per_layer_args)
        else:
            carry, per_layer = (x_BTD, cache, 0), []
            for i in range(self.num_layers):
                kind = () if kinds is None else (kinds[i],)
                mixed = dict(experts=cfg.layer_has_experts(i)) if cfg.moe_layers else {}
                if cfg.has_linear_layers:
                    mixed["linear"] = cfg.layer_types[i] == "linear"
                if i == 0 and not cfg.first_attention_norm:
                    mixed["attention_norm"] = False
                carry, layer_kv = layer_type(cfg, name=f"layer_{i}", **mixed)(carry, inputs,
                                                                               *kind)
                per_layer.append(layer_kv)
            x_BTD, cache, _ = carry
            if not inputs.read_only:
                new_kv = None
            elif cfg.has_linear_layers:       # a state or a slot each: not one stack
                new_kv = LayerUpdates(tuple(per_layer))
            else:
                new_kv = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
        if cfg.norm_position == "pre":
            x_BTD = make_norm(cfg, "final_norm")(x_BTD)
        return (x_BTD, new_kv) if inputs.read_only else (x_BTD, cache)
