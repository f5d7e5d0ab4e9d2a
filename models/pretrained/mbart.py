"""`mbart` (MBartForConditionalGeneration: mBART-25, mBART-50 and their translation
fine-tunes): BART's attention and MLP layers, learned positions offset by 2 and the
LayerNorm on the embeddings (`layernorm_embedding`) as in BART, but pre-norm layers with a
final LayerNorm closing each stack (`model.{encoder,decoder}.layer_norm`), and
`final_logits_bias`. Layer drop (`encoder_layerdrop`, `decoder_layerdrop`: whole layers
skipped at random in training) changes no logits and is accepted with any value: training
here never drops layers.

Special ids: MBartConfig's `decoder_start_token_id` defaults to null, and transformers'
`generate` then starts the decoder from `bos_token_id`: reading takes that id as our decoder
start (`bos_id`), so a file without one decodes as transformers decodes it; mBART-50's
files name eos (2). The target language is the first token generated after the start
(`forced_bos_token_id`: generation_config.json's, the request's or `--forced-bos-id`); the
source's language code, which the tokenizer appends after its eos, is the tokenizer's
business. In teacher-forced training transformers' `shift_tokens_right` moves each label
row's last token (its language code) to the front instead of a fixed start token: a
fine-tuning run here starts each target from `bos_id`.

`final_logits_bias` is a buffer transformers fills with zeros when a file lacks it
(`_keys_to_ignore_on_load_missing`): such a file loads with zeros and a warning naming it.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained import bart
from models.pretrained.config_map import DECODER_START, ConfigMap, SpecialIds
from models.pretrained.family import ConfigReader, Family
from models.pretrained.mapping import Rule
from models.pretrained.rules import embeddings

MAP = ConfigMap(
    fields=bart.FIELDS,
    fixed={**bart.FIXED, "positions": "learned", "position_offset": 2, "embedding_norm": True,
           "share_embeddings": True, "norm_position": "pre"},
    constants=bart.CONSTANTS,
    # The mBART-style switches of BartConfig in transformers 3 (mbart-large-cc25's
    # config.json), at the values mBART computes with.
    accepted=dict(normalize_before=True, add_final_layer_norm=True, add_bias_logits=False,
                  do_blenderbot_90_layernorm=False, normalize_embedding=True,
                  static_position_embeddings=False, extra_pos_embeddings=2),
    unread=(*bart.UNREAD, "encoder_layerdrop", "decoder_layerdrop"),
    ids=SpecialIds(pad=1, eos=2, start=0, start_key=DECODER_START, source_bos="start"))


def config_from_hf(hf: dict) -> TransformerConfig:
    if hf.get(DECODER_START) is None:      # generate's fall-back: the decoder starts from bos
        hf = {**hf, DECODER_START: hf.get("bos_token_id", 0)}
    r = ConfigReader(hf, "mbart")
    cfg = TransformerConfig(**bart.read_common(r, MAP))
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    return bart.common_to_hf(cfg, "mbart", MAP)


def rules(cfg: TransformerConfig) -> list[Rule]:
    return bart.pre_norm_rules(cfg, lambda stack: embeddings(
        cfg, stack=stack, positions=f"model.{stack}.embed_positions",
        embedding_norm=f"model.{stack}.layernorm_embedding"))


LOGITS_BIAS = {"final_logits_bias": "the logits bias (zeros, as transformers makes it)"}

FAMILY = Family(model_type="mbart", architectures=("MBartForConditionalGeneration",),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
                prefix="model.", copies=bart.SHARED_COPIES, optional_heads=LOGITS_BIAS,
                ignored=(r"(model\.)?(encoder|decoder)\.version",))
