"""What `generate` and `beam_search` share: one set-up and one way to run or lower a call.

A public decoding call is two steps, each a plain function:

    args, static = arguments(model, params, prompts, lengths, request, **options)  # checked
    out = computation(*args, **static)                                             # jitted

`arguments` merges a `decode.DecodeRequest` with the keyword arguments (a keyword wins over
the request's field, `with_request`), checks everything (`shared_arguments` for what both
calls take: prompts, lengths, the number of new tokens, the cache, the end ids and the
token constraints) and splits it into the traced `args` and the compile-time `static`
keywords, the compilation's key. `DecodeCall` holds the two functions:

    decode.generate(...)              computation(*args, **static)
    decode.generate.lower(...)        computation.lower(*args, **static)   (jax.stages.Lowered)
    decode.generate.arguments(...)    (args, static)

so running and lowering check the same arguments the same way. With the persistent
compilation cache on, running goes through `decode.trace_cache`, which stores the traced
program for later processes (and runs the same computation). Parameters sharded over a
mesh add `cache_sharding` to `static` (`decode.placement`); unsharded calls never have the
key, so their compilations are keyed as they always are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from decode import checks, placement, trace_cache
from decode.processors import Constraints
from decode.request import DecodeRequest
from models.cache_int8 import check_kv_cache_dtype
from models.errors import UserError


@dataclasses.dataclass(frozen=True)
class Shared:
    """The arguments `generate` and `beam_search` share, checked.

    Attributes:
        prompts: int32[B, P] right-padded prompts (sources); numpy when given concrete,
            else the traced array.
        lengths: int32[B] their true lengths, likewise.
        constraints: the token constraints, traced (`decode.processors.Constraints`).
        static: the compile-time keywords every call has: `max_new_tokens`, `cache_len`,
            `eos_ids`, `no_repeat`, `constrained` (any token constraint set: none is
            compiled in otherwise), `cache_sharding` when the parameters split their kv
            heads over a mesh, and `kv_cache_dtype` when the cache is int8.
    """

    prompts: object
    lengths: object
    constraints: Constraints
    static: dict

    @property
    def eos_ids(self) -> tuple[int, ...] | None:
        return self.static["eos_ids"]


def shared_arguments(model, params, prompts, lengths, *, max_new_tokens, cache_len, eos_id,
                     forced_bos_id, forced_eos_id, banned_ids, min_new_tokens,
                     no_repeat_ngram_size, kv_cache_dtype="auto") -> Shared:
    """Checks the arguments both calls take (each as `decode.generate_arguments` documents
    it) and places the cache like the parameters' kv heads. An int8 cache adds
    `kv_cache_dtype` to the static keywords (a float one does not: its compilations are
    keyed as they always were).

    Raises:
        UserError: naming the argument, its value and the limit it breaks.
    """
    cfg = model.config
    common = checks.check_common(cfg, prompts, lengths, max_new_tokens=max_new_tokens,
                                 cache_len=cache_len, eos_id=eos_id)
    constraints, no_repeat, constrained = checks.check_constraints(
        cfg, common.prompts.shape[0], common.eos_ids, forced_bos_id=forced_bos_id,
        forced_eos_id=forced_eos_id, banned_ids=banned_ids, min_new_tokens=min_new_tokens,
        no_repeat_ngram_size=no_repeat_ngram_size)
    static = dict(max_new_tokens=common.max_new_tokens, cache_len=common.cache_len,
                  eos_ids=common.eos_ids, no_repeat=no_repeat, constrained=constrained)
    if check_kv_cache_dtype(kv_cache_dtype) != "auto":
        static["kv_cache_dtype"] = kv_cache_dtype
    return Shared(common.prompts, common.lengths, constraints,
                  placement.with_cache_sharding(static, params))


def with_request(request: DecodeRequest | None, options: dict, *, beam: bool) -> dict:
    """A call's keyword arguments: the request's (`DecodeRequest.generate_options`, or
    `beam_options` for beam search), then `options`, each of which wins over the request.

        DecodeRequest(max_new_tokens=8, banned_ids=(3,)), {"max_new_tokens": 4}
        -> {"eos_id": "config", "max_new_tokens": 4, "banned_ids": (3,)}
    """
    if request is None:
        return options
    if not isinstance(request, DecodeRequest):
        raise UserError(f"request must be a decode.DecodeRequest or None, got "
                        f"{type(request).__name__}")
    merged = {**(request.beam_options() if beam else request.generate_options()), **options}
    if "max_new_tokens" not in merged:
        raise UserError("the request sets no max_new_tokens: set it "
                        "(request.replace(max_new_tokens=N)) or pass max_new_tokens=N")
    return merged


class DecodeCall:
    """A public decoding call: its argument checker and its jitted computation, callable
    and lowerable with the same arguments.

        generate = DecodeCall("generate", generate_arguments, _generate, doc="...")
        generate(model, params, prompts, lengths, request, **options)        # runs it
        generate.lower(model, params, prompts, lengths, request, **options)  # lowers it

    Attributes:
        arguments: `(model, params, prompts, lengths, request=None, **options) -> (args,
            static)`, the checked arguments of the computation.
        computation: the jitted function, `computation(*args, **static)`.
    """

    def __init__(self, name: str, arguments: Callable, computation, doc: str):
        self.arguments = arguments
        self.computation = computation
        self.__name__ = self.__qualname__ = name
        self.__module__ = arguments.__module__
        self.__doc__ = doc

    def __call__(self, model, params, prompts, lengths, request: DecodeRequest | None = None,
                 **options):
        args, static = self.arguments(model, params, prompts, lengths, request, **options)
        return trace_cache.call(self.__name__, self.computation, args, static)

    def lower(self, model, params, prompts, lengths, request: DecodeRequest | None = None,
              **options) -> jax.stages.Lowered:
        """The computation for these arguments (the call's own), lowered and not run:
        `.compile()`, `.cost_analysis()`, `.as_text()`."""
        args, static = self.arguments(model, params, prompts, lengths, request, **options)
        return self.computation.lower(*args, **static)

    def __repr__(self) -> str:
        return f"<decode.{self.__name__}>"
