"""The project's three "minus infinity"s, side by side, each with the reason it is what it is.

    MASKED_LOGIT       attention logits of keys a query may not see. Finite (float32's
                       lowest), so a query row that sees no key at all still has a finite
                       softmax (uniform over its masked keys) instead of NaN; the attention
                       core then zeroes that row's probabilities.
    REMOVED_LOGIT      next-token logits a processor removes (top-k, top-p, min-p). -inf, so
                       the token's probability is exactly 0: neither `argmax` nor
                       `jax.random.categorical` can pick it, and a softmax over the survivors
                       renormalises exactly.
    NO_SEQUENCE_SCORE  beam-search score of an empty slot (no beam, no finished sequence).
                       Finite (-1e30), so adding a log-prob to it or dividing it by a length
                       penalty stays finite and ordered, yet no real score comes near it (a
                       sum of log-probs of a few thousand tokens is above -1e7).
"""

from __future__ import annotations

import numpy as np

MASKED_LOGIT = float(np.finfo(np.float32).min)
REMOVED_LOGIT = float("-inf")
NO_SEQUENCE_SCORE = -1.0e30
