"""bench/sequence_gain.py: its arms' configs, the turns that keep its comparison fair, and
its whole path on a tiny start and budget (nothing measured is asserted)."""

import json

import pytest

from bench import sequence_gain


class _Clocked:
    """A stand-in arm whose steps cost `step_s` charged seconds each."""

    def __init__(self, step_s):
        self.step_s, self.charged, self.turns = step_s, 0.0, []

    def advance(self, seconds):
        self.turns.append(seconds)
        goal = self.charged + seconds
        while self.charged < goal:
            self.charged += self.step_s


def test_the_arms_take_turns_until_each_has_its_budget():
    fast, slow = _Clocked(0.1), _Clocked(0.7)
    sequence_gain.race([fast, slow], budget=3.0, slice_s=1.0)
    for arm in (fast, slow):
        assert 3.0 <= arm.charged < 3.0 + arm.step_s     # never more than one step over
    assert fast.turns[:2] == [1.0, 1.0] and len(slow.turns) <= len(fast.turns)


def test_arm_configs_share_the_start_lengths_data_and_learning_rate():
    base = sequence_gain.base_config("toy", sequence_gain.data_keys("toy", None, "/d"),
                                     steps=40, seconds=0)
    made = {}
    for spec in ("tf", "ss", "mrt", "scst:sequence.candidates=3,learning_rate=1e-3"):
        label, preset, overrides = sequence_gain.parse_arm(spec)
        made[label] = sequence_gain.arm_config(preset, overrides, base=base, init_from="M",
                                               lr=3e-4, warmup=5, ss_ramp=50)
    for c in made.values():
        assert (c.init_from, c.dataset, c.data_dir, c.lr_decay) == (
            "M", "toy_translation", "/d", "constant")
        assert c.max_target_length == base.max_target_length and c.num_test_decode == 0
    assert made["tf"].per_device_batch_size == base.per_device_batch_size
    assert not made["tf"].scheduled_sampling.enabled and made["ss"].scheduled_sampling.enabled
    assert made["mrt"].sequence.objective == "mrt" and made["mrt"].learning_rate == 3e-4
    scst = made["scst:sequence.candidates=3,learning_rate=1e-3"]
    assert (scst.sequence.objective, scst.sequence.candidates, scst.learning_rate) == (
        "scst", 3, 1e-3)
    with pytest.raises(SystemExit):
        sequence_gain.parse_arm("nope")


@pytest.mark.slow
def test_a_tiny_comparison_prints_each_arm_its_scores_and_the_gain(tmp_path, data_dir,
                                                                    capsys):
    small = ("model_overrides.num_encoder_layers=1,model_overrides.num_decoder_layers=1,"
             "model_overrides.d_model=32,model_overrides.mlp_dim=64,per_device_batch_size=4")
    sequence_gain.main(["--task", "toy", "--data-dir", data_dir, "--out", str(tmp_path),
                        "--base-steps", "4", "--base-overrides", small, "--budget", "0.5",
                        "--slice", "0.25", "--test-pairs", "4", "--arms", "tf", "mrt"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()
             if x.startswith("{")]
    by = {(x["what"], x.get("arm")): x for x in lines}
    assert by["base", None]["step"] == 4
    for arm in ("tf", "mrt"):
        line = by["arm", arm]
        assert line["charged_s"] >= 0.5 and line["steps"] >= 2 and line["first_step_s"] > 0
    for arm in ("start", "tf", "mrt"):
        score = by["score", arm]
        assert score["pairs"] == 4 and 0 <= score["beam_bleu"] <= 100
        assert score["beam_size"] == 4 and score["validation_nll"] > 0
    assert by["score", "start"]["step"] == 4
    assert set(by["gain", "mrt"]) >= {"beam_bleu_vs_start", "beam_bleu_vs_tf", "steps_vs_tf"}
