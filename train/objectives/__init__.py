"""Training objectives: what a run predicts, from which inputs, scored how.

    base.py                the interface every objective implements (`Objective`)
    next_token.py          teacher forcing, both generative families (`NextToken`)
    scheduled_sampling.py  next-token prediction's option against exposure bias
    masked_lm.py           BERT's masked LM (`MaskedLM`)
    classification.py      an encoder-only classifier's labels (`Classification`)
    sequence.py            sequence-level training: minimum risk training, self-critical
                           REINFORCE (`SequenceLevel`); sequence_settings.py its keys,
                           sequence_candidates.py, sequence_rewards.py, sequence_risk.py
                           its draws, host rewards and losses
    registry.py            which objective a model trains with on which data (`fit`)
"""

from train.objectives.base import Objective
from train.objectives.classification import Classification
from train.objectives.masked_lm import MaskedLM
from train.objectives.next_token import NextToken
from train.objectives.registry import ENTRIES, entry_for, fit
from train.objectives.scheduled_sampling import ScheduledSampling
from train.objectives.sequence import SequenceLevel
from train.objectives.sequence_settings import SequenceSettings

__all__ = ["ENTRIES", "Classification", "MaskedLM", "NextToken", "Objective",
           "ScheduledSampling", "SequenceLevel", "SequenceSettings", "entry_for", "fit"]
