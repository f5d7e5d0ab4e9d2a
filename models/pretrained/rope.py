"""RoPE settings in config.json, read and written for every family with rotary positions.

transformers v5 writes them as one `rope_parameters` dict; v4 files hold a top-level
`rope_theta` and a `rope_scaling` dict. Both spellings read to our `rope_theta` and
`rope_scaling` fields; writing uses v5's.
"""

from __future__ import annotations

from models.config import Llama3RopeScaling, TransformerConfig
from models.pretrained.family import ConfigReader


def read_rope(r: ConfigReader, max_len: int) -> dict:
    """`rope_theta` and `rope_scaling` fields from either spelling of the RoPE settings:
    transformers v5's `rope_parameters` dict, or v4's top-level `rope_theta` plus a
    `rope_scaling` dict (its kind under `rope_type`, or `type` as earlier v4 files spell it)."""
    v5, v4 = r.take("rope_parameters", None), r.take("rope_scaling", None)
    params = v5 if v5 is not None else v4 if v4 is not None else {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        r.refuse("rope_parameters", params, "one set of RoPE settings for every layer")
    params = dict(params)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = _one_value(r, "rope_theta", params.pop("rope_theta", None), 10_000.0)
    partial = _one_value(r, "partial_rotary_factor", params.pop("partial_rotary_factor", None),
                         1.0)
    if partial != 1.0:
        r.refuse("partial_rotary_factor", partial, "RoPE over the whole head")
    scaling = None
    if kind == "llama3":
        try:
            scaling = Llama3RopeScaling(
                factor=params.pop("factor"), low_freq_factor=params.pop("low_freq_factor"),
                high_freq_factor=params.pop("high_freq_factor"),
                original_max_len=params.pop("original_max_position_embeddings", max_len))
        except KeyError as e:
            r.refuse("rope_parameters", v5 or v4, f"llama3 RoPE scaling needs {e}")
    elif kind != "default":
        r.refuse("rope_type", kind, "supported: 'default', 'llama3'")
    if params:
        r.refuse("rope_parameters", params, f"unknown for rope_type {kind!r}")
    return {"rope_theta": float(theta), "rope_scaling": scaling}


def _one_value(r: ConfigReader, key: str, nested, default):
    """A RoPE setting given inside the RoPE dict, at the top level, or both (equal)."""
    top = r.take(key, None)
    if nested is not None and top is not None and nested != top:
        r.refuse(key, top, f"the RoPE settings say {nested!r}")
    return next(v for v in (nested, top, default) if v is not None)


def write_rope(cfg: TransformerConfig) -> dict:
    params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        params.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                      high_freq_factor=s.high_freq_factor,
                      original_max_position_embeddings=s.original_max_len)
    return {"rope_parameters": params}
