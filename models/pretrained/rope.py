"""RoPE settings in config.json, read and written for every family with rotary positions.

transformers v5 writes them as one `rope_parameters` dict; v4 files hold a top-level
`rope_theta` and a `rope_scaling` dict. Both spellings read to our `rope_theta`,
`rope_scaling` and `partial_rotary_factor` fields; writing uses v5's.

The kinds read (`rope_type`, or `type` as earlier v4 files spell it) and their keys:

    default   -
    linear    factor
    dynamic   factor (from max_position_embeddings on; see `DynamicRopeScaling`)
    llama3    factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    yarn      factor, original_max_position_embeddings, beta_fast, beta_slow,
              attention_factor, mscale, mscale_all_dim, truncate
    longrope  short_factor, long_factor, original_max_position_embeddings, factor,
              attention_factor

`original_max_position_embeddings` defaults to max_position_embeddings; given at the top
level of config.json (Phi-3 always has it, 4096 by default), it wins over the dict's, as
transformers reads it. A family passes `partial=True` when its class rotates part of each
head (Phi-3); elsewhere a `partial_rotary_factor` other than 1 is refused, since those
classes' rotation cannot compute it.
"""

from __future__ import annotations

from models.config import Llama3RopeScaling, TransformerConfig
from models.errors import UserError
from models.pretrained.family import ConfigReader, Inexpressible
from models.rope_scaling import (
    DynamicRopeScaling,
    LinearRopeScaling,
    LongRopeScaling,
    YarnRopeScaling,
)

ORIGINAL = "original_max_position_embeddings"
# kind -> (our class, {config.json key: our field}, keys transformers requires).
KINDS = {
    "linear": (LinearRopeScaling, {"factor": "factor"}, {"factor"}),
    "dynamic": (DynamicRopeScaling, {"factor": "factor"}, {"factor"}),
    "llama3": (Llama3RopeScaling, {
        "factor": "factor", "low_freq_factor": "low_freq_factor",
        "high_freq_factor": "high_freq_factor", ORIGINAL: "original_max_len"},
        {"factor", "low_freq_factor", "high_freq_factor"}),
    "yarn": (YarnRopeScaling, {
        "factor": "factor", ORIGINAL: "original_max_len", "beta_fast": "beta_fast",
        "beta_slow": "beta_slow", "attention_factor": "attention_factor", "mscale": "mscale",
        "mscale_all_dim": "mscale_all_dim", "truncate": "truncate"}, {"factor"}),
    "longrope": (LongRopeScaling, {
        "short_factor": "short_factor", "long_factor": "long_factor",
        ORIGINAL: "original_max_len", "factor": "factor",
        "attention_factor": "attention_factor"}, {"short_factor", "long_factor"}),
}


def read_rope(r: ConfigReader, max_len: int, *, partial: bool = False,
              aliases: dict | None = None, original: int | None = None) -> dict:
    """`rope_theta`, `rope_scaling` and `partial_rotary_factor` fields from either spelling
    of the RoPE settings. `aliases` maps other names of a kind to ours (Phi-3's "su");
    `original` is the family's default of a top-level original_max_position_embeddings
    (None: a top-level value is read only where config.json has one)."""
    v5, v4 = r.take("rope_parameters", None), r.take("rope_scaling", None)
    given = v5 if v5 is not None else v4 if v4 is not None else {}
    if not isinstance(given, dict) or any(isinstance(v, dict) for v in given.values()):
        r.refuse("rope_parameters", given, "one set of RoPE settings for every layer")
    params = dict(given)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    kind = (aliases or {}).get(kind, kind)
    theta = _one_value(r, "rope_theta", params.pop("rope_theta", None), 10_000.0)
    factor = _one_value(r, "partial_rotary_factor", params.pop("partial_rotary_factor", None),
                        1.0)
    if factor != 1.0 and not partial:
        r.refuse("partial_rotary_factor", factor, "RoPE over the whole head")
    top = r.take(ORIGINAL, original)
    scaling = None
    if kind in KINDS:
        scaling = _scaling(r, kind, params, given, max_len=max_len, top=top)
    elif kind != "default":
        r.refuse("rope_type", kind, f"supported: 'default', {', '.join(map(repr, KINDS))}")
    if params:
        r.refuse("rope_parameters", params, f"unknown for rope_type {kind!r}")
    return {"rope_theta": float(theta), "rope_scaling": scaling,
            "partial_rotary_factor": float(factor)}


def _scaling(r: ConfigReader, kind: str, params: dict, given: dict, *, max_len: int, top):
    cls, keys, required = KINDS[kind]
    missing = sorted(required - {k for k in params if params[k] is not None})
    if missing:
        r.refuse("rope_parameters", given, f"{kind} RoPE scaling needs {', '.join(missing)}")
    fields = {ours: params.pop(key) for key, ours in keys.items() if key in params}
    fields = {k: v for k, v in fields.items() if v is not None}      # null: the default
    if ORIGINAL in keys:
        fields["original_max_len"] = top if top is not None else fields.get(
            "original_max_len", max_len)
    if kind == "dynamic":
        fields["original_max_len"] = max_len         # transformers: max_position_embeddings
    if kind in ("yarn", "longrope") and "factor" not in fields:
        fields["factor"] = max_len / fields["original_max_len"]
    try:
        return cls(**fields)
    except UserError as e:
        r.refuse("rope_parameters", given, str(e))


def _one_value(r: ConfigReader, key: str, nested, default):
    """A RoPE setting given inside the RoPE dict, at the top level, or both (equal)."""
    top = r.take(key, None)
    if nested is not None and top is not None and nested != top:
        r.refuse(key, top, f"the RoPE settings say {nested!r}")
    return next(v for v in (nested, top, default) if v is not None)


def write_rope(cfg: TransformerConfig, *, partial: bool = False) -> dict:
    """The v5 `rope_parameters` of `cfg` (`Inexpressible` for a partial rotation without
    `partial`, or a dynamic scaling whose original length is not max_len)."""
    params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.partial_rotary_factor != 1.0:
        if not partial:
            raise Inexpressible(f"partial_rotary_factor={cfg.partial_rotary_factor} is not "
                                "expressible (RoPE over the whole head)")
        params["partial_rotary_factor"] = cfg.partial_rotary_factor
    s = cfg.rope_scaling
    if s is not None:
        kind = getattr(s, "kind", "llama3")
        if kind == "dynamic" and s.original_max_len != cfg.max_len:
            raise Inexpressible(f"dynamic RoPE scaling from {s.original_max_len} with max_len="
                                f"{cfg.max_len}: transformers scales from "
                                "max_position_embeddings")
        _, keys, _ = KINDS[kind]
        params["rope_type"] = kind
        for key, ours in keys.items():
            value = getattr(s, ours)
            if value is not None:
                params[key] = list(value) if isinstance(value, tuple) else value
    return {"rope_parameters": params}
