"""`pegasus` (PegasusForConditionalGeneration: the PEGASUS summarisers): BART's attention
and MLP layers, pre-norm with a final LayerNorm closing each stack
(`model.{encoder,decoder}.layer_norm`), no norm on the embeddings, sqrt(D)-scaled
embeddings where `scale_embedding` says so (published files do), one table shared by both
stacks and the tied head, `final_logits_bias`, and Marian's sinusoidal positions
("sinusoidal_paper": sines in the first half of the channels, cosines in the second,
positions from 0).

The position tables (`model.{encoder,decoder}.embed_positions.weight`) are functions of
max_position_embeddings and d_model, which transformers saves and loads from the file. No
parameter of ours holds them: a file's table must equal ours (to its dtype's rounding) or
the checkpoint is refused naming the tensor; the loader keeps the file's tables
(`Pretrained.tables`) and `models.save` writes them back, or ours (equal to transformers'
bit for bit) when it is given none, so transformers finds every tensor it expects.

Special ids: pad 0, eos 1, and the decoder starts from pad (`decoder_start_token_id`, 0).
PegasusConfig has no `bos_token_id`: none is read or written. Layer drop changes no logits
and is accepted with any value (training here never drops layers). `final_logits_bias` is a
buffer transformers fills with zeros when a file lacks it: such a file loads with zeros and
a warning naming it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from models.config import TransformerConfig
from models.errors import UserError
from models.layers import paper_sinusoid_table
from models.pretrained import bart
from models.pretrained.config_map import DECODER_START, ConfigMap, SpecialIds
from models.pretrained.family import ConfigReader, Family
from models.pretrained.layouts import Layout
from models.pretrained.mapping import Rule
from models.pretrained.mbart import LOGITS_BIAS

MAP = ConfigMap(
    fields=bart.FIELDS,
    fixed={**bart.FIXED, "positions": "sinusoidal_paper", "norm_position": "pre",
           "embedding_norm": False, "share_embeddings": True},
    constants=bart.CONSTANTS,
    # BartConfig's switches in config.json files of transformers 3 (the published PEGASUS
    # files'), at the values PEGASUS computes with; an offset of learned positions means
    # nothing for sinusoids.
    accepted=dict(normalize_before=True, add_final_layer_norm=True, add_bias_logits=False,
                  do_blenderbot_90_layernorm=False, normalize_embedding=False,
                  static_position_embeddings=True),
    unread=(*bart.UNREAD, "encoder_layerdrop", "decoder_layerdrop", "extra_pos_embeddings"),
    ids=SpecialIds(pad=0, eos=1, start=0, start_key=DECODER_START))


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "pegasus")
    cfg = TransformerConfig(**bart.read_common(r, MAP))
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    return bart.common_to_hf(cfg, "pegasus", MAP)


def _position_table(key: str) -> Rule:
    """A stack's sinusoids: checked when read (no parameter holds them), written from the
    loaded table or as we compute them."""
    def check(xs, cfg):
        (stored,) = xs
        want = paper_sinusoid_table(cfg.max_len, cfg.d_model)
        tol = 2 * float(jnp.finfo(stored.dtype).eps)
        if stored.shape != want.shape or not np.allclose(
                stored.astype(np.float64), want.astype(stored.dtype).astype(np.float64),
                rtol=0, atol=tol):
            raise UserError(
                f"pegasus checkpoint: {key} (shape {stored.shape}) is not the sinusoid table "
                f"of max_position_embeddings={cfg.max_len}, d_model={cfg.d_model} (shape "
                f"{want.shape}); this project computes that table and cannot load another")
        return []

    return Rule(key, (), Layout(check, lambda ours, cfg: [
        paper_sinusoid_table(cfg.max_len, cfg.d_model).astype(cfg.param_dtype)]))


def rules(cfg: TransformerConfig) -> list[Rule]:
    return bart.pre_norm_rules(
        cfg, lambda stack: [_position_table(f"model.{stack}.embed_positions.weight")])


FAMILY = Family(model_type="pegasus", architectures=("PegasusForConditionalGeneration",),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
                prefix="model.", copies=bart.SHARED_COPIES, optional_heads=LOGITS_BIAS,
                ignored=(r"(model\.)?(encoder|decoder)\.version",))
