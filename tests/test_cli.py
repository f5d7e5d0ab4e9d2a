"""The command lines run end to end (in-process, tiny presets)."""

import io
import json
import sys

import pytest

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


def test_decode_cli_reads_stdin_and_matches_the_api(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("5 6 7\n\n9 10\n"))
    decode_cli.main(["--config", "transformer-tiny", "--max-new-tokens", "4", "--eos-id"])
    assert len(capsys.readouterr().out.strip().splitlines()) == 2


def test_decode_cli_errors_are_clear():
    with pytest.raises(SystemExit, match="unknown config 'nope'"):
        decode_cli.main(["--config", "nope", "1 2"])
    with pytest.raises(SystemExit, match="input 1: 'a b' is not a list of space-separated token ids"):
        decode_cli.main(["--config", "gpt-tiny", "a b"])
    with pytest.raises(SystemExit, match=r"prompts hold token id 999 outside \[0, vocab_size=512\)"):
        decode_cli.main(["--config", "gpt-tiny", "5 999"])
    with pytest.raises(SystemExit, match="top_p=0 is outside"):
        decode_cli.main(["--config", "gpt-tiny", "--strategy", "sample", "--top-p", "0", "5"])


def test_decode_benchmark_runs_and_prints_json_lines(capsys):
    """A smoke test of the benchmark's code path (tiny model; nothing is timed or asserted
    about speed)."""
    bench.decode.main(["--quick", "--repeats", "1", "--cases", "b8_t256", "--only", "greedy", "no_cache"])
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    strategies = [line.get("strategy") for line in lines]
    assert strategies[1:] == ["roofline", "greedy", "no_cache", "speedup"]
    assert lines[2]["fraction_of_bound"] > 0 and lines[4]["cached_greedy_over_no_cache"] > 0
