"""The model `python -m decode` decodes with, as its source flags name it.

    --config PRESET     a preset with random weights (seeded by --seed), token ids in and out
    --model DIR         a model directory (`models.load`; --adapter DIR adds LoRA adapters)
    --workdir RUN       a training run's export: RUN/model, or RUN/adapter when the run
                        exported only adapters
    --quantize SCHEME   any of them with int8 or int4 projection weights (`models.quantize`)

`load` gives the model, its parameters, its tokenizer (None: token ids in and out) and its
generation defaults (a preset's are its end token alone), and notes on stderr what it
loaded; `load_draft` the draft model of speculative decoding (--draft-model). A directory
that is missing or damaged, and an adapter on a preset, are the user's mistakes
(`UserError`, or the `OSError` `models.load` raises).
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp

import models
from decode import trace_cache
from decode.runner import Draft
from models.errors import UserError
from models.pretrained.generation import GenerationDefaults
from models.quant import DEFAULT_GROUP, SCHEMES


def add_flags(p) -> None:
    """The source flags of `python -m decode` (one of --model, --workdir, --config) and
    what they load with."""
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a model directory (Hugging Face layout)")
    source.add_argument("--workdir", help="a training run: its export, RUN/model (or an "
                        "adapted run's RUN/adapter)")
    source.add_argument("--config",
                        help=f"a preset with random weights: {', '.join(models.list_configs())}")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="LoRA adapters (PEFT's layout) applied to --model's weights")
    add_quantize_flag(p)
    p.add_argument("--seed", type=int, default=0, help="weights and sampling seed")


def add_quantize_flag(p) -> None:
    p.add_argument("--quantize", choices=SCHEMES, default=None,
                   help="quantize every attention, MLP and expert projection as it is "
                        "loaded: int8 per output channel, int4 per output channel and "
                        "group of --quantize-group inputs (models.quantize)")
    p.add_argument("--quantize-group", type=int, default=DEFAULT_GROUP, metavar="N",
                   help=f"int4's inputs per scale (default {DEFAULT_GROUP}); it must divide "
                        "every projection's input width")


def model_source(args) -> str:
    """What the command line decodes with, as messages name it."""
    if args.config:
        return f"the preset {args.config}"
    if args.model:
        return args.model
    run = args.workdir.rstrip("/")
    # A run that trained adapters exports them (RUN/adapter), and RUN/model only merged.
    if not os.path.isdir(f"{run}/model") and os.path.isdir(f"{run}/adapter"):
        return f"{run}/adapter"
    return f"{run}/model"


def note(message: str) -> None:
    """A line on stderr, where the command line says what it does beside its outputs."""
    print(message, file=sys.stderr, flush=True)


@functools.partial(jax.jit, static_argnums=0)
def _random_params(model, key, *tokens):
    return model.init(key, *tokens)["params"]


def load(args):
    """(model, params, tokenizer or None, the decoding defaults) of the chosen source."""
    if args.config:
        cfg = models.get_config(args.config)
        model = models.build(cfg)
        dummy = jnp.full((1, 4), 3, jnp.int32)
        tokens = (dummy, dummy) if cfg.is_encoder_decoder else (dummy,)
        # Initialised by a program stored once per machine (`decode.trace_cache`).
        params = trace_cache.call("init", _random_params,
                                  (model, jax.random.key(args.seed), *tokens), {})
        if args.quantize:
            params = models.quantize(params, cfg, args.quantize, group=args.quantize_group)
        eos = None if cfg.eos_id is None else (cfg.eos_id,)
        return model, params, None, GenerationDefaults(eos_ids=eos)
    path = model_source(args)
    if args.adapter and args.config:
        raise UserError("--adapter adapts a model directory (--model), not a preset")
    try:
        pre = models.load(path, adapter=args.adapter, quantize=args.quantize,
                          quantize_group=args.quantize_group)
    except FileNotFoundError as e:
        hint = (f" (a run exports it when it finishes; python -m train.export --workdir "
                f"{args.workdir} writes it from a checkpoint)" if args.workdir else "")
        raise UserError(f"{e}{hint}") from None
    lora = pre.config.lora
    note(f"# {path}: {pre.model_type}, {pre.config.architecture}"
         + ("" if lora is None else f", adapters of rank {lora.rank} on {list(lora.targets)}")
         + (f", {args.quantize} weights" if args.quantize else "")
         + ("" if pre.tokenizer else "; no tokenizer: token ids in and out"))
    return pre.model, pre.params, pre.tokenizer, pre.generation


def load_draft(args, strategy: str) -> Draft | None:
    """--draft-model's model (None without the flag), refused for beam search."""
    if not args.draft_model:
        return None
    if strategy == "beam":
        raise UserError("--draft-model speeds up greedy decoding and sampling, not beam "
                        "search")
    pre = models.load(args.draft_model)
    return Draft(pre.model, pre.params, args.draft_tokens)
