"""python -m decode --model DIR | --workdir RUN | --config PRESET [options] [TEXT ...]

Decodes (for an encoder-only model: fills in masks, or classifies) each TEXT (or each line
of stdin when no TEXT is given) and prints exactly one output line per input line, in
order: a blank input gives a blank output, and a line break inside an output is written
as \\n.

--model reads a model directory (a Hugging Face one, or a training run's export): text in,
text out with its tokenizer, which adds its own special tokens (GPT-2 none, Llama a leading
BOS, a run's encoder-decoder export a trailing EOS). A directory without tokenizer files,
and --config (a preset with random weights, seeded by --seed), take and print
space-separated token ids. --workdir RUN is --model RUN/model. --adapter DIR applies LoRA
adapters (PEFT's layout: a run's RUN/adapter, or PEFT's own) to --model's weights without
merging them; --model DIR of adapters alone reads their base from adapter_config.json
(base_model_name_or_path), and so does --workdir of a run that exported only adapters.
--quantize int8|int4 decodes with quantized projection weights (`models.quantize`).

The directory's generation_config.json fills in what the command line does not give: the
end tokens, the strategy (beam search when num_beams > 1), the beam size, the length
penalty (with transformers' normalisation, --length-normalization hf, when the file sets
num_beams or length_penalty), the number of new tokens (max_new_tokens, or max_length
less the decoder's prompt), the forced first and last tokens, the banned ids, the minimum
length and no_repeat_ngram_size. Flags win. Settings the file has that would change
transformers' output and that are not applied here are named in one warning on stderr.

    python -m decode --model runs/default/model "the dog sees a cat ."
    python -m decode --model path/to/opus-mt-en-de "An English sentence."   # beam 4 (file)
    python -m decode --model path/to/nllb-200 --target-lang spa_Latn "An English sentence."
    echo "5 6 7" | python -m decode --config transformer-tiny --strategy beam --beam-size 4

--chat: each input is a user's message in the directory's chat template (decode.chat_cli).

Encoder-only models (BERT, RoBERTa) do not generate; one of two flags says what to do
with them (and a model without the one it needs is refused, naming the flag that fits):

--fill-mask: a masked-LM model (num_labels=0) predicts each mask token of the input (the
tokenizer's own: [MASK] for BERT and the project's tokenizers, <mask> for RoBERTa). One
line per input: for each mask in order, MASKi: then its --top-k best fillers (default 5)
with their probabilities, best first, "|" between fillers and "; " between masks. A filler
that is empty or holds whitespace, "|" or ";" is quoted ('...'), a special token or a lone
byte shows as its piece ([SEP], <0xC3>).

    python -m decode --model path/to/bert --fill-mask "The cat sat on the [MASK] ."
    [MASK]1: mat 0.4120 | floor 0.2010 | bed 0.0830 | rug 0.0410 | couch 0.0270
    python -m decode --model path/to/roberta --fill-mask --top-k 2 "<mask> and <mask> ."
    <mask>1: Salt 0.3100 | Bread 0.1200; <mask>2: pepper 0.5500 | butter 0.0900

--classify: a classifier (num_labels=C > 0) prints label<TAB>probability of the likeliest
label (config.json's id2label names, else LABEL_i); a directory without tokenizer files
takes space-separated token ids.

    python -m decode --model path/to/sst2-bert --classify "a fine film" "dull"
    pos\t0.9312
    neg\t0.8107

Both read stdin lines when no TEXT is given, with the tokenizer's special tokens added
([CLS] x [SEP], <s> x </s>), and refuse an input longer than the model's max_len (no
--truncate) and the flags only generation reads (--strategy, --max-new-tokens, ...).

--audio FILE ...: a Whisper model transcribes audio files (WAV, FLAC), one line per file in
the order given; --language (else detected per file) and --task transcribe|translate set
its prompt, --strategy greedy|beam and --beam-size its search (`decode.whisper_cli`).

    python -m decode --model path/to/whisper-small --audio a.wav b.flac --language es

Exit status: 0 when every input was decoded; 2 for a mistake in the command line, an
input or a file, or a missing optional dependency (one `error:` line on stderr; --verbose
adds the traceback); 1 for an internal error, a bug in this project or a library under it
(the traceback, then one `error: internal error ...` line).
"""
# (This docstring is the --help text.) Argument parsing only: the model comes from
# `decode.source`, the generation request from `decode.cli_request` (the directory's
# `decode.DecodeRequest`, then the flags given), the text service is `decode.TextDecoder`;
# the encoder-only half is `decode.encoder_cli`, the audio half `decode.whisper_cli`.

from __future__ import annotations

import argparse
import functools
import re
import sys
import traceback

import jax

import models
from decode import chat_cli, cli_request, encoder_cli, source, whisper_cli
from decode.cli_request import DEFAULT_NEW_TOKENS, DEFAULTS
from decode.text import Batching, TextDecoder, one_line
from models.errors import UserError

INTERNAL = "internal error (a bug in jax-transformer-zoo or a library it uses)"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


NONE = "none"


def _id_or_none(text: str):
    """A token id >= 0, or "none" (-1 internally: turn a directory's default off)."""
    return -1 if text == NONE else _non_negative_int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("text", nargs="*", help="inputs; stdin lines when none")
    source.add_flags(p)
    task = p.add_mutually_exclusive_group()
    task.add_argument("--fill-mask", action="store_true",
                      help="encoder-only masked-LM model: the --top-k best fillers (default "
                           f"{encoder_cli.DEFAULT_FILLERS}) of each mask token")
    task.add_argument("--classify", action="store_true",
                      help="encoder-only classifier: label<TAB>probability of each input")
    chat_cli.add_flag(p)
    p.add_argument("--audio", nargs="+", default=None, metavar="FILE",
                   help="Whisper: transcribe these audio files (one line each)")
    p.add_argument("--language", default=None,
                   help="--audio: the spoken language, a code (en, es) or token (<|es|>); "
                        "default: detected per file")
    p.add_argument("--task", default=None, metavar="transcribe|translate",
                   help="--audio: transcribe (default) or translate into English")
    p.add_argument("--strategy", choices=("greedy", "sample", "beam"), default=None,
                   help="default: beam when the directory's num_beams > 1, else greedy")
    p.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help=f"default: the directory's max_new_tokens or max_length, else "
                        f"{DEFAULT_NEW_TOKENS}")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"sample only (default {DEFAULTS.temperature:g})")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample: keep the k best tokens (default 0, off); --fill-mask: the "
                        f"fillers shown per mask (default {encoder_cli.DEFAULT_FILLERS})")
    p.add_argument("--top-p", type=float, default=None, help="sample only; 1 (default) is off")
    p.add_argument("--min-p", type=float, default=None, help="sample only; 0 (default) is off")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="greedy and sample; 1 is off (default: the directory's, else 1)")
    p.add_argument("--beam-size", type=_positive_int, default=None,
                   help=f"beam only (default: the directory's num_beams, else "
                        f"{DEFAULTS.beam_size})")
    p.add_argument("--length-penalty", type=float, default=None,
                   help="beam only: alpha (default: the directory's length_penalty, else "
                        f"1.0 with hf normalisation, {DEFAULTS.length_penalty} with gnmt)")
    p.add_argument("--length-normalization", choices=("gnmt", "hf"), default=None,
                   help="beam only: gnmt, log-prob / ((5 + len) / 6) ** alpha; hf, log-prob "
                        "/ len ** alpha (default: hf when the directory sets num_beams or "
                        "length_penalty, else gnmt)")
    p.add_argument("--early-stopping", type=cli_request.stopping_rule, default=None,
                   metavar="true|false|never", help=cli_request.stopping_rule.__doc__)
    p.add_argument("--eos-id", type=int, nargs="*", default=None,
                   help="end token id(s); default the model's; give none to never stop")
    p.add_argument("--forced-bos-id", type=_id_or_none, default=None, metavar="ID|none",
                   help="the first new token (default: the directory's forced_bos_token_id)")
    p.add_argument("--forced-eos-id", type=_id_or_none, default=None, metavar="ID|none",
                   help="the last new token (default: the directory's forced_eos_token_id)")
    p.add_argument("--banned-ids", type=int, nargs="*", default=None,
                   help="ids never generated (default: the directory's bad_words_ids); "
                        "give none to ban nothing")
    p.add_argument("--min-new-tokens", type=_non_negative_int, default=None,
                   help="no end token before this many (default: the directory's minimum)")
    p.add_argument("--no-repeat-ngram-size", type=_non_negative_int, default=None,
                   help="no n-gram of this size twice; 0 is off (default: the directory's)")
    cli_request.add_language_flags(p)
    cli_request.add_cache_flags(p)
    p.add_argument("--batch-size", type=_positive_int, default=16,
                   help="inputs decoded together")
    p.add_argument("--truncate", action="store_true",
                   help="cut an input longer than the model takes (with a warning) instead "
                        "of stopping")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="speculative decoding: a smaller model directory of the same family "
                        "and tokenizer that proposes tokens the model checks (greedy and "
                        "sample: the same tokens, or distribution, faster)")
    p.add_argument("--draft-tokens", type=_positive_int, default=4,
                   help="with --draft-model: tokens it proposes per check (default 4)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile afresh (default: JAX's persistent compilation cache in the "
                        "user's cache directory, models.use_compile_cache)")
    p.add_argument("--verbose", action="store_true", help="tracebacks with errors")
    return p


def run(args) -> None:
    parser = build_parser()
    chat_cli.check_flags(args)
    whisper_cli.check_flags(args, parser)
    if args.audio is not None:
        whisper_cli.run(args, lambda line: print(line, flush=True))
        return
    encoder_cli.check_flags(args, parser)
    lines = args.text or sys.stdin.read().splitlines()
    model, params, tok, gen = source.load(args)
    cfg = model.config
    encoder_cli.check_model_fits(args, cfg)
    if args.fill_mask or args.classify:
        encoder_cli.run(args, model, params, tok, lines)
        return
    tok, gen = cli_request.with_languages(args, tok, gen, cfg)
    encode, gen = chat_cli.setup(args, tok, gen)
    strategy = cli_request.checked_strategy(args, gen)
    gen = cli_request.with_new_tokens(args, gen)
    draft = source.load_draft(args, strategy)
    service = TextDecoder(model, params, tok, limit=cli_request.input_limit(args, gen, cfg),
                          batching=Batching(size=args.batch_size), draft=draft,
                          **({"encode": encode} if encode else {}))
    request_for = functools.partial(cli_request.request_for, args, gen, cfg)
    for text in service.decode(lines, request_for, rng=jax.random.key(args.seed)):
        print(one_line(text), flush=True)


def _names_an_extra(e: ImportError) -> bool:
    """The project's message for a missing optional dependency names the extra to install
    ("pip install 'jax-transformer-zoo[hf]'")."""
    return re.search(r"jax-transformer-zoo\[[\w,-]+\]", str(e)) is not None


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; the exit status (the module docstring's "Exit status")."""
    args = build_parser().parse_args(argv)
    if not args.no_compile_cache:
        models.use_compile_cache()
    try:
        run(args)
    except Exception as e:
        user = isinstance(e, (UserError, OSError)) or (
            isinstance(e, ImportError) and _names_an_extra(e))
        if not user or args.verbose:
            traceback.print_exc()
        print(f"error: {e}" if user else f"error: {INTERNAL}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2 if user else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
