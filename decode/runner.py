"""`run`: a `DecodeRequest` decoded whatever its strategy, the best sequence of each row.

    out = decode.run(model, params, prompts, lengths, request, rng=key)
    out.tokens, out.lengths        # int32[B, N], int32[B]

This is the one place that chooses between the two computations: a "beam" request runs
`decode.beam_search` and keeps each row's best beam; a "greedy" or "sample" one runs
`decode.generate`. The text service (`decode.text`), `python -m decode` and training's
evaluation all decode through it.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
from jaxtyping import Array, Int

from decode.beam import beam_search
from decode.generate import generate
from decode.request import DecodeRequest
from models.errors import UserError


@flax.struct.dataclass
class Decoded:
    """What `run` returns: each row's best sequence.

    Attributes:
        tokens: int32[B, N] new tokens; after the end token, the config's pad_id (0 when it
            has none).
        lengths: int32[B] new tokens up to and including the end token.
    """

    tokens: Int[Array, "B N"]
    lengths: Int[Array, " B"]


@flax.struct.dataclass
class Draft:
    """A draft model for speculative decoding (`decode.speculative`): its module (static),
    its parameters, and the tokens it proposes per iteration (static)."""

    model: nn.Module = flax.struct.field(pytree_node=False)
    params: object
    tokens: int = flax.struct.field(pytree_node=False, default=4)


def run(model: nn.Module, params, prompts, lengths, request: DecodeRequest, *,
        rng: jax.Array | None = None, draft: Draft | None = None) -> Decoded:
    """Decodes `prompts` as `request` says: beam search's best beam, or generate's tokens.

    Args:
        model, params, prompts, lengths: as in `decode.generate`.
        request: a `decode.DecodeRequest` that sets max_new_tokens.
        rng: the PRNG key a "sample" request draws from (required then).
        draft: a `Draft` that proposes tokens for greedy decoding or sampling (speculative
            decoding: the same tokens, or the same distribution, faster), or None.

    Raises:
        UserError: naming the argument, its value and the limit it breaks.
    """
    if not isinstance(request, DecodeRequest):
        raise UserError(f"request must be a decode.DecodeRequest, got {type(request).__name__}")
    if request.strategy == "beam":
        if draft is not None:
            raise UserError("a draft model speeds up greedy decoding and sampling, not beam "
                            "search")
        beams = beam_search(model, params, prompts, lengths, request)
        return Decoded(beams.tokens[:, 0], beams.lengths[:, 0])
    speculative = {} if draft is None else dict(
        draft_model=draft.model, draft_params=draft.params, draft_tokens=draft.tokens)
    out = generate(model, params, prompts, lengths, request, rng=rng, **speculative)
    return Decoded(out.tokens, out.lengths)
