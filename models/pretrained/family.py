"""What a model type module provides (`Family`), and reading a Hugging Face config.json
so that every field is either mapped, checked against the one value we support, known to
change nothing, or refused by name (`ConfigReader`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from models.config import TransformerConfig
from models.errors import UserError
from models.pretrained.files import Weights
from models.pretrained.generation import FIELDS as GENERATION_FIELDS
from models.pretrained.mapping import Rule


@dataclasses.dataclass(frozen=True)
class Family:
    """One `model_type`, both directions.

    Attributes:
        model_type: config.json's `model_type`.
        architectures: config.json's `architectures` when we write one (unless
            `config_to_hf` gives its own: BERT's class follows the config's head).
        config_from_hf: config.json (a dict) -> TransformerConfig; refuses by name what the
            project cannot compute.
        config_to_hf: TransformerConfig -> config.json fields; raises `Inexpressible` for a
            config the Hugging Face class cannot express.
        rules: the weight map of a config (see `mapping`).
        prefix: the base model's key prefix ("model.", "transformer."); files saved from
            the base model alone lack it, and are read all the same.
        ignored: regexes of file keys that are not weights (buffers) and are skipped.
        copies: tied tensors: a key of the rules -> the other keys transformers ties to it
            (BART's shared embedding is also each stack's `embed_tokens` and the head). A
            file may hold any of them; the rule reads the first there, and every other
            copy there must equal it bit for bit (transformers unties copies that differ,
            which a tied config cannot compute). Saving writes the rule's key only.
        fixed: tensors a file may hold that are functions of the config (Marian's
            sinusoids, which transformers regenerates when they are absent): config ->
            {key: array}. One that is there must equal the array (to its dtype's rounding)
            or the checkpoint is refused; they are never written.
        config_from_weights: None, or (config, the checkpoint's `Weights`) -> config, for
            what transformers settles from the tensors rather than config.json (T5: the
            head is tied unless the file holds a different `lm_head.weight`). Applied by
            `read_config`, so `load` and a fine-tuning run see the same config.
        renames: (regex, replacement) pairs applied with `re.sub`, in order, to every key
            of a file before anything else reads it: other spellings of the names the rules
            use (TF-converted BERT checkpoints' "LayerNorm.gamma" / "LayerNorm.beta" for
            ".weight" / ".bias"). Two keys of one file that rename to the same name are
            refused.
        optional_heads: a prefix of the rules' keys -> the head it holds ("cls.predictions."
            -> "the masked-LM head"). A file with none of the tensors under a prefix (a base
            model saved alone) loads with that head's parameters as the model initialises
            them (`mapping.initial_params`, key 0), and a `UserWarning` names what is
            missing; a file with some but not all of them is refused like any other.
        skipped: regexes of file keys that are weights of a head the config does not have
            (BERT's pooler under a masked-LM head, its next-sentence head): skipped when no
            rule reads them, and named in a `UserWarning` (unlike `ignored` buffers).
        skipped_layers: None, or a regex of file keys whose one group is a layer's index:
            those of layers at or past the config's `num_layers` are skipped as `skipped`
            are (DeepSeek-V3's multi-token-prediction layer, past the last).
    """

    model_type: str
    architectures: tuple[str, ...]
    config_from_hf: Callable[[dict], TransformerConfig]
    config_to_hf: Callable[[TransformerConfig], dict]
    rules: Callable[[TransformerConfig], list[Rule]]
    prefix: str = ""
    ignored: tuple[str, ...] = ()
    copies: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    fixed: Callable[[TransformerConfig], dict] | None = None
    config_from_weights: Callable[[TransformerConfig, Weights], TransformerConfig] | None = None
    renames: tuple[tuple[str, str], ...] = ()
    optional_heads: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: tuple[str, ...] = ()
    skipped_layers: str | None = None

    def is_ignored(self, key: str) -> bool:
        return any(re.fullmatch(p, key) for p in self.ignored)

    def is_skipped(self, key: str, config: TransformerConfig | None = None) -> bool:
        if any(re.fullmatch(p, key) for p in self.skipped):
            return True
        layer = re.fullmatch(self.skipped_layers, key) if self.skipped_layers else None
        return bool(layer and config is not None and int(layer.group(1)) >= config.num_layers)

    def rename(self, key: str) -> str:
        """A file's key under the name the rules use (`renames`)."""
        for pattern, replacement in self.renames:
            key = re.sub(pattern, replacement, key)
        return key


class Inexpressible(UserError):
    """A config that this model type's Hugging Face class cannot express."""


# Fields of Hugging Face's base config class (and of its earlier versions) that do not
# change what the model computes from its weights: bookkeeping, outputs, and generation
# defaults (read by `models.pretrained.generation`; the special ids, which
# `config_map.SpecialIds` reads).
HARMLESS = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "use_cache", "initializer_range", "_name_or_path", "name_or_path", "output_attentions",
    "output_hidden_states", "return_dict", "use_return_dict", "torchscript", "id2label",
    "label2id", "num_labels", "problem_type", "tokenizer_class", "prefix",
    "task_specific_params", "finetuning_task", "_attn_implementation",
    "attn_implementation", "_attn_implementation_autoset", "chunk_size_feed_forward",
    "pruned_heads", "tf_legacy_loss", "use_bfloat16", "_commit_hash",
    "keys_to_ignore_at_inference", "sep_token_id", "cross_attention_hidden_size",
    "tie_encoder_decoder", "decoder_start_token_id", "output_scores",
    "return_dict_in_generate", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "gradient_checkpointing", "is_decoder",
}) | (GENERATION_FIELDS - {"pad_token_id", "bos_token_id", "eos_token_id"})


REQUIRED = object()             # `ConfigReader.take`'s default: the key must be there


class ConfigReader:
    """Reads one config.json: every key must be taken, checked or known to be harmless.

        r = ConfigReader(hf, "llama")
        d = r.take("hidden_size")                    # required
        r.expect("attention_bias", False)            # only this value is supported
        cfg = TransformerConfig(...); r.finish()     # any key left over is refused by name
    """

    def __init__(self, hf: dict, model_type: str):
        self.hf, self.model_type = dict(hf), model_type
        self._seen = set(HARMLESS)

    def take(self, key: str, default=REQUIRED):
        """The value of `key`; a missing key (or null) is an error unless a default is
        given."""
        self._seen.add(key)
        if key in self.hf and self.hf[key] is not None:
            return self.hf[key]
        if default is REQUIRED:
            raise UserError(f"{self.model_type} config.json has no {key!r}")
        return default

    def expect(self, key: str, *supported) -> None:
        """`key` is absent, or one of `supported` (the first is its default)."""
        value = self.take(key, supported[0])
        if value not in supported:
            self.refuse(key, value, f"supported: {', '.join(map(repr, supported))}")

    def refuse(self, key: str, value, why: str) -> None:
        raise UserError(f"{self.model_type} config.json: {key}={value!r} is not supported "
                         f"({why})")

    def finish(self) -> None:
        left = sorted(set(self.hf) - self._seen)
        if left:
            shown = ", ".join(f"{k}={self.hf[k]!r}" for k in left[:8])
            raise UserError(
                f"{self.model_type} config.json has field(s) this project does not know, so "
                f"it cannot tell whether they change the computation: {shown}")


# The variants a family expresses only when it says so: `require` holds every other family
# to these values.
PLAIN = {"position_offset": 0, "embedding_norm": False, "scale_attention": True,
         "scale_head_input": False, "logits_bias": False, "mlp_dropout_rate": 0.0,
         "qk_norm": False, "norm_scale_offset": 0.0, "layer_types": (),
         "rope_local_theta": None, "attn_logit_softcapping": None,
         "final_logit_softcapping": None, "sublayer_output_norm": False,
         "query_pre_attn_scalar": None, "num_experts": 0, "audio": None,
         "attention_output_gate": False, "shared_expert_gate": False,
         "linear_num_key_heads": None, "linear_num_value_heads": None,
         "linear_key_head_dim": None, "linear_value_head_dim": None}


def require(cfg: TransformerConfig, model_type: str, **fields) -> None:
    """Raises `Inexpressible` naming the first field of `cfg` that differs from `fields`
    or, for a field not given, from its `PLAIN` value."""
    for name, value in {**PLAIN, **fields}.items():
        if getattr(cfg, name) != value:
            raise Inexpressible(f"{model_type} cannot express {name}={getattr(cfg, name)!r} "
                                f"(it has {value!r})")
