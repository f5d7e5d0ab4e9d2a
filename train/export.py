"""python -m train.export --workdir W [--step N] [--out DIR]

Writes a training run's checkpoint (the newest readable one, or step N) as a model
directory, the one form in which models leave the project: W/model by default. Training
runs do this themselves when they finish or are stopped by SIGTERM; this command exports
any other checkpoint. `python -m decode --model W/model` (or `--workdir W`) then reads it.
A run with `average_last_checkpoints` N > 1 exports the mean of the parameters of its newest
N checkpoints up to the step (`--average-last` chooses another N; 1: that step alone).

A run that trained low-rank adapters (`lora.rank`) exports them as W/adapter, in PEFT's
layout, naming `init_from` as their base; with `lora.export_merged` also W/model, the
adapters merged into the weights. `python -m decode --model W/adapter` reads the base and
the adapters together.
"""

from __future__ import annotations

import argparse
import os
import sys

import models
from models.errors import UserError
from models.pretrained import GenerationDefaults
from models.tokenizer import Tokenizer
from train import checkpoint, checkpoint_average, cli_errors


def write_model(path: str, config: models.TransformerConfig, params, tokenizer: Tokenizer,
                *, model_type: str | None = None,
                generation: GenerationDefaults | None = None) -> str:
    """Saves a trained model as a model directory; returns the model_type written.

    The project's own tokenizers get the convention the model was trained with for
    `encode(text, add_special_tokens=True)`: a decoder-only model's inputs start with BOS,
    an encoder-decoder's sources end in EOS, an encoder-only model's texts have both. Without
    decoding defaults, the model's eos is written as the end token.
    """
    if hasattr(tokenizer, "with_specials"):
        encoder_only = config.architecture == "encoder_only"
        tokenizer = tokenizer.with_specials(
            add_bos=not config.is_encoder_decoder,
            add_eos=config.is_encoder_decoder or encoder_only)
    if generation is None and config.eos_id is not None:
        generation = GenerationDefaults(eos_ids=(config.eos_id,))
    return models.save(path, config, params, tokenizer, model_type=model_type,
                       generation=generation)


def write_outputs(workdir: str, config: models.TransformerConfig, params,
                  tokenizer: Tokenizer, *, model_type: str | None = None,
                  generation: GenerationDefaults | None = None, out: str | None = None,
                  base: str = "", merged: bool = False) -> str:
    """A run's model as it leaves the run; returns the directory to decode with.

    A plain model: `write_model` into `out` (default WORKDIR/model). An adapted one
    (`config.lora`): its adapters into `out` (default WORKDIR/adapter) in PEFT's layout,
    naming `base` (the `init_from` directory) as theirs; with `merged`, also the adapters
    merged into `base`'s weights as WORKDIR/model.
    """
    if config.lora is None:
        out = out or os.path.join(workdir, "model")
        write_model(out, config, params, tokenizer, model_type=model_type,
                    generation=generation)
        return out
    out = out or os.path.join(workdir, "adapter")
    models.save_adapter(out, config, params, model_type=model_type,
                        base_name_or_path=os.path.abspath(base) if base else "")
    if merged:
        # Merged into the directory's own weights (as the adapters apply to them), not
        # into the run's copy of the base, which may be stored rounded (lora.base_dtype).
        plain, merged_params = (
            (config.replace(lora=None), models.load(base, adapter=out, merge=True).params)
            if base else models.lora.merge(config, params))
        write_model(os.path.join(workdir, "model"), plain, merged_params, tokenizer,
                    model_type=model_type, generation=generation)
    return out


def export(workdir: str, step: int | None = None, out: str | None = None, *,
           average_last: int | None = None) -> str:
    """Exports a checkpoint of `workdir` into `out` (default WORKDIR/model, or an adapted
    run's WORKDIR/adapter: see `write_outputs`); returns `out`. The parameters are the mean
    of the newest `average_last` checkpoints up to that one (default: the run's
    `average_last_checkpoints`; `train.checkpoint_average`).

    Raises:
        UserError: `average_last` below 1.
    """
    if average_last is not None and average_last < 1:
        raise UserError(f"average_last={average_last} must be an int >= 1 (1: the "
                        "checkpoint alone)")
    saved = checkpoint.restore_model(workdir, step)
    count = (saved.experiment.get("average_last_checkpoints", 1) if average_last is None
             else average_last)
    saved, _ = checkpoint_average.averaged_model(workdir, saved, count)
    lora = saved.experiment.get("lora") or {}
    return write_outputs(workdir, saved.config, saved.params, saved.tokenizer,
                         model_type=saved.model_type, generation=saved.generation, out=out,
                         base=saved.experiment.get("init_from", ""),
                         merged=bool(lora.get("export_merged")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.export",
                                     description=__doc__.split("\n")[2])
    parser.add_argument("--workdir", required=True, help="the training run's directory")
    parser.add_argument("--step", type=int, default=None, help="default: the newest")
    parser.add_argument("--out", default=None, help="default: WORKDIR/model")
    parser.add_argument("--average-last", type=int, default=None,
                        help="average the newest N checkpoints up to the step (default: "
                             "the run's average_last_checkpoints)")
    args = parser.parse_args(argv)
    try:
        out = export(args.workdir, args.step, args.out, average_last=args.average_last)
    except Exception as e:    # no (readable) checkpoint, an unwritable --out; or a bug
        return cli_errors.report(e)
    print(f"exported {args.workdir} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
