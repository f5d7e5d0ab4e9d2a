"""bench/step_overhead.py's code paths (tiny shapes): a line per section, each ratio
computed from its own measurements (the joined/apart comparison refuses steps whose tokens
differ)."""

import json

import pytest


def test_the_quick_run_prints_step_call_product_and_joined_lines(capsys):
    from bench import step_overhead as bench

    assert bench.main(["--quick"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by_section = {line["section"]: line for line in lines[1:]}
    assert set(by_section) == {"step", "call", "product", "joined_qkv"}
    step = by_section["step"]
    assert step["per_operation_share"] == pytest.approx(
        step["narrow_step_ms"] / step["step_ms"], abs=2e-3)
    call = by_section["call"]
    assert call["host_us_warm"] > 0 and call["host_us_per_structure_cache_emptied"] > 0
    product = by_section["product"]
    assert product["one_over_three"] == pytest.approx(
        product["one_product_GB_per_s"] / product["three_products_GB_per_s"], rel=0.02)
    joined = by_section["joined_qkv"]
    assert joined["speedup"] == pytest.approx(
        joined["step_ms_apart"] / joined["step_ms_joined"], rel=0.01)

