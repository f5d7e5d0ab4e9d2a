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
