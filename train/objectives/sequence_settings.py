"""The `sequence.*` keys: sequence-level training of an encoder-decoder (minimum risk
training or self-critical REINFORCE, `train.objectives.sequence`), a part of
`train.run_config.ObjectiveSettings`, defaults and rules included.

    settings = SequenceSettings(objective="mrt", candidates=4, alpha=0.005, reward="chrf")
    settings.enabled                   # True: the run trains `SequenceLevel`
    SequenceSettings(objective="mrt", candidates=1)
    # UserError: sequence.candidates=1 must be >= 2 for objective='mrt' (...)

`objective` "none" (the default) leaves every other `sequence.*` key unread.
"""

from __future__ import annotations

import dataclasses

from train.config_checks import Part, Rule, boolean, choice, fail, integer, number, setting

OBJECTIVES = ("none", "mrt", "scst")
SAMPLINGS = ("sample", "beam")
BUILT_IN_REWARDS = ("bleu", "chrf")


def _reward_name(v) -> bool:
    if not isinstance(v, str):
        return False
    if v in BUILT_IN_REWARDS:
        return True
    module, sep, function = v.partition(":")
    return bool(sep and module.strip() and function.strip())


@dataclasses.dataclass(frozen=True)
class SequenceSettings(Part):
    """The `sequence.*` keys.

    Attributes:
        objective: "mrt" (minimum risk training, Shen et al. 2016), "scst" (self-critical
            REINFORCE, Rennie et al. 2017), or "none" (token-level training alone).
        candidates: k, the candidates drawn per source (mrt: k >= 2).
        alpha: mrt's sharpness: the candidates' distribution is q ∝ p ** alpha,
            renormalised over the source's distinct candidates.
        reward: "bleu" or "chrf" (sacrebleu's sentence scores / 100, on detokenised text),
            or "module:function", a function f(hypothesis: str, reference: str) -> float.
        include_gold: mrt: the reference is one more candidate (first, so a sample equal
            to it is its duplicate).
        sampling: "sample" (ancestral sampling at `temperature`, `top_k`) or "beam"
            (mrt only: the k best beams).
        temperature: the sampling temperature (> 0).
        top_k: sample among the k most probable tokens only (0: all).
        max_new_tokens: the longest candidate, its end token included.
        loss_weight: w: each target token's loss is (1 - w) x its token loss + w x its
            sentence's sequence loss (0: teacher forcing alone, 1: the sequence loss
            alone).
    """

    prefix = "sequence."
    objective: str = setting("none", choice(*OBJECTIVES))
    candidates: int = setting(4, integer(1))
    alpha: float = setting(0.005, number("> 0", lambda v: v > 0))
    reward: str = setting("bleu", Rule(
        "'bleu', 'chrf' or 'module:function' (a Python function f(hypothesis, reference) "
        "-> float)", _reward_name))
    include_gold: bool = setting(False, boolean())
    sampling: str = setting("sample", choice(*SAMPLINGS))
    temperature: float = setting(1.0, number("> 0", lambda v: v > 0))
    top_k: int = setting(0, integer(0))
    max_new_tokens: int = setting(32, integer(1))
    loss_weight: float = setting(1.0, number("in [0, 1]", lambda v: 0 <= v <= 1))

    @property
    def enabled(self) -> bool:
        return self.objective != "none"

    def check(self) -> None:
        if self.objective == "mrt" and self.candidates < 2:
            raise fail(self.prefix + "candidates", self.candidates,
                       "must be >= 2 for objective='mrt' (the risk compares candidates: "
                       "over one, it is that candidate's cost, with no gradient)")
        if self.objective == "scst" and self.include_gold:
            raise fail(self.prefix + "include_gold", True,
                       "is minimum risk training's option; objective='scst' learns from "
                       "its own samples only")
        if self.objective == "scst" and self.sampling == "beam":
            raise fail(self.prefix + "sampling", "beam",
                       "is minimum risk training's option; objective='scst' needs samples "
                       "(REINFORCE's estimate) against the greedy baseline")
