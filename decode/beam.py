"""`beam_search`: the W best continuations with a GNMT length penalty, one jitted `lax.scan`.

    beams = decode.beam_search(model, params, prompts, lengths, beam_size=4,
                               max_new_tokens=64, length_penalty=0.6, eos_id=1)

Each iteration expands the W alive beams of every source by the whole vocabulary, keeps
the 2W best continuations, moves those among the W best that end in an end token into the
finished pool (scored by log-prob / ((5 + length) / 6) ** alpha, Wu et al. 2016) and keeps
the W best others alive; `decode.beam_steps` names each step and works through an example.
Only the self-attention cache is reordered (gathered by parent beam); the encoder's
cross-attention keys/values stay one row per source, shared by its beams.

A source stops early once its W-th best finished score beats anything an alive beam can
still reach; once all have stopped, the remaining iterations call no model. At the end the
alive beams join the finished pool, so a source whose beams never ended still returns W.

Like `generate`, a call is `_beam_search(*args, **static)` with
`args, static = decode.beam_search_arguments(...)`, and `beam_search.lower(...)` returns
`_beam_search.lower(*args, **static)`. It runs inside your own `jax.jit` too.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decode import checks
from decode.beam_steps import beam_init, beam_loop, finalize
from decode.model_fns import model_step_fn, output_pad_id, start_decoding
from models.checks import check_positive_int


@flax.struct.dataclass
class BeamOutput:
    """What `beam_search` returns.

    Attributes:
        tokens: int32[B, W, N] new tokens of each beam, best first; after the end, the
            config's pad_id (0 when it has none).
        scores: float32[B, W] length-penalised log-probabilities, best first.
        lengths: int32[B, W] new tokens of each beam, the end token included.
    """

    tokens: Int[Array, "B W N"]
    scores: Float[Array, "B W"]
    lengths: Int[Array, "B W"]


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "max_new_tokens", "cache_len",
                                             "eos_ids"))
def _beam_search(model, params, prompts_BP, lengths_B, alpha, *, beam_size, max_new_tokens,
                 cache_len, eos_ids) -> BeamOutput:
    """The jitted computation; `beam_search_arguments` gives its (args, static)."""
    logits_RV, cache = start_decoding(model, params, prompts_BP, lengths_B, cache_len,
                                      beams=beam_size)
    state = beam_init(logits_RV, cache, beam_size, max_new_tokens)
    state = beam_loop(model_step_fn(model, params), state, alpha=alpha, eos_ids=eos_ids)
    return BeamOutput(*finalize(state, alpha, output_pad_id(model.config)))


def beam_search_arguments(
    model: nn.Module,
    params,
    prompts,
    lengths,
    *,
    beam_size: int = 4,
    max_new_tokens: int,
    length_penalty=0.6,
    eos_id: int | tuple[int, ...] | str | None = "config",
    cache_len: int | None = None,
) -> tuple[tuple, dict]:
    """A `beam_search` call's arguments, checked, as its jitted computation takes them.

    `beam_search(...)` runs `_beam_search(*args, **static)` and `beam_search.lower(...)`
    returns `_beam_search.lower(*args, **static)`; both take exactly these arguments.

    Args:
        model, params, prompts, lengths, max_new_tokens, eos_id, cache_len: as in
            `decode.generate_arguments`.
        beam_size: W >= 1 (static); W = 1 with length_penalty 0 is greedy decoding.
        length_penalty: GNMT alpha >= 0 (0: plain sums of log-probs), a scalar; traced, so
            changing it never recompiles.

    Returns:
        (args, static): `(model, params, prompts int32[B, P], lengths int32[B], alpha
        float32[])` and the static keywords `beam_size`, `max_new_tokens`, `cache_len`,
        `eos_ids`.

    Raises:
        ValueError: naming the argument, its value and the limit it breaks (values only
            when concrete).
    """
    common = checks.check_common(model.config, prompts, lengths, max_new_tokens=max_new_tokens,
                                 cache_len=cache_len, eos_id=eos_id)
    beam_size = check_positive_int(beam_size, "beam_size")
    alpha = checks.as_array(length_penalty)
    if alpha.shape != () or not jnp.issubdtype(alpha.dtype, jnp.number):
        raise ValueError(f"length_penalty must be a number, got {length_penalty!r}")
    alpha = alpha.astype(np.float32)
    checks.check_in_range(alpha, "length_penalty", 0.0, np.inf, hi_open=True)
    return ((model, params, common.prompts, common.lengths, alpha),
            dict(beam_size=beam_size, max_new_tokens=common.max_new_tokens,
                 cache_len=common.cache_len, eos_ids=common.eos_ids))


def beam_search(model: nn.Module, params, prompts, lengths, **options) -> BeamOutput:
    """The `beam_size` best continuations of each prompt (source), best first.

        beams = decode.beam_search(model, params, prompts, lengths, beam_size=4,
                                   max_new_tokens=16)
        beams.tokens, beams.scores, beams.lengths    # int32[B, W, N], float32[B, W], int32[B, W]

    Args:
        model, params, prompts, lengths: as in `decode.generate`.
        **options: `max_new_tokens` (required), `beam_size`, `length_penalty`, `eos_id`,
            `cache_len`, each documented in `decode.beam_search_arguments`, which checks
            them.

    Returns:
        A `BeamOutput`.

    Raises:
        ValueError: naming the argument, its value and the limit it breaks.

    `beam_search.lower(...)` takes the same arguments and returns the `jax.stages.Lowered`
    computation instead of running it.
    """
    args, static = beam_search_arguments(model, params, prompts, lengths, **options)
    return _beam_search(*args, **static)


def _lower(model: nn.Module, params, prompts, lengths, **options) -> jax.stages.Lowered:
    """`beam_search`'s computation for these arguments (the same ones), lowered, not run."""
    args, static = beam_search_arguments(model, params, prompts, lengths, **options)
    return _beam_search.lower(*args, **static)


beam_search.lower = _lower
