"""bench/moe.py's code paths on the tiny shape (nothing timed is asserted), and its shapes."""

import json

import pytest

from bench import moe


def test_the_dense_variant_has_the_mixtures_active_parameters():
    """dense: an MLP of k x the expert width, beside 8 experts, top 2."""
    for shape in moe.SHAPES:
        dense = moe.variant_config(shape, "dense", 16)
        mixture = moe.variant_config(shape, "moe_ragged", 16)
        assert (mixture.num_experts, mixture.experts_per_token) == (8, 2)
        assert dense.mlp_dim == 2 * mixture.expert_width and not dense.num_experts
        assert moe.variant_config(shape, "moe_dense", 16).moe_dispatch == "dense"
        oss = moe.variant_config(shape, "gpt_oss", 16)
        assert (oss.use_bias, oss.attention_sinks, oss.activation, oss.moe_dispatch) == (
            True, True, "clamped_swiglu", "ragged")
        assert oss.layer_types[:2] == ("sliding", "full") and oss.sliding_window == 4
        deepseek = moe.variant_config(shape, "deepseek_v3", 16)
        assert deepseek.latent and deepseek.router_groups == 4 and deepseek.router_score_bias
        assert deepseek.experts_per_token == 1                  # beside the shared expert
        assert deepseek.shared_expert_mlp_dim == mixture.expert_width


@pytest.mark.slow
def test_moe_benchmark_times_each_variant_against_the_dense_model(capsys):
    moe.main(["--quick", "--rows", "1"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["variant"] for x in lines] == ["dense", "moe_ragged", "moe_dense", "gpt_oss",
                                             "deepseek_v3"]
    dense, ragged, every, oss, deepseek = lines
    # A token's share of the mixture is the dense model's plus each layer's router [D, E].
    d, layers = 64, 2
    assert ragged["active_params"] - dense["active_params"] == layers * d * 8
    assert ragged["params"] == every["params"] > ragged["active_params"]
    assert all(x["step_s_median"] > 0 for x in lines) and "step_time_ratio" not in dense
    assert ragged["step_time_ratio"] > 0 and every["step_time_ratio"] > 0
    # GPT-OSS's layer adds biases: each layer's router [E], the experts' [E, 2F + D], the
    # attention's q, k, v [(N + 2K) H] and out [D], and its sinks [N]; heads 4 of 16, kv 2.
    oss_extra = layers * (8 + 8 * (2 * 64 + d) + (4 + 2 * 2) * 16 + d + 4)
    assert oss["params"] - ragged["params"] == oss_extra
    assert oss["params"] - oss["active_params"] == ragged["params"] - ragged["active_params"] \
        + layers * 6 * (2 * 64 + d)
    # DeepSeek-V3's layer: a token uses one routed and one shared expert (the same MLP
    # width as the others), the router and its selection bias; 7 experts unused a layer.
    assert deepseek["params"] - deepseek["active_params"] == layers * 7 * 3 * d * 64
    assert deepseek["step_time_ratio"] > 0
