"""The `dpo.*` keys: preference training of a decoder-only model on (prompt, chosen,
rejected) pairs (`train.objectives.preference`), a part of
`train.run_config.ObjectiveSettings`, defaults and rules included.

    settings = PreferenceSettings(loss="sigmoid", beta=0.1)     # DPO
    PreferenceSettings(loss="simpo", beta=2.0, simpo_gamma=0.5) # SimPO: no reference

The keys are read only with preference data (`dataset='local_preference'`, or a generated
preference task); a run on other data refuses them.
"""

from __future__ import annotations

import dataclasses

from train.config_checks import Part, choice, number, setting

LOSSES = ("sigmoid", "ipo", "simpo")
# The losses that compare the policy with a reference model (SimPO needs none).
WITH_REFERENCE = ("sigmoid", "ipo")


@dataclasses.dataclass(frozen=True)
class PreferenceSettings(Part):
    """The `dpo.*` keys.

    Attributes:
        loss: "sigmoid" (DPO, Rafailov et al. 2023: -log sigmoid(beta x the chosen minus
            the rejected log-ratio against the reference)); "ipo" (Azar et al. 2023: the
            squared distance of that difference, with per-token mean log-probs, from
            1 / (2 beta)); "simpo" (Meng et al. 2024, reference-free: -log sigmoid(beta x
            the chosen minus the rejected mean token log-prob - simpo_gamma)).
        beta: the strength of the preference against the reference (DPO's beta; SimPO's
            reward scale, which its authors set to 2-2.5).
        simpo_gamma: SimPO's target margin between the two rewards (read by "simpo").
    """

    prefix = "dpo."
    loss: str = setting("sigmoid", choice(*LOSSES))
    beta: float = setting(0.1, number("> 0", lambda v: v > 0))
    simpo_gamma: float = setting(0.5, number(">= 0", lambda v: v >= 0))

    @property
    def needs_reference(self) -> bool:
        return self.loss in WITH_REFERENCE
