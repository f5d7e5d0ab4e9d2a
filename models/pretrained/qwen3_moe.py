"""`qwen3_moe` (Qwen3MoeForCausalLM, Qwen3-30B-A3B and Qwen3-235B-A22B): Qwen3's attention
(an RMSNorm over each head's queries and keys before RoPE, no biases) with a
mixture-of-experts MLP in every layer (`models.moe`): a router `mlp.gate` [E, D] picks
`num_experts_per_tok` of `num_experts` SwiGLU experts of width `moe_intermediate_size`,
softmax over all experts then the top k, renormalised when `norm_topk_prob`.

Checkpoints hold each expert apart, `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`
(the published files and what transformers' `save_pretrained` writes), stacked into our
[E, D, F] / [E, F, D] kernels on load and split on save. transformers v5 saves the expert
count as `num_local_experts`, the published files as `num_experts`; either is read.

Refused by name: dense layers among the sparse ones (`decoder_sparse_step` other than 1,
a non-empty `mlp_only_layers`), since every layer of a stack has one MLP kind; and, as in
qwen3, attention biases. `intermediate_size` (the dense MLP's width, used by no layer then)
is kept as `mlp_dim`. A sliding window (`use_sliding_window`, `sliding_window`) holds for
every layer, as transformers v5 applies it; `max_window_layers`, which v5 ignores, is
accepted with any value.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained import llama, mixtral
from models.pretrained.config_map import Field
from models.pretrained.family import ConfigReader
from models.pretrained.mapping import Rule
from models.pretrained.rope import write_rope
from models.pretrained.rules import embeddings, final_norm, norm, self_attention, untied_head

MAP = mixtral.with_moe(llama.config_map(
    Field("moe_intermediate_size", "expert_mlp_dim", 768),
    Field("norm_topk_prob", "router_renormalize", False), *mixtral.MOE_FIELDS,
    use_bias=False, qkv_bias=False, qk_norm=True))
# Qwen3MoeConfig's defaults where config.json may omit a field that Llama's reader derives.
ABSENT = {"num_key_value_heads": 4}
DEFAULT_EXPERTS = 128


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader({**ABSENT, **hf}, "qwen3_moe")
    if r.take("attention_bias", False):
        r.refuse("attention_bias", hf["attention_bias"], "biases on the query, key, value and "
                 "output projections without the MLP's are not expressible")
    step = r.take("decoder_sparse_step", 1)
    if step != 1:
        r.refuse("decoder_sparse_step", step, "every layer a mixture of experts (1): dense "
                 "and sparse layers in one stack are not expressible")
    dense = r.take("mlp_only_layers", [])
    if dense:
        r.refuse("mlp_only_layers", dense, "every layer a mixture of experts ([]): dense and "
                 "sparse layers in one stack are not expressible")
    r.take("max_window_layers", None)
    window = r.take("sliding_window", None)
    if not r.take("use_sliding_window", False):
        window = None                             # transformers ignores it then
    return llama.common_config(r, MAP, num_experts=_num_experts(r), sliding_window=window)


def _num_experts(r: ConfigReader) -> int:
    """The expert count under either name (v5's `num_local_experts`, `num_experts`)."""
    local, named = r.take("num_local_experts", None), r.take("num_experts", None)
    if local is not None and named is not None and local != named:
        r.refuse("num_experts", named, f"it differs from num_local_experts={local}")
    return next((n for n in (local, named) if n is not None), DEFAULT_EXPERTS)


def config_to_hf(cfg: TransformerConfig) -> dict:
    mixtral.require_experts(cfg, "qwen3_moe")
    window = cfg.sliding_window
    return {**MAP.write(cfg, "qwen3_moe", num_experts=cfg.num_experts), "hidden_act": "silu",
            **write_rope(cfg), "attention_bias": False,
            "num_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_width,
            "decoder_sparse_step": 1, "mlp_only_layers": [],
            "use_sliding_window": window is not None, "sliding_window": window}


def rules(cfg: TransformerConfig) -> list[Rule]:
    layer = llama.LAYER
    return [*embeddings(cfg, tokens="model.embed_tokens"),
            *self_attention(cfg, layer, llama.ATTENTION),
            *norm(cfg, layer, "self_attn.q_norm", "self_attention/query_norm"),
            *norm(cfg, layer, "self_attn.k_norm", "self_attention/key_norm"),
            *mixtral.experts(cfg, layer, router="mlp.gate", pattern="mlp.experts.{e}.{name}",
                             gate="gate_proj", up="up_proj", down="down_proj"),
            *norm(cfg, layer, "input_layernorm", "self_attention_norm"),
            *norm(cfg, layer, "post_attention_layernorm", "mlp_norm"),
            *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]


FAMILY = llama.family("qwen3_moe", "Qwen3MoeForCausalLM", config_from_hf, config_to_hf, rules)
