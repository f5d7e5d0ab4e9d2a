"""`m2m_100` (M2M100ForConditionalGeneration: M2M-100 and NLLB-200): BART's attention and
MLP layers, pre-norm (each sublayer's LayerNorm before it) with a final LayerNorm closing
each stack (`model.{encoder,decoder}.layer_norm`), no norm on the embeddings, sqrt(D)-scaled
embeddings (`scale_embedding`, true by default), no `final_logits_bias`, one table shared by
the encoder, the decoder and the tied head, and fairseq's sinusoidal positions: our
"sinusoidal" (sines then cosines, w_i = 10000 ** (-i / (D/2 - 1))) read at position
p + pad_token_id + 1 (`position_offset`), as transformers numbers the tokens after the pad
row of its table.

transformers numbers positions by counting the non-pad tokens before each one, we by the
token's index: the same for every token of a right-padded batch (a pad in the middle of a
row would shift its followers there; neither model reads a pad's output).

The position table (`embed_positions.weights`) is a buffer transformers never saves. The
target language is the decoder's first generated token (`forced_bos_token_id`, from
generation_config.json or the request); the tokenizer's source-language code is the
tokenizer's business. `encoder_layerdrop` / `decoder_layerdrop` (whole layers skipped at
random in training, 0.05 in the published files) change no logits and are accepted with
any value: training here never drops layers.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained import bart
from models.pretrained.config_map import DECODER_START, ConfigMap, Derived, Field, SpecialIds
from models.pretrained.family import ConfigReader, Family
from models.pretrained.mapping import Rule

# M2M100Config's defaults that differ from BartConfig's, for fields config.json omits.
DEFAULTS = {"activation_function": "relu", "attention_dropout": 0.1}
MAP = ConfigMap(
    fields=(*(f for f in bart.FIELDS if f.key != "scale_embedding"),
            Field("scale_embedding", "scale_embeddings", True, bool)),
    fixed={**bart.FIXED, "positions": "sinusoidal", "norm_position": "pre",
           "embedding_norm": False, "logits_bias": False, "share_embeddings": True,
           "position_offset": Derived(lambda cfg: (cfg.pad_id or 0) + 1)},
    constants=dict(is_encoder_decoder=True, tie_word_embeddings=True),
    unread=(*bart.UNREAD, "encoder_layerdrop", "decoder_layerdrop", "tokenizer_class",
            "max_length", "num_beams"),
    ids=SpecialIds(pad=1, eos=2, start=2, start_key=DECODER_START))


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader({**DEFAULTS, **hf}, "m2m_100")
    fields = bart.read_common(r, MAP)
    if fields["pad_id"] is None:
        r.refuse("pad_token_id", None, "the positions start after the pad id's row")
    cfg = TransformerConfig(**fields, position_offset=fields["pad_id"] + 1)
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    return bart.common_to_hf(cfg, "m2m_100", MAP)


def rules(cfg: TransformerConfig) -> list[Rule]:
    return bart.pre_norm_rules(cfg, logits_bias=False)


FAMILY = Family(model_type="m2m_100", architectures=("M2M100ForConditionalGeneration",),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
                prefix="model.", copies=bart.SHARED_COPIES,
                ignored=(r"(model\.)?(encoder|decoder)\.embed_positions\.weights",
                         r"(model\.)?(encoder|decoder)\.version"))
