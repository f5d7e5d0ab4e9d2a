"""python -m bench.translate [--quick] [--shapes nllb-600m opus-mt] [--new-tokens N]

Translation against transformers on torch, on this machine, in one run: a batch of 16
sources (12 to 40 tokens each, right-padded) translated greedy and with beam search (4
beams) by a random model of each shape, ours (`decode.generate`, `decode.beam_search`,
jitted) and transformers' `generate` (torch, its default attention and KV cache), on the
same weights (ours saved with `models.save`, read back by transformers), the same sources
and the same number of new tokens: `min_new_tokens = max_new_tokens`, so every sentence is
as long in both and the two do the same work.

- `nllb-600m`: NLLB-200-distilled-600M's shape (`m2m_100`, the `nllb-200-600m` preset: D
  1024, 12+12 layers, 256,206 tokens);
- `opus-mt`: Helsinki-NLP/opus-mt-en-de's (`marian`: D 512, 6+6 layers, 58,101 tokens).

One JSON line per (shape, strategy): `ours_s` (the best of --repeats runs after the first,
which compiles: `first_call_s`), `theirs_s` (one run after a short warm-up run),
sentences per second of each, `speedup` (theirs_s / ours_s) and `agreement` (the fraction
of sentences whose tokens are equal: greedy must be 1.0 up to float32 near-ties; beam
search's best beam likewise).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import decode
import models
from models.pretrained import FAMILIES

SENTENCES = 16
BEAMS = 4
# Helsinki-NLP/opus-mt-en-de's config.json (the fields that change the computation).
OPUS_MT_EN_DE = dict(
    model_type="marian", vocab_size=58101, d_model=512, encoder_layers=6, decoder_layers=6,
    encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
    decoder_ffn_dim=2048, max_position_embeddings=512, scale_embedding=True,
    activation_function="swish", pad_token_id=58100, eos_token_id=0,
    decoder_start_token_id=58100, share_encoder_decoder_embeddings=True)


def _tiny(cfg: models.TransformerConfig) -> models.TransformerConfig:
    return cfg.replace(vocab_size=512, d_model=64, num_heads=4, num_kv_heads=4, head_dim=16,
                       mlp_dim=128,
                       num_encoder_layers=1, num_decoder_layers=1, max_len=64,
                       pad_id=min(cfg.pad_id, 511), bos_id=min(cfg.bos_id, 511))


def shapes(quick: bool, chosen) -> dict[str, tuple[str, models.TransformerConfig]]:
    """name -> (model_type, config)."""
    marian = FAMILIES["marian"].config_from_hf(dict(OPUS_MT_EN_DE))
    all_shapes = {"nllb-600m": ("m2m_100", models.get_config("nllb-200-600m")),
                  "opus-mt": ("marian", marian)}
    picked = {name: all_shapes[name] for name in chosen}
    if quick:
        return {f"tiny-{name}": (kind, _tiny(cfg)) for name, (kind, cfg) in picked.items()}
    return picked


def sources(cfg, quick: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """int32 [16, S] right-padded sources of random ordinary ids, each ending with eos, and
    their lengths."""
    rng = np.random.default_rng(seed)
    low, high = (3, 8) if quick else (12, 40)
    lengths = rng.integers(low, high + 1, SENTENCES)
    specials = {cfg.pad_id, cfg.eos_id, cfg.bos_id}
    src = np.full((SENTENCES, high), cfg.pad_id, np.int32)
    for row, n in enumerate(lengths):
        ids = rng.integers(4, cfg.vocab_size, n - 1)
        ids[np.isin(ids, list(specials))] = 5
        src[row, :n] = [*ids, cfg.eos_id]
    return src, lengths.astype(np.int32)


def ours(strategy: str, model, params, src, lengths, new: int):
    """int32 [16, new]: the best sequence's new tokens."""
    options = dict(max_new_tokens=new, min_new_tokens=new, eos_id=model.config.eos_id)
    if strategy == "greedy":
        return decode.generate(model, params, src, lengths, **options).tokens
    out = decode.beam_search(model, params, src, lengths, beam_size=BEAMS,
                             length_penalty=1.0, length_normalization="hf",
                             early_stopping=False, **options)
    return out.tokens[:, 0]


def theirs(strategy: str, hf_model, src, lengths, new: int) -> np.ndarray:
    import torch
    mask = np.arange(src.shape[1])[None, :] < lengths[:, None]
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=torch.as_tensor(src, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long), do_sample=False,
            num_beams=1 if strategy == "greedy" else BEAMS, max_new_tokens=new,
            min_new_tokens=new, length_penalty=1.0, early_stopping=False,
            no_repeat_ngram_size=0, repetition_penalty=1.0)
    return out[:, 1:].numpy()                         # without the decoder start token


def _best_of(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def lines(quick: bool, chosen, new: int, repeats: int):
    import torch
    import transformers
    torch.set_num_threads(os.cpu_count() or 1)
    for name, (model_type, cfg) in shapes(quick, chosen).items():
        model = models.build(cfg)
        dummy = jnp.ones((1, 4), jnp.int32)
        params = jax.jit(model.init)(jax.random.key(0), dummy, dummy)["params"]
        with tempfile.TemporaryDirectory() as path:
            models.save(path, cfg, params, model_type=model_type)
            hf_model = transformers.AutoModelForSeq2SeqLM.from_pretrained(path).eval()
        src, lengths = sources(cfg, quick)
        for strategy in ("greedy", "beam4"):
            run = functools.partial(ours, strategy, model, params, jnp.asarray(src),
                                    jnp.asarray(lengths), new)
            t0 = time.perf_counter()
            tokens = np.asarray(jax.block_until_ready(run()))
            first = time.perf_counter() - t0
            ours_s = _best_of(run, repeats)
            theirs(strategy, hf_model, src, lengths, 2)              # warm-up
            t0 = time.perf_counter()
            their_tokens = theirs(strategy, hf_model, src, lengths, new)
            theirs_s = time.perf_counter() - t0
            agree = float(np.mean(np.all(tokens == their_tokens, axis=1)))
            yield dict(section="translate", shape=name, model_type=model_type,
                       strategy=strategy, sentences=SENTENCES, new_tokens=new,
                       first_call_s=round(first, 3), ours_s=round(ours_s, 4),
                       theirs_s=round(theirs_s, 4),
                       ours_sentences_per_s=round(SENTENCES / ours_s, 2),
                       theirs_sentences_per_s=round(SENTENCES / theirs_s, 2),
                       speedup=round(theirs_s / ours_s, 3), agreement=agree)
        del model, params, hf_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.translate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny models of the same types, for the suite")
    parser.add_argument("--shapes", nargs="*", default=["nllb-600m", "opus-mt"],
                        choices=["nllb-600m", "opus-mt"], metavar="SHAPE",
                        help="nllb-600m, opus-mt (default both)")
    parser.add_argument("--new-tokens", type=int, default=32,
                        help="new tokens per sentence (default 32)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs of ours after the compiling one (default 2)")
    args = parser.parse_args(argv)
    if args.new_tokens < 1 or args.repeats < 1:
        parser.error(f"--new-tokens {args.new_tokens} and --repeats {args.repeats} must be "
                     ">= 1")
    print(json.dumps(dict(section="device", device=jax.devices()[0].device_kind,
                          cores=os.cpu_count(), jax=jax.__version__)), flush=True)
    for line in lines(args.quick, args.shapes, args.new_tokens, args.repeats):
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
