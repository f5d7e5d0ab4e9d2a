"""Pure-functional transformer models: configs, attention, layers, stacks, the KV cache.

    cfg = models.get_config("gpt-tiny", vocab_size=1000)
    model = models.build(cfg)
    params = model.init(key, tokens)["params"]
    logits = model.apply({"params": params}, tokens)

    pre = models.load("path/to/model_dir")          # a Hugging Face layout directory
    models.save("out_dir", pre.config, pre.params, pre.tokenizer)
    pre = models.load("model_dir", adapter="adapter_dir")  # a PEFT LoRA adapter (config.lora)
    models.save_adapter("adapter_dir", pre.config, pre.params)
    lora_config, adapters = models.read_adapter("adapter_dir", "model_dir")   # the adapter alone
    params = models.quantize(params, cfg, "int8")   # int8 or int4 projection kernels
"""

from models import axes, errors, lora
from models.attention import apply_rope, dot_product_attention, rope_frequencies
from models.cache import BeamKVCache, KVCache
from models.compile_cache import use_compile_cache
from models.config import Llama3RopeScaling, TransformerConfig
from models.encoder_only import EncoderOnly
from models.lora import LoraConfig
from models.masks import (
    MaskSpec,
    causal_mask,
    combine_masks,
    length_mask,
    padding_mask,
    positions_like,
    segment_mask,
    window_mask,
)
from models.prefill import prefill_in_chunks
from models.presets import get_config, list_configs
from models.pretrained import (
    GenerationDefaults,
    Pretrained,
    load,
    read_adapter,
    save,
    save_adapter,
)
from models.quant import Quantized
from models.quant_sites import quantize
from models.transformer import DecoderOnly, EncoderDecoder, build

__all__ = [
    "axes", "errors", "lora",
    "BeamKVCache", "DecoderOnly", "EncoderDecoder", "EncoderOnly", "KVCache",
    "Llama3RopeScaling", "LoraConfig", "TransformerConfig",
    "MaskSpec", "apply_rope", "build", "rope_frequencies",
    "causal_mask", "combine_masks", "dot_product_attention", "get_config", "list_configs",
    "padding_mask", "positions_like", "prefill_in_chunks", "segment_mask", "length_mask",
    "window_mask",
    "GenerationDefaults", "Pretrained",
    "load", "read_adapter", "save", "save_adapter", "use_compile_cache",
    "Quantized", "quantize",
]
