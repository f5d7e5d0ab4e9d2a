"""python -m bench.quantize [--quick] [--only bytes speed bleu] [--workdir RUN]

Quantized weights (`models.quantize`) against float32 and bfloat16, all measured in one run,
one JSON line per measurement:

- `bytes`: parameter bytes of each shape in each scheme over float32's, with the
  projections alone quantized (the default) and with the token tables and head too
  (`embeddings=True`), computed from abstract shapes (nothing is allocated).
- `speed`: decoding tokens per second (prefill included, best of `--repeats`) of float32,
  bfloat16 and each scheme, greedy and beam 4, at batch 16 and 1, on an opus-mt-shaped
  encoder-decoder (D 512, 6+6 layers, MLP 2048, V 32000, tied tables) and GPT-2-small- and
  Llama-1B-shaped decoders (greedy), each line with its ratio to float32 and to bfloat16.
  The quantized lines quantize the tables and head too: a step reads them all.
- `bleu`: a trained run's export (`--workdir`, default runs/default: `python -m train`
  makes it) translating its test split greedily in float32 and each scheme: corpus BLEU
  (sacrebleu), and the fraction of output tokens equal to float32's.

Shapes (`--only speed` lines name them): opus-mt  B16/B1, source 32, 32 new tokens;
gpt2-small  prompt 32, 32 new tokens; llama-1b  prompt 8, 8 new tokens. `--quick`: tiny
shapes and 8 tokens, for the suite.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp

import decode
import models
from models.errors import UserError
from models.quant import SCHEMES, nbytes

SECTIONS = ("bytes", "speed", "bleu")

OPUS_MT = dict(architecture="encoder_decoder", num_encoder_layers=6, num_decoder_layers=6,
               d_model=512, num_heads=8, mlp_dim=2048, vocab_size=32000, max_len=512,
               tie_embeddings=True, share_embeddings=True, activation="silu",
               positions="sinusoidal", norm_position="post", scale_embeddings=True)
GPT2_SMALL = dict(architecture="decoder_only", num_layers=12, d_model=768, num_heads=12,
                  mlp_dim=3072, vocab_size=50257, max_len=1024, positions="learned",
                  norm="layernorm", norm_position="pre", activation="gelu",
                  tie_embeddings=True)
LLAMA_1B = dict(architecture="decoder_only", num_layers=16, d_model=2048, num_heads=32,
                num_kv_heads=8, mlp_dim=8192, vocab_size=128256, max_len=2048,
                positions="rope", norm="rmsnorm", norm_position="pre", activation="swiglu",
                use_bias=False, tie_embeddings=True)
TINY = dict(architecture="encoder_decoder", num_encoder_layers=2, num_decoder_layers=2,
            d_model=128, num_heads=4, mlp_dim=256, vocab_size=1000, max_len=128,
            tie_embeddings=True, share_embeddings=True)
TINY_DECODER = dict(architecture="decoder_only", num_layers=2, d_model=128, num_heads=4,
                    mlp_dim=256, vocab_size=1000, max_len=128)


SHAPES = {"opus-mt": OPUS_MT, "gpt2-small": GPT2_SMALL, "llama-1b": LLAMA_1B}


def shapes(quick: bool, chosen=tuple(SHAPES)) -> dict[str, dict]:
    if quick:
        return {"tiny-seq2seq": TINY, "tiny-decoder": TINY_DECODER}
    return {name: SHAPES[name] for name in chosen}


def _config(fields: dict) -> models.TransformerConfig:
    return models.TransformerConfig(**fields)


def _init_args(cfg, batch: int, length: int):
    key = jax.random.key(0)
    tokens = jax.random.randint(key, (batch, length), 3, cfg.vocab_size)
    return (tokens, tokens[:, :1]) if cfg.is_encoder_decoder else (tokens,)


def group_for(cfg) -> int:
    """int4's group: 128, or the largest power of two below it that divides every
    projection's inputs (a tiny shape's D of 64)."""
    widths = {cfg.d_model, cfg.mlp_dim, cfg.num_heads * cfg.head_dim}
    return next(g for g in (128, 64, 32, 16, 8, 4, 2) if all(w % g == 0 for w in widths))


def quantized(params, config, scheme: str, *, embeddings: bool):
    return models.quantize(params, config, scheme, group=group_for(config),
                           embeddings=embeddings)


def bytes_lines(quick: bool, chosen):
    for name, fields in shapes(quick, chosen).items():
        cfg = _config(fields)
        model = models.build(cfg)
        abstract = jax.eval_shape(lambda *a, m=model: m.init(jax.random.key(0), *a)["params"],
                                  *_init_args(cfg, 1, 8))
        floats = nbytes(abstract)
        line = dict(section="bytes", shape=name, float32_bytes=floats,
                    params=sum(math.prod(x.shape) for x in jax.tree.leaves(abstract)))
        for scheme in SCHEMES:
            if scheme == "w8a8":          # int8's bytes exactly
                continue
            for embeddings in (False, True):
                q = jax.eval_shape(functools.partial(
                    quantized, config=cfg, scheme=scheme, embeddings=embeddings), abstract)
                key = f"{scheme}{'_all' if embeddings else ''}_over_float32"
                line[key] = round(nbytes(q) / floats, 4)
        print(json.dumps(line), flush=True)


def _timed(fn, repeats: int) -> float:
    jax.block_until_ready(fn())                                   # compile, and one run
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def variants(cfg, params):
    """(name, model, params) of float32, bfloat16 and each scheme."""
    model = models.build(cfg)
    yield "float32", model, params
    half = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
    yield "bfloat16", models.build(half), jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                       params)
    for scheme in SCHEMES:
        yield scheme, model, quantized(params, cfg, scheme, embeddings=True)


def _decode(strategy: str, model, params, prompts, lengths, new: int):
    if strategy == "greedy":
        return decode.generate(model, params, prompts, lengths, max_new_tokens=new,
                               eos_id=None).tokens
    return decode.beam_search(model, params, prompts, lengths, beam_size=4,
                              max_new_tokens=new, eos_id=None).tokens


def speed_lines(quick: bool, repeats: int, chosen):
    cases = []
    for name, fields in shapes(quick, chosen).items():
        cfg = _config(fields)
        seq2seq = cfg.is_encoder_decoder
        new = prompt = 8 if quick or name == "llama-1b" else 32
        strategies = ("greedy", "beam4") if seq2seq else ("greedy",)
        batches = ((2,) if seq2seq else (1,)) if quick else (16, 1)   # quick: each path once
        for batch in batches:
            cases.append((name, cfg, batch, prompt, new, strategies))
    for name, cfg, batch, prompt, new, strategies in cases:
        prompts = _init_args(cfg, batch, prompt)[0]
        lengths = jnp.full((batch,), prompts.shape[1], jnp.int32)
        model = models.build(cfg)
        params = jax.jit(model.init)(jax.random.key(0), *_init_args(cfg, 1, 8))["params"]
        for strategy in strategies:
            seen = {}
            for variant, m, p in variants(cfg, params):
                run = functools.partial(_decode, strategy, m, p, prompts, lengths, new)
                seconds = _timed(run, repeats if strategy == "greedy" else 1)
                rate = batch * new / seconds
                seen[variant] = rate
                line = dict(section="speed", shape=name, strategy=strategy, batch=batch,
                            new_tokens=new, variant=variant, decode_s=round(seconds, 4),
                            new_tokens_per_s=round(rate, 1),
                            over_float32=round(rate / seen["float32"], 3))
                if "bfloat16" in seen:
                    line["over_bfloat16"] = round(rate / seen["bfloat16"], 3)
                print(json.dumps(line), flush=True)
            del seen


def bleu_lines(workdir: str, limit: int):
    from train import checkpoint, evaluate
    from train.data.datasets import load_dataset
    if not os.path.isdir(os.path.join(workdir, "model")):
        raise UserError(f"--workdir {workdir} has no export ({workdir}/model): train one "
                        "first (python -m train), or leave out bleu (--only bytes speed)")
    pre = models.load(os.path.join(workdir, "model"))
    experiment = checkpoint.restore_model(workdir).experiment
    ds = load_dataset(experiment["dataset"], experiment.get("data_dir") or None)
    split = experiment.get("test_split", "test")
    n = min(limit, ds.split(split).__len__())
    pairs = ds.examples(split, range(n))
    sources, references = [p[0] for p in pairs], [p[1] for p in pairs]
    limits = dict(max_source_length=experiment["max_source_length"],
                  max_new_tokens=experiment["max_decode_length"])
    tok = pre.tokenizer
    outputs = {}
    for variant in ("float32", *SCHEMES):
        params = pre.params if variant == "float32" else quantized(
            pre.params, pre.config, variant, embeddings=False)
        started = time.perf_counter()
        outputs[variant] = evaluate.translate(pre.model, params, tok, sources, **limits)
        line = dict(section="bleu", workdir=workdir, examples=n, variant=variant,
                    bleu=round(evaluate.scores(outputs[variant], references, "bleu")["bleu"],
                               2),
                    decode_s=round(time.perf_counter() - started, 2))
        if variant != "float32":
            line["tokens_equal_float32"] = round(_token_agreement(
                tok, outputs["float32"], outputs[variant]), 4)
        print(json.dumps(line), flush=True)


def _token_agreement(tok, reference: list[str], got: list[str]) -> float:
    """The fraction of float32's output tokens that the other output has at the same place
    (a shorter or longer output counts the difference as disagreement)."""
    same = total = 0
    for a, b in zip(reference, got, strict=True):
        x, y = tok.encode(a), tok.encode(b)
        total += max(len(x), len(y))
        same += sum(i == j for i, j in zip(x, y, strict=False))
    return same / max(total, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quantize",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for the suite")
    parser.add_argument("--only", nargs="*", default=list(SECTIONS), metavar="SECTION",
                        help=f"sections to run: {' '.join(SECTIONS)} (default all)")
    parser.add_argument("--workdir", default="runs/default",
                        help="the trained run whose export bleu scores (default runs/default)")
    parser.add_argument("--examples", type=int, default=500,
                        help="test examples bleu translates (default 500)")
    parser.add_argument("--repeats", type=int, default=3, help="timed greedy runs")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), metavar="SHAPE",
                        help=f"of {' '.join(SHAPES)} (default all)")
    args = parser.parse_args(argv)
    wrong = sorted(set(args.shapes) - set(SHAPES))
    if wrong:
        parser.error(f"--shapes {' '.join(wrong)}: the shapes are {', '.join(SHAPES)}")
    unknown = sorted(set(args.only) - set(SECTIONS))
    if unknown:
        parser.error(f"--only {' '.join(unknown)}: the sections are {', '.join(SECTIONS)}")
    print(json.dumps(dict(section="device", device=jax.devices()[0].device_kind,
                          cores=os.cpu_count(), jax=jax.__version__)), flush=True)
    try:
        if "bytes" in args.only:
            bytes_lines(args.quick, args.shapes)
        if "speed" in args.only:
            speed_lines(args.quick, args.repeats, args.shapes)
        if "bleu" in args.only:
            bleu_lines(args.workdir, args.examples)
    except UserError as e:
        print(f"error: {e}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
