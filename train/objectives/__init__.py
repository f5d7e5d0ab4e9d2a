"""Training objectives: what a run predicts, from which inputs, scored how.

    base.py                the interface every objective implements (`Objective`)
    next_token.py          teacher forcing, both generative families (`NextToken`)
    scheduled_sampling.py  next-token prediction's option against exposure bias
    masked_lm.py           BERT's masked LM (`MaskedLM`)
    classification.py      an encoder-only classifier's labels (`Classification`)
    registry.py            which objective a model trains with on which data (`fit`)
"""

from train.objectives.base import Objective
from train.objectives.classification import Classification
from train.objectives.masked_lm import MaskedLM
from train.objectives.next_token import NextToken
from train.objectives.registry import ENTRIES, entry_for, fit
from train.objectives.scheduled_sampling import ScheduledSampling

__all__ = ["ENTRIES", "Classification", "MaskedLM", "NextToken", "Objective",
           "ScheduledSampling", "entry_for", "fit"]
