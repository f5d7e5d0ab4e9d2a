"""python -m bench.speculative --model runs/default/model --draft runs/draft/model

Speculative decoding against plain greedy decoding, measured in one run: the default
model (`python -m train`) translating `toy_translation`'s test sentences, alone and with
its draft (`python -m train --config draft --workdir runs/draft`), in batches of
`--batch`, for each `--draft-tokens` k. One JSON line per k: new tokens per second of both
(the decode time of every batch, after one compiling pass), their ratio, the share of the
draft's tokens the model accepted, and whether the tokens are the same (they must be:
greedy speculative decoding gives the model's own greedy tokens).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import decode
import models
from train import data


def batches(pre, sentences: list[str], batch: int):
    """The sentences as the model reads them, in padded batches of `batch` rows."""
    ids = [pre.tokenizer.encode(s, add_special_tokens=True) for s in sentences]
    width = decode.bucket_width(max(len(x) for x in ids))
    return [decode.pad_prompts(ids[i:i + batch], width=width)
            for i in range(0, len(ids) - batch + 1, batch)]


def decode_all(pre, prompts, new_tokens: int, draft=None):
    """(seconds, tokens of every batch, accepted, drafted) of greedy decoding."""
    extra = {} if draft is None else dict(draft_model=draft[0].model,
                                          draft_params=draft[0].params, draft_tokens=draft[1])
    outs, t0 = [], time.perf_counter()
    for p, n in prompts:
        outs.append(decode.generate(pre.model, pre.params, p, n, max_new_tokens=new_tokens,
                                    **extra))
    jax.block_until_ready([o.tokens for o in outs])
    seconds = time.perf_counter() - t0
    tokens = [np.asarray(o.tokens) for o in outs]
    new = int(sum(np.asarray(o.lengths).sum() for o in outs))
    accepted = int(sum(np.asarray(o.accepted).sum() for o in outs)) if draft else 0
    drafted = int(sum(np.asarray(o.drafted).sum() for o in outs)) if draft else 0
    return seconds, tokens, new, (accepted, drafted)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.speculative",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="runs/default/model")
    p.add_argument("--draft", default="runs/draft/model")
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 3, 4, 6])
    p.add_argument("--sentences", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    target, draft = models.load(args.model), models.load(args.draft)
    ds = data.load_dataset("toy_translation", args.data_dir)
    sentences = [s for s, _ in ds.examples("test", range(args.sentences))]
    prompts = batches(target, sentences, args.batch)
    decode_all(target, prompts[:1], args.new_tokens)                   # compile
    plain_s, plain_tokens, new, _ = decode_all(target, prompts, args.new_tokens)
    lines = []
    for k in args.draft_tokens:
        decode_all(target, prompts[:1], args.new_tokens, (draft, k))   # compile
        s, tokens, _, (accepted, drafted) = decode_all(target, prompts, args.new_tokens,
                                                       (draft, k))
        line = {"case": "speculative", "draft_tokens": k, "batch": args.batch,
                "new_tokens": new, "greedy_tokens_per_s": round(new / plain_s, 1),
                "speculative_tokens_per_s": round(new / s, 1),
                "speedup": round(plain_s / s, 3),
                "acceptance_rate": round(accepted / max(drafted, 1), 3),
                "same_tokens": all(np.array_equal(a, b)
                                   for a, b in zip(tokens, plain_tokens, strict=True))}
        lines.append(line)
        print(json.dumps(line), flush=True)
    return lines


if __name__ == "__main__":
    main()
