"""bench/quantize.py's code paths (tiny shapes): the bytes of each scheme within the goals
once the tables are quantized too, a speed line per variant with its ratios, and BLEU of a
trained run's export in each scheme."""

import json

import pytest

from models.quant import SCHEMES
from tests.train_helpers import straight_run


def _lines(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]


@pytest.mark.slow
def test_the_quick_run_prints_bytes_speed_and_bleu_lines(capsys, data_dir):
    from bench import quantize as bench
    workdir, _ = straight_run(data_dir)
    assert bench.main(["--quick", "--repeats", "1", "--workdir", workdir,
                       "--examples", "8"]) == 0
    lines = _lines(capsys)
    sizes = [x for x in lines if x["section"] == "bytes"]
    assert [x["shape"] for x in sizes] == ["tiny-seq2seq", "tiny-decoder"]
    for x in sizes:
        assert x["int8_all_over_float32"] <= 0.27 and x["int4_all_over_float32"] <= 0.15, x
        assert x["int4_over_float32"] < x["int8_over_float32"] < 1
    speed = [x for x in lines if x["section"] == "speed"]
    variants = ["float32", "bfloat16", *SCHEMES]
    seq2seq = [x["variant"] for x in speed if x["shape"] == "tiny-seq2seq"]
    assert seq2seq == variants * 2                       # greedy and beam4 (B2)
    assert [x["batch"] for x in speed if x["shape"] == "tiny-decoder"] == [1] * len(variants)
    assert all(x["new_tokens_per_s"] > 0 and x["over_float32"] > 0 for x in speed)
    assert all("over_bfloat16" in x for x in speed if x["variant"] in SCHEMES)
    bleu = [x for x in lines if x["section"] == "bleu"]
    assert [x["variant"] for x in bleu] == ["float32", *SCHEMES]
    assert all(0 <= x["bleu"] <= 100 and x["examples"] == 8 for x in bleu)
    assert all(0 <= x["tokens_equal_float32"] <= 1 for x in bleu[1:])


def test_bleu_without_a_trained_run_says_how_to_make_one(capsys, tmp_path):
    from bench import quantize as bench
    assert bench.main(["--quick", "--only", "bleu", "--workdir", str(tmp_path)]) == 2
    assert "python -m train" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--only", "speeed"])
