"""Several LoRA adapters served over one base (`serve.adapters`, `Engine(adapters=...)`).

Two adapters of different ranks, scales and targets (one adapts attention, the other the
MLP and, for an encoder-decoder, cross-attention) over a tiny base; requests naming either
one or none run in the same steps, and each gives the tokens and log-probs of `generate` on
the model with its own adapter alone (looped and scanned stacks, both families).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import decode
import models
import serve
from models.errors import UserError
from models.lora import LoraConfig, join
from models.pretrained import GenerationDefaults, Pretrained
from serve.engine import Engine
from tests.helpers import random_adapters, tiny

ADAPTERS = {
    "attention": LoraConfig(rank=2, alpha=6.0, targets=("query", "value")),
    "mlp": LoraConfig(rank=4, alpha=2.0, targets=("mlp", "cross_attention.key")),
}


def _base(family: str, scan_layers: bool) -> Pretrained:
    cfg = tiny(family, vocab_size=64, max_len=32, scan_layers=scan_layers, num_layers=2,
               num_encoder_layers=1, num_decoder_layers=2)
    model = models.build(cfg)
    z = np.zeros((1, 4), np.int32)
    params = model.init(jax.random.key(0), *((z,) if family == "decoder_only" else (z, z)))
    return Pretrained(model=model, config=cfg, params=params["params"], tokenizer=None,
                      generation=GenerationDefaults(), model_type=family)


def _adapters(cfg) -> dict:
    out = {}
    for seed, (name, lora) in enumerate(ADAPTERS.items()):
        targets = tuple(t for t in lora.targets
                        if cfg.is_encoder_decoder or not t.startswith("cross"))
        lora = LoraConfig(rank=lora.rank, alpha=lora.alpha, targets=targets)
        out[name] = (lora, random_adapters(cfg.replace(lora=lora), seed + 1))
    return out


@pytest.mark.parametrize("family, scan_layers", [("decoder_only", False),
                                                 ("decoder_only", True),
                                                 ("encoder_decoder", False)])
def test_requests_mixing_adapters_in_a_step_equal_each_adapter_alone(family, scan_layers):
    pre = _base(family, scan_layers)
    adapters = _adapters(pre.config)
    engine = Engine(pre, max_slots=4, page_size=4, num_pages=24, max_tokens_per_step=16,
                    prefill_chunk=4, adapters=adapters).start(warmup=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 64, size=n).tolist() for n in (5, 9, 3, 7, 6, 2)]
    names = [None, "attention", "mlp"] * 2
    request = decode.DecodeRequest(max_new_tokens=8, eos_id=None)
    handles = [engine.submit(serve.Submission(tuple(p), request, adapter=n))
               for p, n in zip(prompts, names, strict=True)]
    results = [h.result() for h in handles]
    engine.stop()
    for prompt, name, (_, ids, last) in zip(prompts, names, results, strict=True):
        cfg, params = pre.config, pre.params
        if name is not None:
            lora, tree = adapters[name]
            cfg, params = cfg.replace(lora=lora), join(pre.params, tree)
        p, n = decode.pad_prompts([prompt])
        out = decode.generate(models.build(cfg), params, p, n, max_new_tokens=8, eos_id=None)
        assert ids == out.tokens[0].tolist()
        np.testing.assert_allclose(last.logprobs, out.logprobs[0], atol=2e-5)
    # The adapters change what the model says (else this test could not fail).
    alone = [decode.generate(pre.model, pre.params, *decode.pad_prompts([p]), max_new_tokens=8,
                             eos_id=None).logprobs[0] for p in prompts[1:3]]
    assert not np.allclose(results[1][2].logprobs, alone[0], atol=1e-3)
    assert not np.allclose(results[2][2].logprobs, alone[1], atol=1e-3)


def test_adapter_names_are_checked():
    pre = _base("decoder_only", False)
    request = decode.DecodeRequest(max_new_tokens=4)
    with pytest.raises(UserError, match="adapter 'legal': this engine serves no adapters"):
        Engine(pre).submit(serve.Submission((5,), request, adapter="legal"))
    engine = Engine(pre, adapters=_adapters(pre.config))
    assert engine.adapters.names == ("attention", "mlp")
    with pytest.raises(UserError, match=r"adapter 'legal' is not one of the served adapters "
                                        r"\['attention', 'mlp'\]"):
        engine.submit(serve.Submission((5,), request, adapter="legal"))
    adapted = pre.config.replace(lora=ADAPTERS["attention"])
    with pytest.raises(UserError, match="the base carries an adapter already"):
        Engine(Pretrained(model=models.build(adapted), config=adapted, params=pre.params,
                          tokenizer=None, generation=GenerationDefaults(), model_type="x"),
               adapters=_adapters(pre.config))
