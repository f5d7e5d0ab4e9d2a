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
the decoder starts from `decoder_start_token_id`, which is pad (our `bos_id`; the pad id
when config.json omits it); eos is 0. `bos_token_id` (none, or 0 in older files) is never
read by the model and is written as null.

The position tables (`model.{encoder,decoder}.embed_positions.weight`) are functions of
max_position_embeddings and d_model. transformers does not save them
(`_keys_to_ignore_on_save`) and regenerates them when a file lacks them
(`_keys_to_ignore_on_load_missing`, then `_init_weights`), but a file that has them (older
checkpoints do) is loaded into the model, whose frozen embedding then uses the stored
values. So we regenerate them (`paper_sinusoid_table`), check a stored table against ours
(`Family.fixed`: equal to the file dtype's rounding, or the checkpoint is refused naming
the tensor) and, like transformers, never write them.

Older configs' mBART-style switches are accepted at Marian's values and refused by name
otherwise: normalize_before, add_final_layer_norm, add_bias_logits,
do_blenderbot_90_layernorm, normalize_embedding (False), static_position_embeddings (True);
extra_pos_embeddings (an offset of learned positions) means nothing for sinusoids.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.layers import paper_sinusoid_table
from models.pretrained import bart
from models.pretrained.family import ConfigReader, Family
from models.pretrained.mapping import Rule
from models.pretrained.rules import embeddings

POSITION_TABLES = tuple(f"model.{stack}.embed_positions.weight"
                        for stack in ("encoder", "decoder"))


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "marian")
    r.expect("normalize_embedding", False)
    r.expect("static_position_embeddings", True)
    r.take("extra_pos_embeddings", None)
    r.take("bos_token_id", None)               # no source start token: see the docstring
    fields = bart.read_common(r, default_act="gelu", default_eos=0)  # MarianConfig's defaults
    vocab = fields["vocab_size"]
    decoder_vocab = r.take("decoder_vocab_size", vocab)
    if decoder_vocab != vocab:
        r.refuse("decoder_vocab_size", decoder_vocab,
                 f"one vocabulary for source and target: vocab_size={vocab}")
    pad = r.take("pad_token_id", 58100)        # MarianConfig's default
    cfg = TransformerConfig(
        **fields, positions="sinusoidal_paper",
        share_embeddings=bool(r.take("share_encoder_decoder_embeddings", True)), pad_id=pad,
        bos_id=r.take("decoder_start_token_id", 58100))
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    hf = bart.common_to_hf(cfg, "marian", positions="sinusoidal_paper",
                           share_embeddings=cfg.share_embeddings)
    if cfg.activation == "silu":
        hf["activation_function"] = "swish"    # Marian's spelling (the same function)
    return {**hf, "decoder_vocab_size": cfg.vocab_size,
            "share_encoder_decoder_embeddings": cfg.share_embeddings, "bos_token_id": None}


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
