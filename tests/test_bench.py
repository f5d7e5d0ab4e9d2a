"""bench.train: its FLOP count matches the real models' parameters, and it runs end to end."""

import json

import jax
import jax.numpy as jnp
import pytest

import bench.largest
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


def test_sharded_benchmark_measures_pmap_then_each_mesh_with_ratios(capsys):
    """pmap and two meshes in one run: memory from the compiled steps, ratios to pmap.
    FSDP over 4 devices keeps a quarter of the state per device (llama-tiny has no biases;
    only the step and the key stay whole)."""
    bench.train.main(["--fake-devices", "4", "--model", "llama-tiny", "--batch", "4",
                      "--lengths", "8", "8", "--steps", "1", "--peak-size", "64",
                      "--parallel", "sharded", "--mesh", "1", "4", "1", "--mesh", "1", "2", "2"])
    peak, ref, *meshes = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert peak["what"] == "peak" and ref["parallel"] == "pmap" and "step_time_ratio" not in ref
    assert [m["mesh"] for m in meshes] == [{"data": 1, "fsdp": 4, "tensor": 1},
                                           {"data": 1, "fsdp": 2, "tensor": 2}]
    for line in (ref, *meshes):
        assert line["what"] == "train" and line["mfu_vs_measured_peak"] > 0
        assert line["per_device_bytes"] == (line["state_bytes"] + line["batch_bytes"]
                                            + line["temp_bytes"]
                                            + line["output_not_aliased_bytes"])
    for line in meshes:
        assert line["parallel"] == "sharded" and line["step_time_ratio"] > 0
        assert line["memory_ratio"] == round(line["per_device_bytes"] / ref["per_device_bytes"], 4)
        assert line["state_ratio"] == round(line["state_bytes"] / ref["state_bytes"], 4)
        assert 0.25 <= line["state_ratio"] < 0.26
    assert ref["batch_bytes"] == meshes[0]["batch_bytes"] == 3 * 1 * 8 * 4   # a row each
    assert meshes[1]["batch_bytes"] == 3 * 2 * 8 * 4        # rows split 2 ways, not 4


def test_sharded_benchmark_names_bad_meshes_and_devices():
    with pytest.raises(SystemExit, match="--mesh needs --parallel sharded"):
        bench.train.main(["--mesh", "1", "4", "1"])
    with pytest.raises(SystemExit, match="--mesh 1 3 1: .*3 devices, but there are 4"):
        bench.train.main(["--model", "llama-tiny", "--batch", "4", "--peak-size", "8",
                          "--parallel", "sharded", "--mesh", "1", "3", "1"])
    with pytest.raises(SystemExit, match="--mesh 1 1 4: num_kv_heads=2 does not divide"):
        bench.train.main(["--model", "llama-tiny", "--batch", "4", "--peak-size", "8",
                          "--parallel", "sharded", "--mesh", "1", "1", "4"])
    with pytest.raises(SystemExit, match="--fake-devices 2: JAX has already started with 4"):
        bench.train.main(["--fake-devices", "2"])
    assert bench.largest.parse_bytes("4GiB") == 4 << 30
    assert bench.largest.parse_bytes("3.5GB") == 3_500_000_000
    assert bench.largest.parse_bytes("1e9") == 10 ** 9
    with pytest.raises(SystemExit):                       # argparse: "not a size such as ..."
        bench.train.main(["--memory-budget", "4 lots"])


def test_largest_fitting_follows_the_line_and_bisects_when_it_bends():
    probes = []

    def linear(n):
        probes.append(n)
        return 10 + 3 * n
    assert bench.largest.largest_fitting(linear, 40)[0] == 10 and probes == [1, 2, 10, 11]
    assert bench.largest.largest_fitting(linear, 12)[0] == 0          # not even one layer
    assert bench.largest.largest_fitting(linear, 10 ** 9, limit=64)[0] == 64
    for budget in range(5, 3000, 37):          # convex: the line overshoots; still exact
        n, seen = bench.largest.largest_fitting(lambda n: n * n, budget)
        assert n * n <= budget < (n + 1) ** 2 and len(seen) < 20


def test_largest_model_search_fits_more_layers_under_fsdp_than_under_pmap():
    """The real search at a tiny width, capped at 2 layers to stay cheap: the budget holds
    one layer replicated (pmap needs about 3 MB for one, 4.5 MB for two) but two sharded."""
    probes = []
    found = bench.largest.largest_models(3_500_000, d_model=64, vocab_size=512, length=16,
                                       max_layers=2, report=probes.append)
    pmap, fsdp = found["pmap"], found["fsdp"]
    assert fsdp["layers"] >= pmap["layers"] and (pmap["layers"], fsdp["layers"]) == (1, 2)
    assert fsdp["params"] > pmap["params"] and found["params_ratio"] > 1
    assert fsdp["at_limit"] and not pmap["at_limit"]
    assert [(p["parallel"], p["layers"], p["fits"]) for p in probes] == [
        ("pmap", 1, True), ("pmap", 2, False), ("fsdp", 1, True), ("fsdp", 2, True)]
    # Each layer adds less to a device under FSDP, whose state is a quarter of pmap's.
    assert found["bytes_per_layer_ratio"] > 1
    one = {p["parallel"]: p for p in probes if p["layers"] == 1}
    assert one["fsdp"]["state_bytes"] * 4 == pytest.approx(one["pmap"]["state_bytes"], rel=0.01)
