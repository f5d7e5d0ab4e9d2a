"""`python -m bench.translate --quick`: tiny m2m_100 and marian models translate greedy and
with beam search, ours against transformers' `generate` on the same weights, and agree."""

import json

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_the_quick_run_prints_each_shape_and_strategy_with_equal_tokens(capsys):
    from bench import translate as bench
    assert bench.main(["--quick", "--new-tokens", "5", "--repeats", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()
             if line.startswith("{")]
    assert lines[0]["section"] == "device"
    got = [(x["shape"], x["model_type"], x["strategy"]) for x in lines[1:]]
    assert got == [("tiny-nllb-600m", "m2m_100", "greedy"), ("tiny-nllb-600m", "m2m_100",
                                                              "beam4"),
                   ("tiny-opus-mt", "marian", "greedy"), ("tiny-opus-mt", "marian", "beam4")]
    for x in lines[1:]:
        assert x["agreement"] == 1.0, x              # the same tokens as transformers'
        assert x["ours_s"] > 0 and x["theirs_s"] > 0 and x["sentences"] == 16
        assert x["speedup"] == pytest.approx(x["theirs_s"] / x["ours_s"], rel=0.1)  # rounded


def test_bad_flags_are_refused_by_name(capsys):
    from bench import translate as bench
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "nllb-1b"])
    assert "nllb-1b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--new-tokens", "0"])
    assert "--new-tokens 0" in capsys.readouterr().err
