"""bench/serve.py's code paths (a smoke run: a tiny model, four requests): every mode
prints its line and the summary its ratios; every request makes its tokens."""

import json

import pytest


@pytest.mark.slow
def test_the_quick_run_prints_each_mode_and_the_summary(capsys):
    from bench import serve as bench
    bench.main(["--quick", "--requests", "4", "--max-slots", "2"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    modes = [(x.get("mode"), x.get("rate")) for x in lines if "mode" in x]
    assert [m for m, _ in modes] == ["engine_compile", "engine", "engine", "static", "serial"]
    assert modes[1][1] == "saturation" and isinstance(modes[2][1], float)
    summary = lines[-1]
    assert summary["summary"] is True
    for key in ("throughput_vs_static", "throughput_vs_serial", "ttft_p99_s", "itl_p99_s",
                "ttft_excess_p99_steps", "decode_step_s"):
        assert summary[key] is not None and summary[key] > -1e9, key
