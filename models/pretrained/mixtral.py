"""`mixtral` (MixtralForCausalLM, Mixtral 8x7B and 8x22B): Mistral's attention (grouped
queries, RoPE, a sliding window or none) with a mixture-of-experts MLP in every layer
(`models.moe`): a router `block_sparse_moe.gate` [E, D] picks `num_experts_per_tok` of
`num_local_experts` SwiGLU experts, softmax over all experts then the top k renormalised.

Checkpoints (the published ones, and what transformers' `save_pretrained` writes) hold each
expert apart: `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up) and `w2` (down), torch
`nn.Linear`s; they are stacked into our [E, D, F] / [E, F, D] kernels on load and split on
save. `router_jitter_noise` (multiplicative noise on the router's input in training) must be
0; `output_router_logits` (whether the forward returns router logits) changes nothing here;
`router_aux_loss_coef` is the load-balancing loss's weight in training
(`TransformerConfig.router_aux_loss_coef`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.config import TransformerConfig
from models.pretrained import llama
from models.pretrained.config_map import ConfigMap, Field
from models.pretrained.family import ConfigReader, Inexpressible
from models.pretrained.layouts import TRANSPOSE, Layout
from models.pretrained.mapping import Rule
from models.pretrained.rules import (
    Scope,
    embeddings,
    final_norm,
    norm,
    self_attention,
    untied_head,
)

# The experts' weights, one `nn.Linear` [out, in] per expert <-> one kernel [E, in, out].
EXPERTS = Layout(lambda xs, cfg: [np.stack([w.T for w in xs])],
                 lambda ks, cfg: [w.T for w in ks[0]])
# MoE fields every mixture-of-experts family reads the same way (MixtralConfig's defaults).
MOE_FIELDS = (Field("num_experts_per_tok", "experts_per_token", 2),
              Field("router_aux_loss_coef", "router_aux_loss_coef", 0.001, float))


def with_moe(cmap: ConfigMap, **accepted) -> ConfigMap:
    """`cmap` that also accepts `output_router_logits` (any value) and `accepted`."""
    return dataclasses.replace(cmap, accepted={**cmap.accepted, **accepted},
                               unread=(*cmap.unread, "output_router_logits"))


MAP = with_moe(llama.config_map(Field("sliding_window", "sliding_window", None),
                                Field("num_local_experts", "num_experts", 8), *MOE_FIELDS,
                                use_bias=False, qkv_bias=False, router_renormalize=True,
                                expert_mlp_dim=None),
               router_jitter_noise=0.0)


# MixtralConfig's RoPE base when config.json names none.
DEFAULT_THETA = 1_000_000.0


def config_from_hf(hf: dict) -> TransformerConfig:
    if hf.get("rope_parameters") is None and hf.get("rope_theta") is None:
        hf = {**hf, "rope_theta": DEFAULT_THETA}
    r = ConfigReader(hf, "mixtral")
    return llama.common_config(r, MAP)


def require_experts(cfg: TransformerConfig, model_type: str) -> None:
    """Raises `Inexpressible` for a dense config: every layer of this type has experts."""
    if not cfg.num_experts:
        raise Inexpressible(f"{model_type} cannot express num_experts=0 (a dense MLP); "
                            "every layer of it is a mixture of experts")


def config_to_hf(cfg: TransformerConfig) -> dict:
    require_experts(cfg, "mixtral")
    return {**llama.common_to_hf(cfg, "mixtral", MAP), "router_jitter_noise": 0.0}


def experts(cfg: TransformerConfig, at: Scope, *, router: str, pattern: str,
            gate: str, up: str, down: str) -> list[Rule]:
    """A mixture-of-experts MLP: the router `nn.Linear` [E, D] <-> `mlp/router_kernel`
    [D, E], and each expert's gate, up and down (`pattern` formats the expert's index and
    the projection's name: "block_sparse_moe.experts.{e}.{name}") stacked <->
    `mlp/{gate,up,down}_kernel` [E, in, out]."""
    table = [at.rule(f"{router}.weight", "mlp/router_kernel", TRANSPOSE)]
    for ours, name in (("gate", gate), ("up", up), ("down", down)):
        theirs = [f"{pattern.format(e=e, name=name)}.weight" for e in range(cfg.num_experts)]
        table.append(at.rule(theirs, f"mlp/{ours}_kernel", EXPERTS))
    return table


def rules(cfg: TransformerConfig) -> list[Rule]:
    return [*embeddings(cfg, tokens="model.embed_tokens"),
            *self_attention(cfg, llama.LAYER, llama.ATTENTION),
            *experts(cfg, llama.LAYER, router="block_sparse_moe.gate",
                     pattern="block_sparse_moe.experts.{e}.{name}", gate="w1", up="w3",
                     down="w2"),
            *norm(cfg, llama.LAYER, "input_layernorm", "self_attention_norm"),
            *norm(cfg, llama.LAYER, "post_attention_layernorm", "mlp_norm"),
            *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]


FAMILY = llama.family("mixtral", "MixtralForCausalLM", config_from_hf, config_to_hf, rules)
