"""`qwen3_next` (Qwen3NextForCausalLM, Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet
layers and gated attention, with a mixture of experts and a gated shared expert.

- Layers: `layer_types` ("linear_attention", our "linear"; "full_attention", our
  "full"), or when absent every `full_attention_interval`-th layer full (4 by default)
  and the others linear. A linear layer is a Gated DeltaNet (`models.gated_deltanet`:
  `linear_num_key_heads` heads of `linear_key_head_dim` for queries and keys,
  `linear_num_value_heads` of `linear_value_head_dim` for values, a causal depthwise
  convolution of `linear_conv_kernel_dim`, the decay from `A_log` and `dt_bias`, the gated
  delta rule, an RMSNorm gated by silu(z)). A full layer is Qwen3's attention (an
  RMSNorm over each head's queries and keys, no biases) whose query projection also
  gives a gate per head: the output times sigmoid(gate) before `o_proj`
  (`attention_output_gate`); RoPE over the first `partial_rotary_factor` of each head
  (0.25 when config.json names none, as Qwen3NextConfig reads it).
- Norms: RMSNorms multiplying by (1 + weight) (`norm_scale_offset` 1), the q/k norms
  too; the linear layers' gated norm multiplies by its weight.
- MLP: `num_experts` SwiGLU experts of `moe_intermediate_size` in the layers
  `decoder_sparse_step` and `mlp_only_layers` leave sparse (every layer by default;
  dense SwiGLU of `intermediate_size` in the others: our `moe_layers`, looped only), a
  router `mlp.gate` (softmax, top `num_experts_per_tok`, renormalised with
  `norm_topk_prob`), and a shared expert of `shared_expert_intermediate_size` scaled by
  sigmoid(`mlp.shared_expert_gate`(x)) (`shared_expert_gate`).

Checkpoints hold the linear layers' projections fused and grouped by key head, as
transformers' `fix_query_key_value_ordering` reads them: `in_proj_qkvz` [K'(2H' + 2GE'),
D], each key head's rows its query (H'), key (H'), its G = N'/K' value heads' values
(GE') and gates (GE'); `in_proj_ba` [2N', D], each key head's rows its value heads' b
(G), then a (G). They split into our `query`, `key`, `value`, `gate`, `beta` and `decay`
kernels on load and join again on save; `conv1d.weight` [C, 1, W] is our `conv_kernel`
[C, W]; the gated `q_proj` [N 2H, D] (each head's query then its gate) is our query kernel
[D, N, 2H]. Each expert is apart (`mlp.experts.{e}.gate_proj`, ...), as the published
files and transformers' `save_pretrained` hold them. The published files'
multi-token-prediction tensors (`mtp.*`), which transformers does not load either, are
skipped with a warning naming them.

Decoding: the KV cache holds each linear layer's recurrent state and convolution window
(`KVCache.linear`, the same size at any length), so prefill, the cached steps, greedy and
sampled `generate`, and beam search (either beam cache: the states gathered by parent
beam) give transformers' numbers. The paged cache holds one state per serving slot, so
the serving engine decodes it too (each request's tokens alone). Speculative decoding,
which rolls a cache back by its lengths, reads the kept tokens again from the state
before the iteration (`decode.speculative.rolled_back`). Packed rows (training) restart
the state at each sequence's first token.

Refused by name: `hidden_act` other than silu, `attention_bias=True`, `layer_types`
other than linear and full attention, a config without expert layers, and (fields
Qwen3NextConfig does not read, which another Qwen's config may hold) a sliding window.
`max_window_layers` is accepted with any value (transformers' Qwen3-Next reads none).
"""

from __future__ import annotations

import numpy as np

from models.config import TransformerConfig
from models.config_checks import LINEAR_SHAPE
from models.errors import is_int
from models.pretrained import llama, mixtral
from models.pretrained.config_map import ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Family, Inexpressible
from models.pretrained.layouts import LINEAR_FROM_HEADS, Layout, linear_to_heads, one
from models.pretrained.mapping import Rule
from models.pretrained.rope import read_rope, write_rope
from models.pretrained.rules import (
    Scope,
    embeddings,
    final_norm,
    linear,
    mlp,
    norm,
    untied_head,
)

# Qwen3NextConfig's defaults where config.json may omit a field.
FIELDS = (
    Field("vocab_size", "vocab_size", 151936), Field("hidden_size", "d_model", 2048),
    Field("num_attention_heads", "num_heads", 16),
    Field("num_key_value_heads", "num_kv_heads", 2), Field("head_dim", "head_dim", 256),
    Field("intermediate_size", "mlp_dim", 5632), Field("num_hidden_layers", "num_layers", 48),
    Field("max_position_embeddings", "max_len", 32768),
    Field("rms_norm_eps", "norm_eps", 1e-6),
    Field("tie_word_embeddings", "tie_embeddings", False),
    Field("attention_dropout", "attention_dropout_rate", 0.0, float),
    Field("linear_num_key_heads", "linear_num_key_heads", 16),
    Field("linear_num_value_heads", "linear_num_value_heads", 32),
    Field("linear_key_head_dim", "linear_key_head_dim", 128),
    Field("linear_value_head_dim", "linear_value_head_dim", 128),
    Field("linear_conv_kernel_dim", "linear_conv_width", 4),
    Field("num_experts", "num_experts", 512),
    Field("num_experts_per_tok", "experts_per_token", 10),
    Field("moe_intermediate_size", "expert_mlp_dim", 512),
    Field("shared_expert_intermediate_size", "shared_expert_mlp_dim", 512),
    Field("norm_topk_prob", "router_renormalize", True),
    Field("router_aux_loss_coef", "router_aux_loss_coef", 0.001, float))
FIXED = dict(architecture="decoder_only", positions="rope", norm="rmsnorm", norm_position="pre",
             norm_scale_offset=1.0, activation="swiglu", use_bias=False, qkv_bias=False,
             qk_norm=True, attention_output_gate=True, shared_expert_gate=True,
             scale_embeddings=False, dropout_rate=0.0)
# Held to one value when written (fields a Qwen3-Next does not have; not in `PLAIN`).
ABSENT = dict(sliding_window=None, attention_chunk_size=None, attention_sinks=False,
              nope_layers=(), rope_interleaved=False, qk_l2_norm=False, kv_lora_rank=None,
              attn_temperature_floor=None, router_score="softmax", router_scales_input=False,
              router_groups=1, router_top_groups=1, router_score_bias=False,
              routed_scaling=1.0, first_attention_norm=True)
# `output_router_logits` (whether the forward returns them) and `max_window_layers` (which
# Qwen3NextConfig does not read) change nothing transformers computes.
MAP = ConfigMap(fields=FIELDS, fixed=FIXED,
                accepted=dict(attention_bias=False, use_sliding_window=False,
                              sliding_window=None),
                unread=("output_router_logits", "max_window_layers"), ids=SpecialIds())
KINDS = {"linear_attention": "linear", "full_attention": "full"}
THEIR_KINDS = {v: k for k, v in KINDS.items()}
DEFAULT_INTERVAL = 4
DEFAULT_PARTIAL_ROTARY = 0.25                 # Qwen3NextConfig's, when config.json has none


def config_from_hf(hf: dict) -> TransformerConfig:
    given = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if hf.get("partial_rotary_factor") is None and not (
            isinstance(given, dict) and given.get("partial_rotary_factor") is not None):
        hf = {**hf, "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY}
    r = ConfigReader(hf, "qwen3_next")
    act = r.take("hidden_act", "silu")
    if act != "silu":
        r.refuse("hidden_act", act, "Qwen3-Next's experts gate with silu (SwiGLU) and its "
                 "linear layers' convolution applies silu")
    mapped = MAP.read(r)
    layers = mapped["num_layers"]
    kinds = _kinds(r, layers)
    sparse = _sparse_layers(r, layers, mapped["num_experts"])
    ours = tuple(KINDS[k] for k in kinds)
    if "linear" not in ours:                  # the linear fields shape nothing then
        mapped.update(dict.fromkeys(LINEAR_SHAPE))
    cfg = TransformerConfig(
        **mapped, **read_rope(r, mapped["max_len"], partial=True),
        layer_types=ours if "linear" in ours else (),
        moe_layers=() if len(sparse) == layers else tuple(sparse))
    r.finish()
    return cfg


def _kinds(r: ConfigReader, layers: int) -> list[str]:
    """Their kind of each layer: `layer_types`, or from `full_attention_interval` (which
    transformers reads only when `layer_types` is absent)."""
    interval = r.take("full_attention_interval", DEFAULT_INTERVAL)
    kinds = r.take("layer_types", None)
    if kinds is None:
        if not is_int(interval) or interval < 1:
            r.refuse("full_attention_interval", interval, "a positive int")
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= set(KINDS):
        r.refuse("layer_types", kinds, f"one of {tuple(KINDS)} for each of the {layers} layers")
    return kinds


def _sparse_layers(r: ConfigReader, layers: int, experts: int) -> list[int]:
    """The layers with experts, as transformers picks them: not in `mlp_only_layers`, and
    (i + 1) a multiple of `decoder_sparse_step`."""
    step = r.take("decoder_sparse_step", 1)
    if not is_int(step) or step < 1:
        r.refuse("decoder_sparse_step", step, "a positive int")
    dense = r.take("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(is_int(i) and 0 <= i < layers for i in dense):
        r.refuse("mlp_only_layers", dense, f"a list of layer indices below {layers}")
    sparse = [i for i in range(layers)
              if i not in dense and experts > 0 and (i + 1) % step == 0]
    if not sparse:
        r.refuse("mlp_only_layers" if dense else "num_experts", dense or experts,
                 "a Qwen3-Next with expert layers")
    return sparse


def config_to_hf(cfg: TransformerConfig) -> dict:
    mixtral.require_experts(cfg, "qwen3_next")
    layers = cfg.num_layers
    kinds = cfg.layer_types or ("full",) * layers
    other = sorted(set(kinds) - set(THEIR_KINDS))
    if other:
        raise Inexpressible(f"qwen3_next cannot express layer_types {other} (its layers are "
                            "linear or full attention)")
    out = MAP.write(cfg, "qwen3_next", layer_types=cfg.layer_types, moe_layers=cfg.moe_layers,
                    **ABSENT)
    defaults = {f.key: f.default for f in FIELDS if f.ours in LINEAR_SHAPE}
    out.update({k: v for k, v in defaults.items() if out[k] is None})   # no linear layers
    rope = write_rope(cfg, partial=True)
    # Always written: absent, Qwen3NextConfig reads 0.25.
    rope["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    return {**out, **rope, "hidden_act": "silu", "attention_bias": False,
            "layer_types": [THEIR_KINDS[k] for k in kinds], "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(layers) if not cfg.layer_has_experts(i)]}


def _linear_sizes(cfg: TransformerConfig) -> tuple[int, int, int, int, int]:
    """(K', N', H', E', G): the linear layers' key and value heads, their widths, and the
    value heads per key head."""
    keys, values = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    return keys, values, cfg.linear_key_head_dim, cfg.linear_value_head_dim, values // keys


def _qkvz_to_ours(xs, cfg):
    """in_proj_qkvz [K'(2H' + 2GE'), D] -> query, key [D, K', H'], value, gate [D, N', E']."""
    keys, values, h, e, g = _linear_sizes(cfg)
    d = xs[0].shape[1]
    per_key = xs[0].T.reshape(d, keys, 2 * h + 2 * g * e)
    q, k, v, z = np.split(per_key, [h, 2 * h, 2 * h + g * e], axis=-1)
    return [q, k, v.reshape(d, values, e), z.reshape(d, values, e)]


def _qkvz_to_theirs(ks, cfg):
    keys, _, _, e, g = _linear_sizes(cfg)
    q, k, v, z = ks
    d = q.shape[0]
    per_key = np.concatenate([q, k, v.reshape(d, keys, g * e), z.reshape(d, keys, g * e)],
                             axis=-1)
    return [per_key.reshape(d, -1).T]


def _ba_to_ours(xs, cfg):
    """in_proj_ba [2N', D] -> beta (b), decay (a) [D, N']."""
    keys, values, _, _, g = _linear_sizes(cfg)
    d = xs[0].shape[1]
    per_key = xs[0].T.reshape(d, keys, 2 * g)
    return [per_key[..., :g].reshape(d, values), per_key[..., g:].reshape(d, values)]


def _ba_to_theirs(ks, cfg):
    keys, _, _, _, g = _linear_sizes(cfg)
    b, a = ks
    d = b.shape[0]
    per_key = np.concatenate([b.reshape(d, keys, g), a.reshape(d, keys, g)], axis=-1)
    return [per_key.reshape(d, -1).T]


QKVZ = Layout(_qkvz_to_ours, _qkvz_to_theirs)
BA = Layout(_ba_to_ours, _ba_to_theirs)
DEPTHWISE = one(lambda w, cfg: w[:, 0, :], lambda k, cfg: k[:, None, :])   # [C, 1, W] <-> [C, W]
VALUE_HEADS_OUT = one(                # out_proj [D, N'E'] <-> [N', E', D]
    lambda w, cfg: w.T.reshape(cfg.linear_num_value_heads, cfg.linear_value_head_dim, -1),
    lambda k, cfg: k.reshape(-1, k.shape[-1]).T)
GATED_QUERY = one(                    # q_proj [N 2H, D], each head's query then gate
    lambda w, cfg: w.T.reshape(w.shape[1], cfg.num_heads, 2 * cfg.head_dim),  # <-> [D, N, 2H]
    lambda k, cfg: k.reshape(k.shape[0], -1).T)
ROW = one(lambda w, cfg: w[0], lambda k, cfg: k[None, :])                   # [1, D] <-> [D]
LAYER = llama.LAYER


def _mixer(cfg: TransformerConfig, i: int) -> list[Rule]:
    """Layer i's Gated DeltaNet or gated attention."""
    if cfg.layer_types and cfg.layer_types[i] == "linear":
        at = Scope(f"model.layers.{i}.linear_attn.", f"decoder/layer_{i}/linear_attention/")
        return [at.rule("in_proj_qkvz.weight", ["query/kernel", "key/kernel", "value/kernel",
                                                "gate/kernel"], QKVZ),
                at.rule("in_proj_ba.weight", ["beta/kernel", "decay/kernel"], BA),
                at.rule("conv1d.weight", "conv_kernel", DEPTHWISE),
                at.rule("A_log", "decay_log_scale"), at.rule("dt_bias", "decay_bias"),
                at.rule("norm.weight", "output_norm/scale"),
                at.rule("out_proj.weight", "out/kernel", VALUE_HEADS_OUT)]
    at = Scope(f"model.layers.{i}.self_attn.", f"decoder/layer_{i}/self_attention/")
    return [at.rule("q_proj.weight", "query/kernel", GATED_QUERY),
            at.rule("k_proj.weight", "key/kernel", linear_to_heads("kv")),
            at.rule("v_proj.weight", "value/kernel", linear_to_heads("kv")),
            at.rule("o_proj.weight", "out/kernel", LINEAR_FROM_HEADS),
            at.rule("q_norm.weight", "query_norm/scale"),
            at.rule("k_norm.weight", "key_norm/scale")]


def _feed_forward(cfg: TransformerConfig, i: int) -> list[Rule]:
    """Layer i's experts (router, experts, the gated shared expert) or dense MLP."""
    at = Scope(f"model.layers.{i}.", f"decoder/layer_{i}/")
    if not cfg.layer_has_experts(i):
        return mlp(cfg, at, llama.MLP)
    shared = Scope(f"model.layers.{i}.mlp.shared_expert.", f"decoder/layer_{i}/mlp/shared_expert/")
    return [*mixtral.experts(cfg, at, router="mlp.gate", pattern="mlp.experts.{e}.{name}",
                             gate="gate_proj", up="up_proj", down="down_proj"),
            *(r for name in ("gate", "up", "down")
              for r in linear(shared, f"{name}_proj", name, bias=False)),
            at.rule("mlp.shared_expert_gate.weight", "mlp/shared_expert_gate", ROW)]


def rules(cfg: TransformerConfig) -> list[Rule]:
    return [*embeddings(cfg, tokens="model.embed_tokens"),
            *(r for i in range(cfg.num_layers) for r in _mixer(cfg, i)),
            *(r for i in range(cfg.num_layers) for r in _feed_forward(cfg, i)),
            *norm(cfg, LAYER, "input_layernorm", "self_attention_norm"),
            *norm(cfg, LAYER, "post_attention_layernorm", "mlp_norm"),
            *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]


FAMILY = Family(
    model_type="qwen3_next", architectures=("Qwen3NextForCausalLM",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules, prefix="model.",
    ignored=(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
    skipped=(r"mtp\..*",))
