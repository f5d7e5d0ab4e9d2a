"""`marian` (the Helsinki-NLP OPUS-MT models): BART's layers (`bart.layer_rules`: post-norm,
biases, `final_logits_bias`) with sinusoidal positions in Marian's layout (sines in the
first half of the channels, cosines in the second, the paper's frequencies, positions from
0: our "sinusoidal_paper"), no embedding norm, sqrt(D)-scaled embeddings in published
models, SiLU ("swish"), and a head tied to the decoder's embedding. The encoder and decoder
share one table (`share_encoder_decoder_embeddings`, stored as `model.shared.weight`) or
have one each (`model.encoder.embed_tokens.weight`, `model.decoder.embed_tokens.weight`);
either way source and target have one vocabulary (`decoder_vocab_size` must be
`vocab_size`).

Special ids: pad is the last vocabulary entry (58100 of 58101 in opus-mt-en-de), not 0;
the decoder starts from `decoder_start_token_id`, which is pad (our `bos_id`; MarianConfig's
default when config.json omits it is 58100, its default pad id too); eos is 0.
`bos_token_id` (none, or 0 in files written when MarianConfig took BartConfig's defaults)
is never read by the model and is written as null.

The position tables (`model.{encoder,decoder}.embed_positions.weight`) are functions of
max_position_embeddings and d_model. transformers does not save them
(`_keys_to_ignore_on_save`) and regenerates them when a file lacks them
(`_keys_to_ignore_on_load_missing`, then `_init_weights`), but a file that has them (files
saved before transformers listed them in `_keys_to_ignore_on_save` do) is loaded into the
model, whose frozen embedding then uses the stored values. So we regenerate them
(`paper_sinusoid_table`), check a stored table against ours (`Family.fixed`: equal to the
file dtype's rounding, or the checkpoint is refused naming the tensor) and, like
transformers, never write them.

BartConfig's mBART-style switches in config.json files of transformers 3 are accepted at
Marian's values and refused by name otherwise: normalize_before, add_final_layer_norm,
add_bias_logits, do_blenderbot_90_layernorm, normalize_embedding (False),
static_position_embeddings (True); extra_pos_embeddings (an offset of learned positions)
means nothing for sinusoids.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.layers import paper_sinusoid_table
from models.pretrained import bart
from models.pretrained.config_map import DECODER_START, ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Family
from models.pretrained.mapping import Rule
from models.pretrained.rules import embeddings

POSITION_TABLES = tuple(f"model.{stack}.embed_positions.weight"
                        for stack in ("encoder", "decoder"))


MAP = ConfigMap(
    fields=(*bart.FIELDS,
            Field("share_encoder_decoder_embeddings", "share_embeddings", True, bool)),
    fixed={**bart.FIXED, "positions": "sinusoidal_paper"},
    constants=bart.CONSTANTS,
    accepted={**bart.LEGACY, "normalize_embedding": False, "static_position_embeddings": True},
    unread=(*bart.UNREAD, "extra_pos_embeddings"),   # an offset of learned positions
    ids=SpecialIds(pad=58100, eos=0, start=58100, start_key=DECODER_START, source_bos="null"))


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "marian")
    fields = bart.read_common(r, MAP)
    vocab = fields["vocab_size"]
    decoder_vocab = r.take("decoder_vocab_size", vocab)
    if decoder_vocab != vocab:
        r.refuse("decoder_vocab_size", decoder_vocab,
                 f"one vocabulary for source and target: vocab_size={vocab}")
    cfg = TransformerConfig(**fields)
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    hf = bart.common_to_hf(cfg, "marian", MAP)
    if cfg.activation == "silu":
        hf["activation_function"] = "swish"    # Marian's spelling (the same function)
    return {**hf, "decoder_vocab_size": cfg.vocab_size}


def rules(cfg: TransformerConfig) -> list[Rule]:
    if cfg.share_embeddings:
        table = embeddings(cfg, stack="encoder", tokens="model.shared")
    else:
        table = [*embeddings(cfg, stack="encoder", tokens="model.encoder.embed_tokens"),
                 *embeddings(cfg, stack="decoder", tokens="model.decoder.embed_tokens")]
    return table + bart.layer_rules(cfg)


def position_tables(cfg: TransformerConfig) -> dict:
    table = paper_sinusoid_table(cfg.max_len, cfg.d_model)
    return dict.fromkeys(POSITION_TABLES, table)


FAMILY = Family(model_type="marian", architectures=("MarianMTModel",),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
                prefix="model.", fixed=position_tables,
                # Shared: every embedding and the head are the shared table; separate: the
                # head is the decoder's embedding.
                copies={**bart.SHARED_COPIES,
                        "model.decoder.embed_tokens.weight": ("lm_head.weight",)},
                ignored=(r"(model\.)?(encoder|decoder)\.version",))
