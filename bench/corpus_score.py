"""BLEU of a training run on a TSV file of held-out pairs, greedy and with beam search.

    python -m bench.corpus_score --workdir runs/translate_small --tsv DIR/test.tsv

A run's final evaluation decodes its test split greedily; this scores the model a run
exports (the mean of its newest `average_last_checkpoints` checkpoints, as
`train.checkpoint_average` makes it) both ways, with the evaluation's own pieces: the run's
tokenizer, `train.evaluate.translate` (sources encoded as in training, cut to the run's
`max_source_length`), the run's `max_decode_length`, and sacrebleu's corpus BLEU
(`train.evaluate.scores`). Prints one JSON line:

    {"pairs": 1000, "step": 5000, "averaged_steps": [...], "greedy_bleu": ...,
     "beam_bleu": ..., "beam_size": 4, "length_penalty": 0.6, "decode_seconds": ...}
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import models
from train import checkpoint, checkpoint_average, evaluate


def read_pairs(path: str) -> list[tuple[str, str]]:
    """(source, target) of each `source TAB target` line."""
    with open(path, encoding="utf-8") as f:
        return [tuple(line.rstrip("\n").split("\t", 1)) for line in f if "\t" in line]


def score(workdir: str, pairs: list[tuple[str, str]], *, step: int | None = None,
          average_last: int | None = None, beam_size: int = 4,
          length_penalty: float = 0.6) -> dict:
    """The scores described in the module docstring, of the run in `workdir` at its newest
    checkpoint or `step`, averaged with the checkpoints before it as the run averages (or
    over `average_last` checkpoints)."""
    saved = checkpoint.restore_model(workdir, step)
    experiment = saved.experiment
    count = (experiment.get("average_last_checkpoints", 1) if average_last is None
             else average_last)
    saved, averaged = checkpoint_average.averaged_model(workdir, saved, count)
    model = models.build(saved.config)
    sources, references = [s for s, _ in pairs], [t for _, t in pairs]
    limits = dict(max_source_length=experiment["max_source_length"],
                  max_new_tokens=experiment["max_decode_length"])
    out = {"pairs": len(pairs), "step": saved.step, "averaged_steps": averaged}
    started = time.time()
    greedy = evaluate.translate(model, saved.params, saved.tokenizer, sources, **limits)
    out["greedy_bleu"] = evaluate.scores(greedy, references, "bleu")["bleu"]
    beam = evaluate.translate(model, saved.params, saved.tokenizer, sources,
                              beam_size=beam_size, length_penalty=length_penalty, **limits)
    out.update(beam_bleu=evaluate.scores(beam, references, "bleu")["bleu"],
               beam_size=beam_size, length_penalty=length_penalty,
               decode_seconds=round(time.time() - started, 1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.corpus_score",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="the training run's directory")
    parser.add_argument("--tsv", required=True, help="held-out pairs, source TAB target")
    parser.add_argument("--step", type=int, default=None, help="default: the newest")
    parser.add_argument("--average-last", type=int, default=None,
                        help="default: the run's average_last_checkpoints")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--length-penalty", type=float, default=0.6)
    args = parser.parse_args(argv)
    print(json.dumps(score(args.workdir, read_pairs(args.tsv), step=args.step,
                           average_last=args.average_last,
                           beam_size=args.beam_size,
                           length_penalty=args.length_penalty)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
