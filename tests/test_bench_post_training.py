"""bench/post_training.py: its data, its arms' configs and scoring, and its whole path on
a tiny start and budget (nothing measured is asserted)."""

import json

import pytest

from bench import post_training


def test_the_data_are_the_prompts_splits_and_the_arms_share_the_start(tmp_path):
    files, test = post_training.write_data(str(tmp_path))
    train = open(files.split(",")[0]).read().splitlines()
    assert len(train) == 20_000 and len(test) == 1_000
    prompt, answer = test[0]
    assert prompt.endswith("=") and eval(prompt[:-1]) == int(answer)      # noqa: S307
    assert not {line.split("=")[0] for line in train} & {p[:-1] for p, _ in test}
    base = post_training.base_config(files, steps=10, data_dir="/d")
    sft = post_training.arm_config("sft", {}, base=base, init_from="M", lr=1e-3, warmup=2)
    grpo = post_training.arm_config("grpo", {"grpo.num_generations": "16"}, base=base,
                                    init_from="M", lr=1e-3, warmup=2)
    for c in (sft, grpo):
        assert c.init_from == "M" and c.learning_rate == 1e-3 and c.lr_decay == "constant"
    assert sft.dataset == "local_text" and sft.data_files == files
    assert grpo.dataset == "addition_prompts" and grpo.grpo.num_generations == 16
    assert grpo.grpo.reward == "exact_match"


@pytest.mark.slow
def test_a_quick_run_prints_the_start_each_arm_its_score_and_the_gains(tmp_path, data_dir,
                                                                        capsys):
    assert post_training.main(["--out", str(tmp_path), "--data-dir", data_dir, "--quick"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()
             if line.startswith("{")]
    what = [(line["what"], line.get("arm")) for line in lines]
    assert what == [("base", None), ("arm", "sft"), ("arm", "grpo"), ("score", "start"),
                    ("score", "sft"), ("score", "grpo"), ("gain", "sft"), ("gain", "grpo")]
    for line in lines:
        if line["what"] == "score":
            assert 0 <= line["exact_match"] <= 1 and line["prompts"] == 50
    assert "exact_match_vs_sft" in lines[-1] and lines[1]["charged_s"] >= 2.0
