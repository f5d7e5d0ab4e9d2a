"""bench.train: its FLOP count matches the real models' parameters, and it runs end to end."""

import json

import jax
import jax.numpy as jnp
import pytest

import bench.train
import models


def _kernel_sizes(cfg):
    """Sizes of the matmul weights of the built model: every `*kernel` leaf, by owner."""
    model = models.build(cfg)
    x = jnp.ones((1, 4), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0),
                            *((x, x) if cfg.is_encoder_decoder else (x,)))["params"]
    layers, head = 0, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        if name.endswith("kernel']"):
            if name.startswith("['head']"):
                head += leaf.size
            else:
                layers += leaf.size
    return layers, head


@pytest.mark.parametrize("name,overrides", [
    ("transformer-tiny", {}), ("gpt-tiny", {}), ("llama-tiny", {}),          # GQA + SwiGLU
    ("transformer-tiny", dict(num_kv_heads=1, num_encoder_layers=3)),         # MQA, uneven
])
def test_flop_count_uses_exactly_the_models_matmul_parameters(name, overrides):
    cfg = models.get_config(name, **overrides)
    layers, head = _kernel_sizes(cfg)
    f = bench.train.model_flops(cfg, batch=1, src_len=1, tgt_len=1)
    out_proj = cfg.d_model * cfg.vocab_size
    assert head in (0, out_proj)                    # untied: the head; tied: the embedding
    assert (f["matmul_params_per_source_token"] + f["matmul_params_per_target_token"]
            - out_proj) == layers
    # One token each side: 6 x params + attention over a single key per layer.
    nh = cfg.num_heads * cfg.head_dim
    n_attn = (cfg.num_encoder_layers + 2 * cfg.num_decoder_layers if cfg.is_encoder_decoder
              else cfg.num_layers)
    assert f["model_flops_per_step"] == 6 * (layers + out_proj) + 3 * 4 * nh * n_attn


def test_train_benchmark_prints_a_peak_and_a_train_line(capsys):
    """A smoke test of the code path (tiny model; nothing about speed is asserted)."""
    bench.train.main(["--model", "transformer-tiny", "--batch", "4", "--lengths", "8", "6",
                      "--steps", "1", "--peak-size", "64"])
    peak, train = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert peak["what"] == "peak" and peak["measured_matmul_flops_per_s"] > 0
    assert train["what"] == "train" and train["devices"] == 4
    assert train["model_flops_per_step"] == bench.train.model_flops(
        models.get_config("transformer-tiny", max_len=8), 4, 8, 6)["model_flops_per_step"]
    assert 0 < train["mfu_vs_measured_peak"] and train["target_tokens_per_s"] > 0


def test_train_benchmark_names_bad_arguments():
    with pytest.raises(SystemExit, match="unknown config 'gpt5'"):
        bench.train.main(["--model", "gpt5"])
    with pytest.raises(SystemExit, match="--batch 6 must be a multiple of the 4 devices"):
        bench.train.main(["--model", "gpt-tiny", "--batch", "6"])


def test_load_benchmark_worker_measures_our_load_and_save_of_a_checkpoint(tmp_path, key):
    """bench.load's worker in this process, on a tiny checkpoint (nothing about speed or
    memory size is asserted)."""
    import os

    import bench.load
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("bench.load reads /proc/self (Linux)")
    cfg = models.get_config("gpt-tiny")
    params = jax.jit(models.build(cfg).init)(key, jnp.ones((1, 4), jnp.int32))["params"]
    models.save(str(tmp_path / "tiny"), cfg, params)
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

    load = bench.load.worker("ours", "load", str(tmp_path / "tiny"), "float32")
    assert load["param_bytes"] == n_bytes and load["seconds"] > 0 and load["second_s"] > 0
    # Other threads may free pages between the peak's reset and the baseline's reading: the
    # two agree only roughly (the increase is clipped at 0).
    assert load["peak_rss_bytes"] > 0 and load["peak_increase_bytes"] >= 0
    assert load["peak_over_params"] == round(load["peak_increase_bytes"] / n_bytes, 3)
    save = bench.load.worker("ours", "save", str(tmp_path / "tiny"), "bfloat16")
    assert save["param_bytes"] == n_bytes // 2
    assert n_bytes // 2 < save["saved_bytes"] < n_bytes     # bfloat16 weights and the JSON
    json.dumps([load, save])                                # one JSON line each


def test_load_benchmark_keeps_the_best_time_and_the_largest_memory_and_divides_ours_by_theirs():
    import bench.load

    mib = 1 << 20

    def run(side, seconds, peak_mib):
        return {"side": side, "seconds": seconds, "touch_s": seconds / 10,
                "param_bytes": 100 * mib, "peak_increase_bytes": peak_mib * mib,
                "used_increase_bytes": peak_mib * mib // 2}

    lines = {}
    for disk in bench.load.DTYPES:
        for op in ("load", "save"):
            lines[(disk, op, "ours")] = bench.load.best_of([run("ours", 3.0, 400),
                                                            run("ours", 2.0, 300)])
            lines[(disk, op, "theirs")] = bench.load.best_of([run("theirs", 1.0, 100)])
    ours = lines[("float32", "load", "ours")]
    assert ours["seconds"] == 2.0 and ours["seconds_all"] == [3.0, 2.0] and ours["touch_s"] == 0.2
    assert ours["peak_increase_bytes"] == 400 * mib and ours["used_increase_bytes"] == 200 * mib
    assert ours["param_bytes"] == 100 * mib and ours["peak_over_params"] == 4.0
    r = bench.load.ratios(lines)
    assert set(r) == {"float32", "bfloat16"}
    assert r["bfloat16"] == {"load_time_ratio": 2.0, "load_peak_ratio": 4.0,
                             "save_time_ratio": 2.0, "save_peak_ratio": 4.0,
                             "load_used_ratio": 4.0, "ours_load_peak_over_params": 4.0}
