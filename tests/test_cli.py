"""The command lines run end to end (in-process, tiny presets)."""

import io
import json
import os
import subprocess
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
    with pytest.raises(SystemExit,
                       match="input 1: 'a b' is not a list of space-separated token ids"):
        decode_cli.main(["--config", "gpt-tiny", "a b"])
    with pytest.raises(SystemExit,
                       match=r"prompts hold token id 999 outside \[0, vocab_size=512\)"):
        decode_cli.main(["--config", "gpt-tiny", "5 999"])
    with pytest.raises(SystemExit, match="top_p=0 is outside"):
        decode_cli.main(["--config", "gpt-tiny", "--strategy", "sample", "--top-p", "0", "5"])


def test_decode_benchmark_runs_and_prints_json_lines(capsys):
    """A smoke test of the benchmark's code path (tiny model; nothing is timed or asserted
    about speed)."""
    bench.decode.main(["--quick", "--repeats", "1", "--cases", "b8_t256", "--only", "greedy",
                       "no_cache"])
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    strategies = [line.get("strategy") for line in lines]
    assert strategies[1:] == ["roofline", "greedy", "no_cache", "speedup"]
    assert lines[2]["fraction_of_bound"] > 0 and lines[4]["cached_greedy_over_no_cache"] > 0


def _lines_of_text(n: int) -> str:
    words = "the cat sat on a mat and saw one dog run to its home by the sea".split()
    return "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(5 + i % 6))
                     for i in range(n)) + "\n"


def test_train_cli_runs_a_documented_config_with_overrides_then_decode_reads_the_run(
        data_dir, tmp_path, capsys):
    """`python -m train` as the README gives it (a config name, a local file, ml_collections
    overrides), in a fresh interpreter; then `python -m decode --workdir` on its run."""
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
        decode_cli.main(["--workdir", str(workdir), "--strategy", strategy, "--eos-id",
                         "--beam-size", "2", "--max-new-tokens", "6", "the cat", "a dog"])
        lines = capsys.readouterr().out.rstrip("\n").split("\n")   # what a shell reads
        assert len(lines) == 2, (strategy, lines)


def test_decoded_line_breaks_are_escaped_so_each_output_stays_one_line():
    assert decode_cli._one_line("a\nb\r\nc") == "a\\nb\\r\\nc"


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
    with pytest.raises(SystemExit, match="no checkpoints in"):
        decode_cli.main(["--workdir", str(tmp_path), "hello"])
