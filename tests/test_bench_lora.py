"""bench/lora.py's code paths on llama-tiny (nothing timed is asserted), and its shapes."""

import json

import jax
import pytest

import models
from bench import lora
from bench.common import param_count


def test_the_1b_shape_is_llama_3_2_1b():
    """Scanned and rematerialised, with Llama 3.2 1B's published parameter count (abstract:
    nothing is allocated)."""
    cfg = lora.shape_config("llama-1b", 512, "float32")
    assert cfg.scan_layers and cfg.remat and cfg.tie_embeddings
    assert param_count(models.build(cfg)) == 1_235_814_400


@pytest.mark.slow
def test_lora_benchmark_measures_each_variant_against_full_fine_tuning(capsys):
    lora.main(["--quick", "--rank", "4"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    memory = {(x["variant"], x["base_dtype"]): x for x in lines if x["what"] == "memory"}
    assert set(memory) == {("full", None), ("lora", "bfloat16"), ("lora", "float32"),
                           ("lora_qv", "bfloat16")}
    assert not [x for x in lines if x["what"] == "goal"]         # llama-1b was not measured
    full = memory["full", None]
    assert full["trainable_params"] == full["params"] and full["frozen_bytes"] == 0
    assert full["params_bytes"] == 4 * full["params"] and "state_ratio" not in full
    cfg = lora.shape_config("llama-tiny", 16, "float32")
    widths = models.lora.projection_widths(cfg)
    for (variant, base_dtype), line in memory.items():
        # The state's leaves are exactly what the compiled step takes besides the batch.
        assert line["state_bytes"] == line["compiled_state_bytes"]
        assert line["devices"] == jax.local_device_count() == 4
        assert line["total_bytes"] >= line["state_bytes"] + line["temp_bytes"]
        if variant == "full":
            continue
        # Only the adapters train: r x (in + out) a targeted projection, each layer.
        targets = lora.ALL_TARGETS if variant == "lora" else ("query", "value")
        adapters = sum(4 * (w_in + w_out) for site, (w_in, w_out) in widths.items()
                       if site[-1] in targets) * cfg.num_layers
        assert line["trainable_params"] == adapters == line["params"] - full["params"]
        assert line["params_bytes"] == 4 * adapters
        assert 2 * line["params_bytes"] <= line["opt_state_bytes"] < 2 * line["params_bytes"] + 64
        assert line["frozen_bytes"] == full["params_bytes"] // (2 if base_dtype == "bfloat16"
                                                                  else 1)
        assert line["state_ratio"] == round(line["state_bytes"] / full["state_bytes"], 4)
        assert line["total_ratio"] == round(line["total_bytes"] / full["total_bytes"], 4)
    times = [x for x in lines if x["what"] == "step_time"]
    assert [x["variant"] for x in times] == ["full", "lora", "lora", "lora_qv"]
    assert all(x["step_s_median"] > 0 for x in times) and "step_time_ratio" not in times[0]
    assert all(x["step_time_ratio"] > 0 for x in times[1:])
