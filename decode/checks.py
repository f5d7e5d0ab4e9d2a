"""Checks of the decoding arguments, before the jitted computation runs.

Shapes and dtypes are static, so they are always checked. Values (token ids, lengths,
sampling values) are checked when they are concrete, that is when `generate` or
`beam_search` is called with arrays or numbers; called inside a user's own `jax.jit` (or
with a traced value under `jax.grad`) they are abstract, cannot be read, and go on
unchecked, as `models.checks` does for the models' entry points. Static arguments
(`max_new_tokens`, `cache_len`, `eos_id`, `beam_size`) must always be concrete. Every error
is a UserError that names the argument, the value and the limit.

`check_common` checks the arguments `generate` and `beam_search` share, once for both;
`check_constraints` their token constraints (forced, banned and end ids before a minimum
length, no repeated n-grams), which become one traced `decode.processors.Constraints`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from decode.processors import Constraints
from models import TransformerConfig
from models.checks import is_concrete
from models.errors import UserError, check_positive_int, is_int


def as_array(x):
    """`x` as a numpy array when concrete; a traced value stays as it is (its shape and
    dtype are known, its values are not)."""
    return np.asarray(x) if is_concrete(x) else x


@dataclasses.dataclass(frozen=True)
class CommonArgs:
    """The arguments `generate` and `beam_search` share, checked.

    Attributes:
        prompts: int32[B, P] right-padded prompts (sources); numpy when given concrete,
            else the traced array.
        lengths: int32[B] their true lengths, likewise.
        max_new_tokens: N, the new tokens per row (static).
        cache_len: the decoder cache's size in slots (static).
        eos_ids: the end ids, or None to never stop early (static).
    """

    prompts: object
    lengths: object
    max_new_tokens: int
    cache_len: int
    eos_ids: tuple[int, ...] | None


def check_common(config: TransformerConfig, prompts, lengths, *, max_new_tokens, cache_len,
                 eos_id) -> CommonArgs:
    """Checks the prompts, their lengths, `max_new_tokens`, `cache_len` and `eos_id`."""
    if config.architecture == "encoder_only":
        raise UserError("an encoder-only model does not generate: it predicts masked tokens "
                         "(model.apply) or classes (method='classify')")
    prompts, lengths = check_prompts(config, prompts, lengths)
    max_new_tokens = check_positive_int(max_new_tokens, "max_new_tokens")
    cache_len = check_cache_len(config, prompts.shape[1], max_new_tokens, cache_len)
    return CommonArgs(prompts, lengths, max_new_tokens, cache_len, check_eos(config, eos_id))


def check_prompts(config: TransformerConfig, prompts, lengths):
    """Right-padded int[B, P] prompts (sources) and their lengths int[B], as int32 arrays
    (numpy when concrete); token ids and lengths are checked when concrete."""
    what = "sources" if config.is_encoder_decoder else "prompts"
    p = as_array(prompts)
    if p.ndim != 2 or not jnp.issubdtype(p.dtype, jnp.integer):
        raise UserError(f"{what} must be an int array [B, P], got shape {p.shape} dtype {p.dtype}")
    B, P = p.shape
    if B < 1 or P < 1:
        raise UserError(f"{what} has an empty dimension: shape {p.shape}")
    if is_concrete(p):
        bad = p[(p < 0) | (p >= config.vocab_size)]
        if bad.size:
            raise UserError(
                f"{what} hold token id {int(bad[0])} outside [0, vocab_size={config.vocab_size})")
    n = as_array(lengths)
    if n.shape != (B,) or not jnp.issubdtype(n.dtype, jnp.integer):
        raise UserError(
            f"lengths must be an int array of shape ({B},) (one per row of {what}), "
            f"got shape {n.shape} dtype {n.dtype}")
    if is_concrete(n):
        for b in range(B):
            if not 1 <= n[b] <= P:
                raise UserError(f"lengths[{b}]={int(n[b])} must be in [1, padded width {P}]")
    return p.astype(np.int32), n.astype(np.int32)


def check_cache_len(config: TransformerConfig, prompt_width: int, max_new_tokens: int, cache_len):
    """The decoder cache holds the decoder prompt (the padded prompt, or the start token)
    and every new token: its default length is exactly that, at most `max_len`."""
    decoder_prompt = 1 if config.is_encoder_decoder else prompt_width
    what = "1 (start token)" if config.is_encoder_decoder else f"prompt width {prompt_width}"
    need = decoder_prompt + max_new_tokens
    if need > config.max_len:
        raise UserError(
            f"{what} + max_new_tokens {max_new_tokens} = {need} is beyond the model's "
            f"max_len {config.max_len}")
    if cache_len is None:
        return need
    cache_len = check_positive_int(cache_len, "cache_len")
    if not need <= cache_len <= config.max_len:
        raise UserError(
            f"cache_len={cache_len} must be in [{what} + max_new_tokens = {need}, "
            f"max_len {config.max_len}]")
    return cache_len


CONFIG_EOS = "config"


def check_eos(config: TransformerConfig, eos_id) -> tuple[int, ...] | None:
    """"config" (the model config's eos_id; None when it has none), None (never stop), one
    id or several, each a Python or numpy int (static, never a traced value) in
    [0, vocab_size)."""
    if isinstance(eos_id, str) and eos_id == CONFIG_EOS:
        eos_id = config.eos_id
    if eos_id is None:
        return None
    usage = "eos_id must be None, an int or a non-empty sequence of ints (or 'config')"
    try:
        if not is_concrete(eos_id):
            raise TypeError
        ids = (eos_id,) if is_int(eos_id) else tuple(eos_id)
    except TypeError:
        raise UserError(f"{usage} (static, never traced), got {eos_id!r}") from None
    if not ids:
        raise UserError(usage)
    for i in ids:
        if not is_int(i) or not 0 <= i < config.vocab_size:
            raise UserError(f"eos_id {i!r} must be an int in [0, vocab_size={config.vocab_size})")
    return tuple(int(i) for i in ids)


def per_row(value, name: str, batch: int, dtype):
    """A scalar or one value per row, as an array of shape [B] (numpy when concrete). A
    traced integer option must have an integer dtype (its values cannot be checked)."""
    a = as_array(value)
    if a.ndim == 0:
        a = np.full((batch,), a) if is_concrete(a) else jnp.broadcast_to(a, (batch,))
    if a.shape != (batch,):
        raise UserError(f"{name} must be a scalar or have shape ({batch},), got shape {a.shape}")
    if not (jnp.issubdtype(a.dtype, jnp.number) or a.dtype == bool):
        raise UserError(f"{name} must be numeric, got dtype {a.dtype}")
    if jnp.issubdtype(dtype, jnp.integer) and not jnp.issubdtype(a.dtype, jnp.integer):
        if not is_concrete(a):
            raise UserError(f"{name} is traced with dtype {a.dtype}: it must be an int array")
        if not np.all(np.mod(a, 1) == 0):
            raise UserError(f"{name}={value!r} must be integers")
    return a.astype(dtype)


def check_in_range(a, name: str, lo, hi, *, lo_open=False, hi_open=False) -> None:
    """Every value in [lo, hi] (an end open where asked), when concrete; NaN fails too."""
    if not is_concrete(a):
        return
    ok_lo = a > lo if lo_open else a >= lo
    ok_hi = a < hi if hi_open else a <= hi
    bad = a[~(ok_lo & ok_hi)]
    if bad.size:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise UserError(f"{name}={shown(bad.flat[0])} is outside {interval}")


def shown(value) -> str:
    """One number as error messages write it: floats short (0.1, 1.5, inf), ints exact."""
    value = np.asarray(value).item()
    return f"{value:g}" if isinstance(value, float) else repr(value)


def check_constraints(config: TransformerConfig, batch: int, eos_ids: tuple[int, ...] | None, *,
                      forced_bos_id, forced_eos_id, banned_ids, min_new_tokens,
                      no_repeat_ngram_size) -> tuple[Constraints, bool, bool]:
    """The token constraints as a traced `Constraints` (so new values never recompile), and
    two static flags: whether the n-gram history must be compiled in (no_repeat_ngram_size
    traced or > 0), and whether any constraint is set at all (a traced value counts as
    set), so a call that sets none compiles none of them in. Ids are checked against the
    vocabulary when concrete; a traced id of -1 is none.

        forced_bos_id=None, banned_ids=(3, 7)  ->  forced_bos -1, banned[3] = banned[7] = True,
                                                   no_repeat False, constrained True
    """
    V = config.vocab_size
    end = np.zeros((V,), bool)
    end[list(eos_ids or ())] = True
    banned = banned_mask(banned_ids, V)
    min_new = per_row(min_new_tokens, "min_new_tokens", batch, np.int32)
    check_in_range(min_new, "min_new_tokens", 0, np.inf)
    n = as_array(no_repeat_ngram_size)
    if n.shape != () or not jnp.issubdtype(n.dtype, jnp.integer):
        raise UserError(f"no_repeat_ngram_size must be an int, got {no_repeat_ngram_size!r}")
    check_in_range(n, "no_repeat_ngram_size", 0, np.inf)
    if is_concrete(banned):
        if banned.all():
            raise UserError(f"banned_ids ban every token of the vocabulary (vocab_size={V})")
        if is_concrete(min_new) and min_new.max() > 0 and (banned | end).all():
            raise UserError(
                "banned_ids and the end ids together are the whole vocabulary, so nothing "
                f"can be generated before min_new_tokens={int(min_new.max())}")
    constraints = Constraints(
        banned=banned, forced_bos=token_or_none(forced_bos_id, "forced_bos_id", V),
        forced_eos=token_or_none(forced_eos_id, "forced_eos_id", V), min_new_tokens=min_new,
        end=end, no_repeat_ngram_size=n.astype(np.int32))
    no_repeat = bool(not is_concrete(n) or n > 0)
    return constraints, no_repeat, no_repeat or _any_set(constraints)


def _any_set(c: Constraints) -> bool:
    """Whether any of the constraints bans or forces a token (traced values count)."""
    values = (c.banned, c.forced_bos, c.forced_eos, c.min_new_tokens)
    if not all(is_concrete(x) for x in values):
        return True
    return bool(np.any(c.banned) or c.forced_bos >= 0 or c.forced_eos >= 0
                or np.max(c.min_new_tokens, initial=0) > 0)


def token_or_none(token_id, name: str, vocab_size: int):
    """None as -1; an id as an int32 scalar, in [0, vocab_size) when concrete (a traced one
    may be -1, none)."""
    if token_id is None:
        return np.int32(-1)
    a = as_array(token_id)
    if a.shape != () or not jnp.issubdtype(a.dtype, jnp.integer):
        raise UserError(f"{name} must be None or one int token id, got {token_id!r}")
    if is_concrete(a) and not 0 <= a < vocab_size:
        raise UserError(f"{name}={int(a)} is outside [0, vocab_size={vocab_size})")
    return a.astype(np.int32)


def banned_mask(banned_ids, vocab_size: int):
    """bool[V] from a sequence (or int array) of token ids; numpy when concrete. A traced
    array's -1 entries ban nothing (padding to a fixed count)."""
    if banned_ids is None:
        banned_ids = ()
    if is_concrete(banned_ids) and not hasattr(banned_ids, "shape"):
        ids = list(banned_ids) if isinstance(banned_ids, (list, tuple, set, frozenset)) else None
        if ids is None or not all(is_int(i) for i in ids):
            raise UserError(f"banned_ids must be a sequence of int token ids, got {banned_ids!r}")
        a = np.asarray(ids, np.int64).reshape(-1)
    else:
        a = as_array(banned_ids)
        if a.ndim != 1 or not jnp.issubdtype(a.dtype, jnp.integer):
            raise UserError(f"banned_ids must be a sequence of int token ids, got shape "
                             f"{a.shape} dtype {a.dtype}")
    if is_concrete(a):
        bad = a[(a < 0) | (a >= vocab_size)]
        if bad.size:
            raise UserError(f"banned_ids hold token id {int(bad[0])} outside [0, "
                             f"vocab_size={vocab_size})")
        mask = np.zeros((vocab_size,), bool)
        mask[a] = True
        return mask
    ids = jnp.where(a >= 0, a, vocab_size)             # -1: out of range, dropped
    return jnp.zeros((vocab_size,), bool).at[ids].set(True, mode="drop")
