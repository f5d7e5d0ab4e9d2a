"""python -m bench.whisper [--quick] [--batch 8] [--beams 4] [--new-tokens 32] [--repeats 3]
       [--torch-device cpu|cuda]

Whisper beam search, ours against transformers', measured in one run on the same random
weights: a transformers `WhisperForConditionalGeneration` of whisper-tiny's shape (D 384,
6 heads, 4 encoder + 4 decoder layers, FFN 1536, V 51865, 80 mels, 1500 positions: 30 s
windows) with random weights, saved with `save_pretrained` and read back by `models.load`.
Both decode `--batch` windows of random features with `--beams` beams:

- ours: `decode.whisper.transcribe(pre, features, num_beams=W, max_new_tokens=N)`, jitted
  (the first call compiles; then the best of `--repeats`);
- theirs: `model.generate(features, num_beams=W, max_new_tokens=N, min_new_tokens=N)` on
  torch under `torch.no_grad()` (one warm-up call, then the best of `--repeats`), on
  `--torch-device` (default cpu; `python -m bench.accelerator` gives cuda on a GPU).

Equal work: both run exactly N new tokens for every beam. transformers' min_new_tokens=N
bans the end token until the N-th, where max_new_tokens stops every beam; ours bans it at
every step (the generation config's suppressed tokens plus the end token, the same
log-probs), so no beam ends early and the loop runs its N steps. The decoder prompt is
<|startoftranscript|> <|notimestamps|> (an English-only model's) in both.

One JSON line: `ours_s`, `transformers_s` (best times), `speedup` = transformers_s /
ours_s, `ours_first_call_s` (compile + one run), the audio seconds per second of each, and
`same_tokens` (the best beams' tokens equal, which they are unless float32 rounding
reorders near-equal candidates).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time

import jax
import numpy as np

import models

TINY = dict(d_model=384, encoder_attention_heads=6, decoder_attention_heads=6,
            encoder_layers=4, decoder_layers=4, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
            vocab_size=51865, num_mel_bins=80, max_source_positions=1500,
            max_target_positions=448)
QUICK = dict(TINY, d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_layers=1, decoder_layers=1, encoder_ffn_dim=64, decoder_ffn_dim=64,
             vocab_size=128, num_mel_bins=8, max_source_positions=16, max_target_positions=32)


def special_ids(vocab: int) -> dict:
    """An English-only Whisper's special ids at the end of the vocabulary (<|notimestamps|>
    last, so no id reads as a timestamp)."""
    eos, start, no_timestamps = vocab - 4, vocab - 3, vocab - 1
    return dict(eos=eos, start=start, no_timestamps=no_timestamps)


def build(shape: dict, path: str, seed: int = 0):
    """(transformers model, our loaded copy): random weights (normal, std 0.1; layer-norm
    scales near 1), an English-only generation config, saved to `path` and loaded."""
    import torch
    import transformers
    ids = special_ids(shape["vocab_size"])
    config = transformers.WhisperConfig(
        **shape, pad_token_id=ids["eos"], bos_token_id=ids["eos"], eos_token_id=ids["eos"],
        decoder_start_token_id=ids["start"], begin_suppress_tokens=None,
        suppress_tokens=None)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("encoder.embed_positions.weight"):
                p.copy_(torch.as_tensor(models.audio.whisper_sinusoids(*p.shape)))
            elif p.ndim == 1 and "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=ids["start"], eos_token_id=ids["eos"],
        pad_token_id=ids["eos"], no_timestamps_token_id=ids["no_timestamps"],
        forced_decoder_ids=[[1, ids["no_timestamps"]]], suppress_tokens=[1, 2],
        begin_suppress_tokens=[ids["eos"]], max_length=shape["max_target_positions"])
    model.save_pretrained(path)
    return model, models.load(path)


def best_of(fn, repeats: int) -> tuple[float, object]:
    """(the best of `repeats` timed calls, the last result)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(shape: dict, *, batch: int, beams: int, new_tokens: int, repeats: int,
            torch_device: str = "cpu") -> dict:
    import torch

    from decode.whisper import WhisperSettings, transcribe
    with tempfile.TemporaryDirectory() as path:
        model, pre = build(shape, path)
    frames = 2 * shape["max_source_positions"]
    features = np.random.default_rng(0).normal(
        size=(batch, shape["num_mel_bins"], frames)).astype(np.float32)
    settings = WhisperSettings.from_generation(pre.generation, pre.config)
    settings = dataclasses.replace(settings, suppress=settings.suppress + settings.eos_ids)

    def ours():
        out = transcribe(pre, features, num_beams=beams, max_new_tokens=new_tokens,
                         settings=settings)
        return np.asarray(jax.block_until_ready(out.tokens))

    model.to(torch_device)
    their_features = torch.as_tensor(features).to(torch_device)

    def theirs():
        with torch.no_grad():
            return model.generate(their_features, num_beams=beams, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens).cpu().numpy()

    t0 = time.perf_counter()
    ours()
    first = time.perf_counter() - t0
    ours_s, our_tokens = best_of(ours, repeats)
    theirs()                                                    # warm-up
    theirs_s, their_tokens = best_of(theirs, repeats)
    P = their_tokens.shape[1] - new_tokens
    audio_s = batch * frames / 100                              # 100 frames a second
    return {"case": "whisper_beam", "batch": batch, "beams": beams, "new_tokens": new_tokens,
            "d_model": shape["d_model"], "layers": [shape["encoder_layers"],
                                                    shape["decoder_layers"]],
            "vocab_size": shape["vocab_size"], "audio_s": audio_s,
            "transformers_device": torch_device,
            "ours_first_call_s": round(first, 3), "ours_s": round(ours_s, 3),
            "transformers_s": round(theirs_s, 3), "speedup": round(theirs_s / ours_s, 2),
            "ours_audio_s_per_s": round(audio_s / ours_s, 1),
            "transformers_audio_s_per_s": round(audio_s / theirs_s, 1),
            "same_tokens": bool(np.array_equal(our_tokens, their_tokens[:, P:]))}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.whisper",
                                description=__doc__.split("\n")[2])
    p.add_argument("--quick", action="store_true",
                   help="a tiny model and short runs (a smoke test, not a measurement)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the first")
    p.add_argument("--torch-device", default="cpu",
                   help="where transformers runs (cuda: on the GPU ours runs on)")
    args = p.parse_args(argv)
    print(json.dumps({"device": jax.devices()[0].device_kind,
                      "platform": jax.devices()[0].platform, "jax": jax.__version__}),
          flush=True)
    line = measure(QUICK if args.quick else TINY, batch=args.batch, beams=args.beams,
                   new_tokens=min(args.new_tokens, 8) if args.quick else args.new_tokens,
                   repeats=args.repeats, torch_device=args.torch_device)
    print(json.dumps(line), flush=True)
    return [line]


if __name__ == "__main__":
    main()
