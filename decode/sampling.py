"""`generate`'s sampling options, checked: traced values and a static `Strategy`.

The five values (temperature, top_k, top_p, min_p, repetition_penalty) become traced [B]
arrays, so new values never recompile. Which processors run at all is static, a
`decode.Strategy`, and each one compiles once. By default it is read from the values,
which must then be concrete; pass it yourself when a value is traced (`generate` called
inside your own `jax.jit` with the value as an argument), or to let greedy and sampled
calls share one compilation:

    decode.generate(..., temperature=0.7)          # Strategy(sample=True), read from 0.7
    jax.jit(lambda t: decode.generate(..., temperature=t, rng=key,
                                      strategy=decode.Strategy(sample=True)))(0.7)

A processor the strategy leaves off is not applied at all; with concrete values, a value
that needs an off processor is an error rather than silently ignored.
"""

from __future__ import annotations

import numpy as np

from decode import checks
from decode.processors import SamplingParams, Strategy
from models import TransformerConfig
from models.checks import is_concrete
from models.errors import UserError

# Each value, the Strategy flag that runs its processor, and the value that means "off".
PROCESSORS = (("temperature", "sample", 0), ("top_k", "top_k", 0), ("top_p", "top_p", 1),
              ("min_p", "min_p", 0), ("repetition_penalty", "penalty", 1))


def sampling_arguments(config: TransformerConfig, batch: int, strategy: Strategy | None, *,
                       temperature, top_k, top_p, min_p, repetition_penalty,
                       ) -> tuple[SamplingParams, Strategy]:
    """The values checked (ranges when concrete) as [B] arrays, and the static strategy."""
    values = SamplingParams(
        temperature=checks.per_row(temperature, "temperature", batch, np.float32),
        top_k=checks.per_row(top_k, "top_k", batch, np.int32),
        top_p=checks.per_row(top_p, "top_p", batch, np.float32),
        min_p=checks.per_row(min_p, "min_p", batch, np.float32),
        repetition_penalty=checks.per_row(repetition_penalty, "repetition_penalty", batch,
                                          np.float32))
    checks.check_in_range(values.temperature, "temperature", 0.0, np.inf)
    checks.check_in_range(values.top_k, "top_k", 0, config.vocab_size)
    checks.check_in_range(values.top_p, "top_p", 0.0, 1.0, lo_open=True)
    checks.check_in_range(values.min_p, "min_p", 0.0, 1.0, hi_open=True)
    checks.check_in_range(values.repetition_penalty, "repetition_penalty", 0.0, np.inf,
                          lo_open=True, hi_open=True)
    return values, resolve_strategy(values, strategy)


def resolve_strategy(values: SamplingParams, strategy: Strategy | None) -> Strategy:
    """`strategy` when given, checked against the concrete values; else the processors
    the values switch on (every value must then be concrete).

    For example temperature [0.0, 0.8] and top_k 0 give Strategy(sample=True): row 1
    samples, and top-k is off in every row, so it is not compiled in.
    """
    if strategy is not None and not isinstance(strategy, Strategy):
        hint = (" (a strategy name such as 'sample' is a decode.DecodeRequest's field: "
                "pass the request)" if isinstance(strategy, str) else "")
        raise UserError(f"strategy must be a decode.Strategy or None, got {strategy!r}{hint}")
    flags = {}
    for name, flag, off in PROCESSORS:
        a = getattr(values, name)
        if not is_concrete(a):
            if strategy is None:
                raise UserError(
                    f"{name} is traced (generate is called inside jit, grad or vmap with it "
                    "as an argument), so the processors to compile cannot be read from its "
                    "value: pass strategy=decode.Strategy(...) with the ones to run, e.g. "
                    "strategy=decode.Strategy(sample=True) for temperature")
            continue
        on = a != off
        if strategy is not None and on.any() and not getattr(strategy, flag):
            raise UserError(f"{name}={checks.shown(a[on][0])} needs strategy.{flag}=True, "
                             f"but strategy={strategy} leaves that processor off")
        flags[flag] = bool(on.any())
    return Strategy(**flags) if strategy is None else strategy
