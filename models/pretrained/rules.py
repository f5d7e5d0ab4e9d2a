"""Rule builders: each part a checkpoint stores, turned into `Rule`s from the family's names.

A family module says where its tensors are (module names, the Hugging Face key of each part
without ".weight" / ".bias"); the builders know our parameter paths, the layout between the
two, and which parameters a config has:

    LAYER = Scope.layers("model.layers.{i}", "decoder")          # "model.layers.3.<name>"
    table = [*embeddings(cfg, tokens="model.embed_tokens"),
             *self_attention(cfg, LAYER, Attention.apart("self_attn.{}_proj")),
             *mlp(cfg, LAYER, Mlp(gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj")),
             *norm(cfg, LAYER, "input_layernorm", "self_attention_norm"),
             *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]

The parameters a config has are the layers' (`models.attention`, `models.layers`): q/k/v
biases when `use_bias` or `qkv_bias`, every other dense layer's bias when `use_bias`, a
norm's bias with LayerNorm (RMSNorm has none), token-type embeddings when
`num_token_types`. Weights are torch `nn.Linear`s ([out, in]) unless a builder is told
`conv1d=True` (GPT-2's [in, out]). The engine (`convert`) checks that a family's rules cover
every parameter of the model exactly once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from models.config import TransformerConfig
from models.errors import UserError
from models.pretrained.layouts import (
    FUSED_GATE_UP,
    FUSED_GATE_UP_BIAS,
    FUSED_QKV,
    FUSED_QKV_BIAS,
    LINEAR_FROM_HEADS,
    TRANSPOSE,
    Layout,
    bias_to_heads,
    conv1d as conv1d_layout,
    linear_to_heads,
    one,
)
from models.pretrained.mapping import Rule


@dataclasses.dataclass(frozen=True)
class Scope:
    """Where a part's tensors are: the file's key prefix, our path prefix, and the stack
    ("encoder" or "decoder") whose layers `{i}` runs over (None outside the stacks)."""

    theirs: str = ""
    ours: str = ""
    stack: str | None = None

    @classmethod
    def layers(cls, theirs: str, stack: str) -> Scope:
        """Each layer of `stack`: file keys under `theirs` ("model.layers.{i}"), ours under
        "{stack}/layer_{i}"."""
        return cls(f"{theirs}.", f"{stack}/layer_{{i}}/", stack)

    def rule(self, theirs: str | Sequence[str], ours: str | Sequence[str],
             layout: Layout | None = None) -> Rule:
        """A rule of names under this scope (each a name or a list of names)."""
        return Rule(_under(self.theirs, theirs), _under(self.ours, ours), layout,
                    stack=self.stack)


ROOT = Scope()                  # names outside the layers, as they are


def _under(prefix: str, names: str | Sequence[str]) -> list[str]:
    return [prefix + n for n in ([names] if isinstance(names, str) else names)]


@dataclasses.dataclass(frozen=True)
class Attention:
    """The module names of one attention block's projections under its scope: `q`, `k` and
    `v` apart, or `qkv` (one weight whose rows are q, then k, then v); `o` the output."""

    o: str
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None

    def __post_init__(self):
        if (self.qkv is None) == (None in (self.q, self.k, self.v)):
            raise TypeError(f"{self}: name q, k and v, or qkv")

    @classmethod
    def apart(cls, pattern: str, *, q: str = "q", k: str = "k", v: str = "v",
              o: str = "o") -> Attention:
        """Four names from one pattern: apart("self_attn.{}_proj", o="out") names
        self_attn.q_proj, self_attn.k_proj, self_attn.v_proj and self_attn.out_proj."""
        return cls(q=pattern.format(q), k=pattern.format(k), v=pattern.format(v),
                   o=pattern.format(o))


@dataclasses.dataclass(frozen=True)
class Mlp:
    """The module names of an MLP under its scope: `up` and `down`, and for a gated MLP
    `gate`, or `gate_up` in place of both (one weight whose rows are gate, then up)."""

    down: str
    up: str | None = None
    gate: str | None = None
    gate_up: str | None = None

    def __post_init__(self):
        if (self.up is None) == (self.gate_up is None) or (self.gate and self.gate_up):
            raise TypeError(f"{self}: name up (and gate), or gate_up")


def _stored(layout: Layout, conv1d: bool) -> Layout:
    return conv1d_layout(layout) if conv1d else layout


def linear(at: Scope, theirs: str, ours: str, *, bias: bool, conv1d: bool = False) -> list[Rule]:
    """A dense layer: `{theirs}.weight` <-> `{ours}/kernel` [in, out], and with `bias`
    `{theirs}.bias` <-> `{ours}/bias`."""
    table = [at.rule(f"{theirs}.weight", f"{ours}/kernel", _stored(TRANSPOSE, conv1d))]
    return table + ([at.rule(f"{theirs}.bias", f"{ours}/bias")] if bias else [])


def norm(cfg: TransformerConfig, at: Scope, theirs: str, ours: str) -> list[Rule]:
    """A norm: `{theirs}.weight` <-> `{ours}/scale`, and a LayerNorm's `{theirs}.bias` <->
    `{ours}/bias`."""
    table = [at.rule(f"{theirs}.weight", f"{ours}/scale")]
    return table + ([at.rule(f"{theirs}.bias", f"{ours}/bias")]
                    if cfg.norm == "layernorm" and cfg.norm_bias else [])


def final_norm(cfg: TransformerConfig, stack: str, theirs: str) -> list[Rule]:
    """The norm after a stack's last layer."""
    return norm(cfg, ROOT, theirs, f"{stack}/final_norm")


def embeddings(cfg: TransformerConfig, *, stack: str | None = None, tokens: str | None = None,
               positions: str | None = None, token_types: str | None = None,
               embedding_norm: str | None = None) -> list[Rule]:
    """The input embedding's tables, each an `nn.Embedding` [rows, D] like ours: the token
    table, learned positions, token types (when the config has them) and the norm on their
    sum. An encoder-decoder names the `stack` they feed ("encoder": the source side, whose
    token table the decoder shares unless `share_embeddings` is off)."""
    side = {"encoder": "src_", "decoder": "tgt_", None: ""}[stack]
    table = [Rule(f"{tokens}.weight", f"{side}tokens/embedding")] if tokens else []
    if positions:
        table.append(Rule(f"{positions}.weight", f"{side}embed/positions/embedding"))
    if token_types and cfg.num_token_types:
        table.append(Rule(f"{token_types}.weight", f"{side}embed/token_types/embedding"))
    if embedding_norm:
        table += norm(cfg, ROOT, embedding_norm, f"{side}embed/norm")
    return table


def relative_bias(stack: str, theirs: str) -> list[Rule]:
    """A stack's relative position bias table, an `nn.Embedding` [buckets, N] like ours."""
    return [Rule(f"{theirs}.weight", f"{stack}/relative_bias/embedding")]


def self_attention(cfg: TransformerConfig, at: Scope, names: Attention, *,
                   conv1d: bool = False) -> list[Rule]:
    """Self-attention: q, k and v (apart or fused) <-> `self_attention/{query,key,value}`
    kernels [D, heads, H] and biases [heads, H]; o <-> `self_attention/out` [N, H, D]."""
    return _attention(cfg, at, names, "self_attention", conv1d=conv1d, cross=False)


def cross_attention(cfg: TransformerConfig, at: Scope, names: Attention) -> list[Rule]:
    """A decoder layer's cross-attention: q and o as in `self_attention`, under
    `cross_attention/`; k and v <-> layer i's slice of the kernels (and biases) stacked
    over layers, `cross_kv/key_kernel[{i}]` and `cross_kv/value_kernel[{i}]`, which
    project the encoder output once for every layer before decoding."""
    if names.qkv is not None:
        raise TypeError("cross-attention reads its keys and values apart (q, k, v)")
    return _attention(cfg, at, names, "cross_attention", conv1d=False, cross=True)


def _attention(cfg: TransformerConfig, at: Scope, names: Attention, ours: str, *,
               conv1d: bool, cross: bool) -> list[Rule]:
    qkv_bias = cfg.use_bias or cfg.qkv_bias
    parts = (("query", "q", names.q), ("key", "kv", names.k), ("value", "kv", names.v))
    table = []
    if names.qkv is not None:
        table.append(at.rule(f"{names.qkv}.weight", [f"{ours}/{p}/kernel" for p, _, _ in parts],
                             _stored(FUSED_QKV, conv1d)))
        if qkv_bias:
            table.append(at.rule(f"{names.qkv}.bias", [f"{ours}/{p}/bias" for p, _, _ in parts],
                                 FUSED_QKV_BIAS))
    else:
        for proj, which, name in parts:
            scope, kernel, bias = at, f"{ours}/{proj}/kernel", f"{ours}/{proj}/bias"
            if cross and which == "kv":            # stacked over layers, outside the layer
                scope = dataclasses.replace(at, ours="")
                kernel, bias = f"cross_kv/{proj}_kernel[{{i}}]", f"cross_kv/{proj}_bias[{{i}}]"
            table.append(scope.rule(f"{name}.weight", kernel,
                                    _stored(linear_to_heads(which), conv1d)))
            if qkv_bias:
                table.append(scope.rule(f"{name}.bias", bias, bias_to_heads(which)))
    table.append(at.rule(f"{names.o}.weight", f"{ours}/out/kernel",
                         _stored(LINEAR_FROM_HEADS, conv1d)))
    return table + ([at.rule(f"{names.o}.bias", f"{ours}/out/bias")] if cfg.use_bias else [])


def mlp(cfg: TransformerConfig, at: Scope, names: Mlp, *, conv1d: bool = False) -> list[Rule]:
    """The MLP: gate (for a gated MLP), up and down, apart or with gate and up fused, <->
    `mlp/{gate,up,down}` kernels [in, out] and, with `use_bias`, biases."""
    table = []
    if names.gate_up is not None:
        table.append(at.rule(f"{names.gate_up}.weight", ["mlp/gate/kernel", "mlp/up/kernel"],
                             _stored(FUSED_GATE_UP, conv1d)))
        if cfg.use_bias:
            table.append(at.rule(f"{names.gate_up}.bias", ["mlp/gate/bias", "mlp/up/bias"],
                                 FUSED_GATE_UP_BIAS))
    for name, ours in ((names.gate, "mlp/gate"), (names.up, "mlp/up"), (names.down, "mlp/down")):
        if name is not None:
            table += linear(at, name, ours, bias=cfg.use_bias, conv1d=conv1d)
    return table


def untied_head(cfg: TransformerConfig, theirs: str = "lm_head") -> list[Rule]:
    """The output projection when it is not the tied embedding: an `nn.Linear` [V, D] <->
    `head/kernel` [D, V]; no rule when tied."""
    return [] if cfg.tie_embeddings else [Rule(f"{theirs}.weight", "head/kernel", TRANSPOSE)]


def _row(b, cfg):
    """[1, V] -> [V] (a UserError for any other shape)."""
    if b.ndim != 2 or b.shape[0] != 1:
        raise UserError(f"final_logits_bias of shape {b.shape}")
    return b[0]


def logits_bias(theirs: str) -> list[Rule]:
    """A bias added to the logits, stored as one row [1, V] (BART's and Marian's
    `final_logits_bias`) <-> `logits_bias` [V]."""
    return [Rule(theirs, "logits_bias", one(_row, lambda b, cfg: b[None, :]))]


def mlm_head(cfg: TransformerConfig, *, transform: str, transform_norm: str,
             bias: str) -> list[Rule]:
    """An encoder's masked-LM head: the transform (a dense layer with its bias), its norm,
    and the bias added to the tied embedding's logits (`bias`, a full key)."""
    return [*linear(ROOT, transform, "mlm_head/transform", bias=True),
            *norm(cfg, ROOT, transform_norm, "mlm_head/norm"), Rule(bias, "mlm_head/bias")]


def classifier(*, pooler: str, out: str) -> list[Rule]:
    """An encoder's sequence classifier: the pooler over the first token and the output
    layer (C rows), dense layers with biases."""
    return [*linear(ROOT, pooler, "classifier/pooler", bias=True),
            *linear(ROOT, out, "classifier/classifier", bias=True)]
