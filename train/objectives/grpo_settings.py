"""The `grpo.*` keys: group-relative policy optimisation of a decoder-only model on prompts
with verifiable answers (`train.objectives.grpo`), a part of
`train.run_config.ObjectiveSettings`, defaults and rules included.

    settings = GrpoSettings(num_generations=8, beta=0.04, reward="exact_match")
    GrpoSettings(loss="dr_grpo", epsilon_high=0.28)       # Dr. GRPO, DAPO's higher clip

The keys are read only with prompt data (`dataset='local_prompts'` or `addition_prompts`);
a run on other data refuses them.
"""

from __future__ import annotations

import dataclasses

from train.config_checks import Part, Rule, choice, fail, integer, number, setting

LOSSES = ("grpo", "dr_grpo")
BUILT_IN_REWARDS = ("exact_match", "number")


def _rewards(v) -> bool:
    if not isinstance(v, str) or not v.strip():
        return False
    for name in v.split(","):
        name = name.strip()
        module, sep, function = name.partition(":")
        if name not in BUILT_IN_REWARDS and not (sep and module.strip() and function.strip()):
            return False
    return True


@dataclasses.dataclass(frozen=True)
class GrpoSettings(Part):
    """The `grpo.*` keys.

    Attributes:
        num_generations: G, the completions drawn per prompt (the group), >= 2.
        max_new_tokens: each completion's longest length, its end token included.
        temperature: the sampling temperature of the rollouts and of the log-probs the
            loss compares (> 0).
        top_k: sample among the k likeliest tokens only (0: all).
        beta: the weight of the KL penalty to the reference (the k3 estimator); 0 reads no
            reference.
        epsilon: the ratio's clip below, 1 - epsilon.
        epsilon_high: the clip above, 1 + epsilon_high (DAPO's "clip higher"); 0: epsilon.
        loss: "grpo" (advantages scaled by the group's standard deviation, each
            completion's tokens averaged) or "dr_grpo" (Liu et al. 2025: no scaling, the
            tokens summed over max_new_tokens).
        reward: comma-separated rewards, summed: "exact_match" (1 when the completion,
            stripped, equals the prompt's answer), "number" (1 when it is a number: a
            format check), or "module:function", a Python function
            f(prompts, completions, answers) -> a float per completion (with a `fields`
            keyword, it also gets each prompt's line: every field of a local_prompts
            JSON object).
    """

    prefix = "grpo."
    num_generations: int = setting(4, integer(2))
    max_new_tokens: int = setting(16, integer(1))
    temperature: float = setting(1.0, number("> 0", lambda v: v > 0))
    top_k: int = setting(0, integer(0))
    beta: float = setting(0.04, number(">= 0", lambda v: v >= 0))
    epsilon: float = setting(0.2, number("in (0, 1)", lambda v: 0 < v < 1))
    epsilon_high: float = setting(0.0, number(">= 0", lambda v: v >= 0))
    loss: str = setting("grpo", choice(*LOSSES))
    reward: str = setting("exact_match", Rule(
        "comma-separated 'exact_match', 'number' or 'module:function' (a Python function "
        "f(prompts, completions, answers[, *, fields]) -> floats)", _rewards))

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    @property
    def clip_high(self) -> float:
        return self.epsilon_high or self.epsilon

    def check(self) -> None:
        if self.epsilon_high and self.epsilon_high < self.epsilon:
            raise fail(self.prefix + "epsilon_high", self.epsilon_high,
                       f"must be >= grpo.epsilon={self.epsilon} (a higher clip above), or 0")
