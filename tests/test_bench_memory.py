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
    assert {x["mlp_chunks"] for x in grads if x["loss"] == "sliced"} == {1, 4}
    assert {x["mlp_chunks"] for x in grads if x["loss"] == "whole"} == {1}
    prefills = {(x["impl"], x["mode"]) for x in lines if x["case"] == "prefill"}
    assert prefills == {(i, m) for i in ("xla", "chunked") for m in ("one_block", "chunks")}
    ratio = [x for x in lines if x.get("what") == "ratio_at_4096"]
    assert not ratio                                        # 4096 was not measured


def test_the_cache_lines_weigh_the_latent_cache_against_gqa_and_expanded_heads():
    """DeepSeek-V3's cache per token: 61 layers x (512 + 64) bfloat16 numbers; a Llama of
    its width with 8 kv heads of 128 keeps 61 x 2 x 8 x 128; the expanded heads 61 x 128 x
    (192 + 128). Per token, so the same at every T."""
    lines = memory.cache_lines((1024, 2048))
    got = {(x["model"], x["T"]): x["bytes_per_token"] for x in lines}
    for T in (1024, 2048):
        assert got["deepseek_v3_latent", T] == 61 * 576 * 2
        assert got["llama_gqa_8x128", T] == 61 * 2 * 8 * 128 * 2
        assert got["expanded_128_heads", T] == 61 * 128 * 320 * 2
    assert {x["over_latent"] for x in lines if x["model"] == "llama_gqa_8x128"} == {3.56}


def test_qwen3_nexts_decode_state_grows_only_in_its_attention_layers():
    """One row of Qwen3-Next-80B-A3B in bfloat16: 12 attention layers keep 2 kv heads of
    256 per token (keys and values); 36 linear layers keep a float32 state of 32 heads of
    128 x 128 and a window of 3 inputs of their 8192 channels, whatever T; every layer full
    attention would keep 48 layers' keys and values."""
    lines = memory.decode_state_lines((1024, 2048))
    linear = 36 * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2)
    for x, T in zip(lines, (1024, 2048), strict=True):
        assert x["kv_bytes"] == 12 * 2 * 2 * 256 * 2 * T
        assert x["linear_state_bytes"] == linear
        assert x["all_full_attention_bytes"] == 48 * 2 * 2 * 256 * 2 * T
        assert x["over_all_full_attention"] == round((x["kv_bytes"] + linear)
                                                     / x["all_full_attention_bytes"], 3)
