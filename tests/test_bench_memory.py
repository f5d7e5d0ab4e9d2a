"""bench/memory.py's code paths on tiny lengths (nothing timed is asserted)."""

import json

import pytest

from bench import memory


@pytest.mark.slow
def test_memory_benchmark_prints_grad_prefill_and_summary_lines(capsys):
    memory.main(["--lengths", "64", "128", "2048", "--time-up-to", "0", "--policies", "full",
                 "names"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    grads = [x for x in lines if x["case"] == "grad"]
    assert {(x["impl"], x["policy"], x["loss"]) for x in grads} == {
        ("xla", "full", "whole"), ("chunked", "full", "whole"), ("auto", "full", "whole"),
        ("chunked", "full", "sliced"), ("chunked", "names", "whole")}
    assert all(x["temp_bytes"] > 0 and x["argument_bytes"] > 0 for x in grads)
    by = {(x["impl"], x["loss"], x["T"]): x["temp_bytes"] for x in grads
          if x["policy"] == "full"}
    assert by["chunked", "whole", 2048] < by["xla", "whole", 2048]   # no T x S array to keep
    assert by["chunked", "sliced", 2048] < by["chunked", "whole", 2048]   # nor a T x V one
    assert {x["loss_chunks"] for x in grads if x["loss"] == "sliced"} == {1, 4}
    prefills = {(x["impl"], x["mode"]) for x in lines if x["case"] == "prefill"}
    assert prefills == {(i, m) for i in ("xla", "chunked") for m in ("one_block", "chunks")}
    ratio = [x for x in lines if x.get("what") == "ratio_at_4096"]
    assert not ratio                                        # 4096 was not measured
