"""`gemma3_text` (Gemma3ForCausalLM): Gemma 2's layers plus an RMSNorm (1 + weight) over
each head's queries and keys before RoPE (`q_norm` / `k_norm`, our `qk_norm`), five sliding
layers to each full one by default (`layer_types`, or `sliding_window_pattern`), and a RoPE
of each kind: sliding layers rotate with `rope_local_base_freq` (unscaled, our
`rope_local_theta`), full layers with `rope_theta` and its scaling. No soft-capping unless
config.json asks for it: the output's (`final_logit_softcapping`); an attention soft-cap is
refused by name, since transformers' Gemma 3 attention ignores `attn_logit_softcapping`.

RoPE settings come as transformers v5's `rope_parameters` per kind ({"full_attention": ...,
"sliding_attention": ...}) or as v4's top-level `rope_theta`, `rope_scaling` (full layers)
and `rope_local_base_freq`. The full layers take any scaling `models.pretrained.rope` reads
(the published larger checkpoints' `linear` among them); a scaling of the sliding layers is
refused by name.
"""

from __future__ import annotations

import dataclasses

from models.config import TransformerConfig
from models.pretrained import gemma2, llama
from models.pretrained.config_map import ConfigMap
from models.pretrained.family import ConfigReader, Inexpressible
from models.pretrained.mapping import Rule
from models.pretrained.rope import read_rope, write_rope
from models.pretrained.rules import norm

FIELDS = tuple(dataclasses.replace(f, default=131_072) if f.key == "max_position_embeddings"
               else f for f in gemma2.FIELDS)
MAP = ConfigMap(fields=FIELDS, fixed={**gemma2.FIXED, "qk_norm": True},
                accepted=gemma2.MAP.accepted, unread=gemma2.MAP.unread, ids=gemma2.MAP.ids)
KINDS = ("full_attention", "sliding_attention")


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "gemma3_text")
    if r.take("attn_logit_softcapping", None) is not None:
        r.refuse("attn_logit_softcapping", hf["attn_logit_softcapping"], "transformers' "
                 "Gemma 3 attention does not apply it (its versions differ), so no number "
                 "here is the checkpoint's")
    pattern = r.take("sliding_window_pattern", None) or r.take("_sliding_window_pattern", 6)
    r.take("_sliding_window_pattern", None)
    rope = _read_rope(r, r.hf.get("max_position_embeddings", 131_072))
    return gemma2.common_config(r, MAP, softcaps=(None, None), pattern=pattern, rope=rope)


def _read_rope(r: ConfigReader, max_len: int) -> dict:
    """rope_theta, rope_scaling (full layers) and rope_local_theta (sliding layers)."""
    v5, v4 = r.take("rope_parameters", None), r.take("rope_scaling", None)
    theta, local = r.take("rope_theta", None), r.take("rope_local_base_freq", None)
    if v5 is not None:
        if not isinstance(v5, dict) or not set(v5) <= set(KINDS):
            r.refuse("rope_parameters", v5, f"one set of RoPE settings for each of {KINDS}")
        full, sliding = dict(v5.get(KINDS[0]) or {}), dict(v5.get(KINDS[1]) or {})
    else:
        full, sliding = dict(v4 or {}), {}
    full.setdefault("rope_theta", 1_000_000.0 if theta is None else theta)
    sliding.setdefault("rope_theta", 10_000.0 if local is None else local)
    ours = read_rope(ConfigReader({"rope_parameters": full}, r.model_type), max_len)
    local_rope = read_rope(ConfigReader({"rope_parameters": sliding}, r.model_type), max_len)
    if local_rope["rope_scaling"] is not None:
        r.refuse("rope_parameters", sliding, "sliding layers rotate unscaled")
    return {**ours, "rope_local_theta": local_rope["rope_theta"]}


def config_to_hf(cfg: TransformerConfig) -> dict:
    if cfg.attn_logit_softcapping is not None:
        raise Inexpressible(f"gemma3_text cannot express attn_logit_softcapping="
                            f"{cfg.attn_logit_softcapping} (its attention applies none)")
    if cfg.rope_local_theta is None:
        raise Inexpressible("gemma3_text cannot express rope_local_theta=None (its sliding "
                            "layers have a RoPE base of their own)")
    return {**gemma2.common_to_hf(cfg, "gemma3_text", MAP, rope_local_theta=cfg.rope_local_theta),
            "rope_parameters": {
                KINDS[0]: write_rope(cfg)["rope_parameters"],
                KINDS[1]: {"rope_type": "default", "rope_theta": cfg.rope_local_theta}}}


def rules(cfg: TransformerConfig) -> list[Rule]:
    return [*gemma2.rules(cfg),
            *norm(cfg, llama.LAYER, "self_attn.q_norm", "self_attention/query_norm"),
            *norm(cfg, llama.LAYER, "self_attn.k_norm", "self_attention/key_norm")]


FAMILY = llama.family("gemma3_text", "Gemma3ForCausalLM", config_from_hf, config_to_hf, rules)
