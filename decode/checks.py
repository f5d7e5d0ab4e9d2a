"""Checks of the decoding arguments, before the jitted computation runs.

Shapes and dtypes are static, so they are always checked. Values (token ids, lengths,
sampling values) are checked when they are concrete, that is when `generate` or
`beam_search` is called with arrays or numbers; called inside a user's own `jax.jit` (or
with a traced value under `jax.grad`) they are abstract, cannot be read, and go on
unchecked, as `models.checks` does for the models' entry points. Static arguments
(`max_new_tokens`, `cache_len`, `eos_id`, `beam_size`) must always be concrete. Every error
is a ValueError that names the argument, the value and the limit.

`check_common` checks the arguments `generate` and `beam_search` share, once for both.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from models import TransformerConfig
from models.checks import check_positive_int, is_concrete, is_int


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
        raise ValueError(f"{what} must be an int array [B, P], got shape {p.shape} dtype {p.dtype}")
    B, P = p.shape
    if B < 1 or P < 1:
        raise ValueError(f"{what} has an empty dimension: shape {p.shape}")
    if is_concrete(p):
        bad = p[(p < 0) | (p >= config.vocab_size)]
        if bad.size:
            raise ValueError(
                f"{what} hold token id {int(bad[0])} outside [0, vocab_size={config.vocab_size})")
    n = as_array(lengths)
    if n.shape != (B,) or not jnp.issubdtype(n.dtype, jnp.integer):
        raise ValueError(
            f"lengths must be an int array of shape ({B},) (one per row of {what}), "
            f"got shape {n.shape} dtype {n.dtype}")
    if is_concrete(n):
        for b in range(B):
            if not 1 <= n[b] <= P:
                raise ValueError(f"lengths[{b}]={int(n[b])} must be in [1, padded width {P}]")
    return p.astype(np.int32), n.astype(np.int32)


def check_cache_len(config: TransformerConfig, prompt_width: int, max_new_tokens: int, cache_len):
    """The decoder cache holds the decoder prompt (the padded prompt, or the start token)
    and every new token: its default length is exactly that, at most `max_len`."""
    decoder_prompt = 1 if config.is_encoder_decoder else prompt_width
    what = "1 (start token)" if config.is_encoder_decoder else f"prompt width {prompt_width}"
    need = decoder_prompt + max_new_tokens
    if need > config.max_len:
        raise ValueError(
            f"{what} + max_new_tokens {max_new_tokens} = {need} is beyond the model's "
            f"max_len {config.max_len}")
    if cache_len is None:
        return need
    cache_len = check_positive_int(cache_len, "cache_len")
    if not need <= cache_len <= config.max_len:
        raise ValueError(
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
        raise ValueError(f"{usage} (static, never traced), got {eos_id!r}") from None
    if not ids:
        raise ValueError(usage)
    for i in ids:
        if not is_int(i) or not 0 <= i < config.vocab_size:
            raise ValueError(f"eos_id {i!r} must be an int in [0, vocab_size={config.vocab_size})")
    return tuple(int(i) for i in ids)


def per_row(value, name: str, batch: int, dtype):
    """A scalar or one value per row, as an array of shape [B] (numpy when concrete). A
    traced integer option must have an integer dtype (its values cannot be checked)."""
    a = as_array(value)
    if a.ndim == 0:
        a = np.full((batch,), a) if is_concrete(a) else jnp.broadcast_to(a, (batch,))
    if a.shape != (batch,):
        raise ValueError(f"{name} must be a scalar or have shape ({batch},), got shape {a.shape}")
    if not (jnp.issubdtype(a.dtype, jnp.number) or a.dtype == bool):
        raise ValueError(f"{name} must be numeric, got dtype {a.dtype}")
    if jnp.issubdtype(dtype, jnp.integer) and not jnp.issubdtype(a.dtype, jnp.integer):
        if not is_concrete(a):
            raise ValueError(f"{name} is traced with dtype {a.dtype}: it must be an int array")
        if not np.all(np.mod(a, 1) == 0):
            raise ValueError(f"{name}={value!r} must be integers")
    return a.astype(dtype)


def check_in_range(a, name: str, lo, hi, lo_open=False, hi_open=False) -> None:
    """Every value in [lo, hi] (an end open where asked), when concrete; NaN fails too."""
    if not is_concrete(a):
        return
    ok_lo = a > lo if lo_open else a >= lo
    ok_hi = a < hi if hi_open else a <= hi
    bad = a[~(ok_lo & ok_hi)]
    if bad.size:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name}={shown(bad.flat[0])} is outside {interval}")


def shown(value) -> str:
    """One number as error messages write it: floats short (0.1, 1.5, inf), ints exact."""
    value = np.asarray(value).item()
    return f"{value:g}" if isinstance(value, float) else repr(value)
