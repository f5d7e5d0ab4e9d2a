"""bench/whisper.py's code path on its tiny shape (nothing timed is asserted): both sides
run the same number of new tokens on the same random weights and give the same tokens."""

import json

import pytest

from tests import pretrained_helpers as ph

pytest.importorskip("torch")
pytest.importorskip("transformers")
highest_precision = ph.highest_precision                     # the shared fixture


def test_whisper_benchmark_compares_our_beam_search_with_transformers(capsys,
                                                                    highest_precision):
    from bench import whisper
    (line,) = whisper.main(["--quick", "--batch", "2", "--beams", "2", "--repeats", "1"])
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()
               if x.startswith("{")]
    assert printed[-1] == line and "platform" in printed[0]
    assert (line["batch"], line["beams"], line["new_tokens"]) == (2, 2, 8)
    assert line["same_tokens"]                     # equal work: both ran 8 tokens a beam
    assert line["ours_s"] > 0 and line["transformers_s"] > 0 and line["speedup"] > 0
