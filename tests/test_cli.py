"""The command lines run end to end (in-process, tiny presets)."""

import io
import json
import os
import subprocess
import sys

import pytest

import bench.compile_cache
import bench.decode
import decode.__main__ as decode_cli
import models.__main__ as models_cli


def test_models_summary(capsys):
    models_cli.main(["--config", "gpt-tiny", "--batch", "2", "--length", "8", "--num_layers=1"])
    out = capsys.readouterr().out
    assert "parameters  " in out and "(2, 8) -> logits (2, 8, 512)" in out


@pytest.mark.parametrize("strategy", ["greedy", "sample", "beam"])
def test_decode_cli_prints_one_line_per_input(capsys, strategy):
    decode_cli.main(["--config", "gpt-tiny", "--strategy", strategy, "--max-new-tokens", "5",
                     "--eos-id", "--beam-size", "2", "5 6 7", "9 10"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert all(len(line.split()) == 5 for line in lines)


def test_decode_cli_reads_stdin_one_output_line_per_input_line(capsys, monkeypatch):
    """A blank input line gives a blank output line, so outputs stay aligned with inputs."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("5 6 7\n\n9 10\n"))
    assert decode_cli.main(["--config", "transformer-tiny", "--max-new-tokens", "4",
                            "--eos-id"]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""        # 3 lines, then EOF
    assert len(lines[0].split()) == 4 and len(lines[2].split()) == 4


def _cli_error(capsys, args) -> str:
    assert decode_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("error: "), err
    return err[-1]


def test_decode_cli_errors_are_one_line_and_exit_2(capsys):
    assert "unknown config 'nope'" in _cli_error(capsys, ["--config", "nope", "1 2"])
    assert "input 1: 'a b' is not a list of space-separated token ids" in _cli_error(
        capsys, ["--config", "gpt-tiny", "a b"])
    assert "input 2: token id 999 is outside [0, vocab_size=512)" in _cli_error(
        capsys, ["--config", "gpt-tiny", "5", "5 999"])
    assert "top_p=0 is outside" in _cli_error(
        capsys, ["--config", "gpt-tiny", "--strategy", "sample", "--top-p", "0", "5"])
    assert "--repetition-penalty applies to greedy decoding and sampling" in _cli_error(
        capsys, ["--config", "gpt-tiny", "--strategy", "beam", "--repetition-penalty", "2", "5"])
    assert "--beam-size 600 exceeds the vocabulary (512 tokens)" in _cli_error(
        capsys, ["--config", "gpt-tiny", "--strategy", "beam", "--beam-size", "600", "5"])
    for flag in ("--batch-size", "--max-new-tokens", "--beam-size"):
        with pytest.raises(SystemExit) as e:                 # argparse: exit 2, names it
            decode_cli.main(["--config", "gpt-tiny", flag, "0", "5"])
        assert e.value.code == 2
        assert f"argument {flag}: 0 must be >= 1" in capsys.readouterr().err


def test_decode_cli_length_limit_is_checked_before_decoding_and_truncate_cuts(capsys):
    """gpt-tiny has max_len 128: with 8 new tokens a prompt may have 120 tokens; the
    128-wide bucket of a 100-token prompt is narrowed to fit instead of being refused."""
    fits, long = " ".join(["5"] * 100), " ".join(["5"] * 121)
    message = _cli_error(capsys, ["--config", "gpt-tiny", "--max-new-tokens", "8", fits, long])
    assert "input 2 is 121 tokens long; the model takes at most 120" in message
    assert capsys.readouterr().out == ""                      # nothing decoded at all
    assert decode_cli.main(["--config", "gpt-tiny", "--max-new-tokens", "8", "--eos-id",
                            "--truncate", fits, "", long]) == 0
    captured = capsys.readouterr()
    assert [len(line.split()) for line in captured.out.split("\n")] == [8, 0, 8, 0]
    assert "warning: input 3 cut from 121 to 120 tokens" in captured.err


def test_decode_benchmark_runs_and_prints_json_lines(capsys):
    """A smoke test of the benchmark's code path (tiny model; nothing is timed or asserted
    about speed)."""
    bench.decode.main(["--quick", "--repeats", "1", "--cases", "b8_t256", "--only", "greedy",
                       "no_cache"])
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    strategies = [line.get("strategy") for line in lines]
    assert strategies[1:] == ["roofline", "greedy", "no_cache", "speedup"]
    assert lines[2]["fraction_of_bound"] > 0 and lines[4]["cached_greedy_over_no_cache"] > 0


def test_compile_cache_benchmark_times_two_processes(capsys):
    """A smoke test of bench.compile_cache (tiny model): two fresh processes, one cache."""
    lines = bench.compile_cache.main(["--quick"])
    assert [(line.get("process"), line["strategy"]) for line in lines] == [
        ("first", "greedy"), ("first", "beam4"), ("second", "greedy"), ("second", "beam4"),
        (None, "greedy"), (None, "beam4")]
    assert all(line["case"] == "quick" and line["first_call_s"] > line["run_s"] > 0
               for line in lines[:4])
    assert lines[4]["first_call_second_over_first"] > 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 6


def _lines_of_text(n: int) -> str:
    words = "the cat sat on a mat and saw one dog run to its home by the sea".split()
    return "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(5 + i % 6))
                     for i in range(n)) + "\n"


def test_train_cli_runs_a_documented_config_with_overrides_then_decode_reads_the_run(
        data_dir, tmp_path, capsys):
    """`python -m train` as the README gives it (a config name, a local file, ml_collections
    overrides), in a fresh interpreter; then `python -m decode --workdir` on its export."""
    book = tmp_path / "book.txt"
    book.write_text(_lines_of_text(400))
    workdir = tmp_path / "run"
    overrides = dict(dataset="local_text", data_files=str(book), data_dir=data_dir,
                     num_train_steps=3, per_device_batch_size=2, max_target_length=32,
                     max_source_length=32, max_decode_length=32, eval_per_device_batch_size=16,
                     log_every_steps=1, checkpoint_every_steps=2)
    model = dict(d_model=32, num_heads=2, mlp_dim=64, num_layers=1)
    args = ([sys.executable, "-m", "train", "--config", "tiny_shakespeare", "--workdir",
             str(workdir)] + [f"--config.{k}={v}" for k, v in overrides.items()]
            + [f"--config.model_overrides.{k}={v}" for k, v in model.items()])
    done = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "done: step 3" in done.stdout
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["step"] == 3 and summary["resumed_from_step"] is None
    assert summary["validation"]["perplexity"] > 1
    assert (workdir / "metrics.jsonl").exists()

    for strategy in ("greedy", "sample", "beam"):
        assert decode_cli.main(["--workdir", str(workdir), "--strategy", strategy, "--eos-id",
                                "--beam-size", "2", "--max-new-tokens", "6", "the cat",
                                "a dog"]) == 0
        lines = capsys.readouterr().out.rstrip("\n").split("\n")   # what a shell reads
        assert len(lines) == 2, (strategy, lines)


def test_decoded_line_breaks_are_escaped_so_each_output_stays_one_line():
    from decode.text import one_line
    assert one_line("a\nb\r\nc") == "a\\nb\\r\\nc"


def test_model_overrides_a_config_file_did_not_set_can_be_given_on_the_command_line():
    import train.__main__ as train_cli
    from train import configs
    config = configs.get("lm1b")                      # sets no model_overrides
    train_cli._make_room_for_model_overrides(config, [
        "prog", "--config.model", "llama-small", "--config.model_overrides.num_kv_heads=2",
        "--config.model_overrides.dropout_rate", "0.1"])
    # Placeholders of the right type (the preset's values) for ml_collections to parse into.
    assert config.model_overrides.to_dict() == {"num_kv_heads": 4, "dropout_rate": 0.0}


def test_train_cli_errors_name_the_problem(tmp_path):
    import train.__main__ as train_cli
    with pytest.raises(SystemExit, match=r"unknown TransformerConfig field\(s\) \['dropout_rat'\]"):
        train_cli.main(["prog", "--config", "lm1b", "--config.model_overrides.dropout_rat=0.2"])
    with pytest.raises(SystemExit, match="unknown config 'nope'; available: .*default"):
        train_cli.main(["prog", "--config", "nope"])
    with pytest.raises(SystemExit, match="config file 'missing.py' does not exist"):
        train_cli.main(["prog", "--config", "missing.py"])
    assert decode_cli.main(["--workdir", str(tmp_path), "hello"]) == 2


def _translator(tmp_path, settings: dict) -> str:
    """A tiny encoder-decoder with random weights and the byte tokenizer (sources end in
    EOS), saved with `settings` as its generation_config.json."""
    import jax
    import numpy as np

    import models
    from models.pretrained.generation import GenerationDefaults
    from models.tokenizer import ByteTokenizer
    from tests.helpers import tiny
    cfg = tiny("encoder_decoder", vocab_size=260, max_len=32)
    model = models.build(cfg)
    dummy = np.full((1, 4), 5, np.int32)
    params = jax.jit(model.init)(jax.random.key(3), dummy, dummy)["params"]
    path = str(tmp_path / "translator")
    models.save(path, cfg, params, ByteTokenizer().with_specials(add_bos=False, add_eos=True),
                generation=GenerationDefaults.from_dict(settings, cfg.vocab_size))
    return path


def test_decode_cli_honours_a_directorys_generation_config(tmp_path, capsys):
    """Text in, text out, beam search by default (num_beams 3): every output starts with
    the forced "X" (banned too: forced wins), holds only the bytes not banned (lower-case
    letters here), and has at most max_length - 1 = 6 tokens (the forced end token, which
    the text drops, last).
    Flags win over the file; settings that are not applied are named in one warning."""
    letters = {ord(c) + 4 for c in "abcdefghijklmnopqrstuvwxyz"}
    settings = dict(eos_token_id=1, forced_bos_token_id=ord("X") + 4, forced_eos_token_id=1,
                    bad_words_ids=[[i] for i in range(4, 260) if i not in letters],
                    num_beams=3, length_penalty=1.5, max_length=7, no_repeat_ngram_size=2,
                    do_sample=True, temperature=0.7)
    path = _translator(tmp_path, settings)
    assert decode_cli.main(["--model", path, "An English sentence.", "", "Another one."]) == 0
    captured = capsys.readouterr()
    lines = captured.out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""
    for line in (lines[0], lines[2]):
        assert line.startswith("X") and set(line[1:]) <= {chr(i - 4) for i in letters}, line
        assert 1 <= len(line) <= 5, line               # 6 tokens, the last one the end
        assert all(line[i:i + 2] not in line[i + 1:] for i in range(len(line) - 1)), line
    warnings = [w for w in captured.err.splitlines() if w.startswith("warning:")]
    assert warnings == ["warning: generation settings not applied: do_sample=True, "
                        "temperature=0.7"]
    # Beam search by default, as the file's num_beams: the same as asking for it.
    assert decode_cli.main(["--model", path, "--strategy", "beam", "An English sentence."]) == 0
    assert capsys.readouterr().out.split("\n")[0] == lines[0]
    # Flags win: greedy, "D" forced, nothing banned, at most 3 new tokens.
    assert decode_cli.main(["--model", path, "--strategy", "greedy", "--forced-bos-id",
                            str(ord("D") + 4), "--forced-eos-id", "none", "--banned-ids",
                            "--max-new-tokens", "3", "--no-repeat-ngram-size", "0",
                            "An English sentence."]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("D") and len(out.out.rstrip("\n")) <= 3, out.out
    assert "warning: generation settings not applied: do_sample=True" in out.err
    assert "num_beams 300 exceeds the vocabulary (260 tokens)" in _cli_error(
        capsys, ["--model", _translator(tmp_path / "wide", {"num_beams": 300,
                                                              "max_new_tokens": 4}), "hi"])


# ---------------------------------------------------------------------------------------------
# Exit statuses: a user's mistake is one `error:` line and 2; anything else is a bug, shown
# with its traceback, and 1.

INTERNAL = "error: internal error (a bug in jax-transformer-zoo or a library it uses): "


def test_decode_cli_a_user_mistake_is_one_error_line_and_exit_2(capsys):
    args = ["--config", "gpt-tiny", "--strategy", "sample", "--top-p", "0", "5"]
    assert decode_cli.main(args) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["error: top_p=0 is outside (0.0, 1.0]"]
    assert captured.out == ""
    assert decode_cli.main([*args, "--verbose"]) == 2          # --verbose adds the traceback
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Traceback (most recent call last):"
    assert err[-1] == "error: top_p=0 is outside (0.0, 1.0]"
    assert "UserError" in "\n".join(err)


def test_decode_cli_an_internal_error_is_its_traceback_and_exit_1(capsys, monkeypatch):
    """A plain ValueError from deep inside (here: where the service decodes a batch) is a
    bug, not a usage error."""
    import decode.text

    def broken(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(decode.text, "run", broken)
    assert decode_cli.main(["--config", "gpt-tiny", "--max-new-tokens", "2", "5"]) == 1
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert err[0] == "Traceback (most recent call last):" and 'raise ValueError("boom")' in \
        captured.err
    assert err[-1] == INTERNAL + "ValueError: boom"
    assert captured.out == ""


def test_decode_cli_a_missing_extra_or_a_path_is_the_users_other_import_errors_are_bugs(
        capsys, monkeypatch, tmp_path):
    import models

    def failing(error):
        def load(*args, **kwargs):
            raise error
        return load

    extra = ImportError(f"{tmp_path} holds a Hugging Face tokenizer; reading it needs "
                        "transformers: pip install 'jax-transformer-zoo[hf]'")
    for error, status in ((extra, 2), (PermissionError(13, "Permission denied", "x"), 2),
                          (ImportError("cannot import name 'gone' from 'somewhere'"), 1)):
        monkeypatch.setattr(models, "load", failing(error))
        assert decode_cli.main(["--model", str(tmp_path), "hi"]) == status, error
        err = capsys.readouterr().err.splitlines()
        if status == 2:
            assert err == [f"error: {error}"]
        else:
            assert err[0] == "Traceback (most recent call last):"
            assert err[-1] == INTERNAL + f"ImportError: {error}"


def test_decode_cli_refusals_of_models_load_are_user_mistakes(capsys, tmp_path):
    """A damaged or unsupported model directory is the user's to fix: exit 2, one line."""
    for name, config in (("damaged", "{"), ("unknown", '{"model_type": "nope"}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config)
        assert decode_cli.main(["--model", str(tmp_path / name), "hi"]) == 2, name
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and str(tmp_path / name) in err[0]


def _decode_process(cache_home, *flags, env=()):
    """`python -m decode` on a preset in a process of its own, with `cache_home` as the
    user's cache directory; returns its exit status."""
    done = subprocess.run(
        [sys.executable, "-m", "decode", "--config", "gpt-tiny", "--max-new-tokens", "3",
         *flags, "5 6 7"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "XDG_CACHE_HOME": str(cache_home), **dict(env)})
    assert done.returncode == 0, done.stderr
    return done


def test_the_command_lines_compile_once_per_machine(tmp_path):
    """The first process fills the persistent compilation cache in the user's cache
    directory; --no-compile-cache leaves it alone; JAX's own setting of a directory wins."""
    _decode_process(tmp_path / "home")
    cached = tmp_path / "home" / "jax-transformer-zoo" / "xla"
    assert len(os.listdir(cached)) > 0
    _decode_process(tmp_path / "off", "--no-compile-cache")
    assert not (tmp_path / "off").exists()
    _decode_process(tmp_path / "unused", env={"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "j")})
    assert len(os.listdir(tmp_path / "j")) > 0 and not (tmp_path / "unused").exists()


def test_a_cache_directory_that_cannot_be_made_is_a_warning(tmp_path, capsys):
    from models.compile_cache import use_compile_cache
    blocker = tmp_path / "file"
    blocker.write_text("")
    import jax
    before = jax.config.jax_compilation_cache_dir
    assert use_compile_cache(str(blocker / "xla")) in (None, before)
    if before is None:
        assert "warning: no compilation cache: cannot create" in capsys.readouterr().err


def test_decode_cli_beam_stopping_rule_is_the_flags_then_the_directorys_then_never():
    """--early-stopping true|false|never wins; a directory with beam settings but no rule
    gets transformers' False (what its generate does); the project's own models, which set
    none, keep decode's exact stop ("never")."""
    from decode import cli_request
    from models import get_config
    from models.pretrained.generation import GenerationDefaults
    cfg = get_config("gpt-tiny")
    parser = decode_cli.build_parser()

    def rule(flags: list[str], gen: GenerationDefaults):
        args = parser.parse_args(["--config", "gpt-tiny", "--strategy", "beam", *flags])
        return cli_request.request_for(args, gen, cfg, prompt_len=4).early_stopping

    own = GenerationDefaults()
    bart = GenerationDefaults(num_beams=4, early_stopping=True)
    marian = GenerationDefaults(num_beams=4)
    assert [rule([], g) for g in (own, bart, marian)] == ["never", True, False]
    for text, value in (("true", True), ("false", False), ("never", "never")):
        assert [rule(["--early-stopping", text], g) for g in (own, bart, marian)] == [value] * 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--config", "gpt-tiny", "--early-stopping", "yes"])
