"""Host-side checks of every decoding argument, before the jitted computation runs.

Inside jit values are abstract, so everything a user can get wrong is checked here, on
concrete arrays, with a ValueError that names the argument, the value and the limit.
"""

from __future__ import annotations

import numbers

import numpy as np

from models import TransformerConfig


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_positive_int(value, name: str) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


def check_prompts(config: TransformerConfig, prompts, lengths) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int[B, P] prompts (sources) and their lengths int[B], as numpy."""
    what = "sources" if config.is_encoder_decoder else "prompts"
    p = np.asarray(prompts)
    if p.ndim != 2 or not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"{what} must be an int array [B, P], got shape {p.shape} dtype {p.dtype}")
    B, P = p.shape
    if B < 1 or P < 1:
        raise ValueError(f"{what} has an empty dimension: shape {p.shape}")
    bad = p[(p < 0) | (p >= config.vocab_size)]
    if bad.size:
        raise ValueError(
            f"{what} hold token id {int(bad[0])} outside [0, vocab_size={config.vocab_size})")
    n = np.asarray(lengths)
    if n.shape != (B,) or not np.issubdtype(n.dtype, np.integer):
        raise ValueError(
            f"lengths must be an int array of shape ({B},) (one per row of {what}), "
            f"got shape {n.shape} dtype {n.dtype}")
    for b in range(B):
        if not 1 <= n[b] <= P:
            raise ValueError(f"lengths[{b}]={int(n[b])} must be in [1, padded width {P}]")
    if config.is_encoder_decoder:
        # Sources are masked by their pad ids, so padding must be exactly the tail.
        real = p != config.pad_id
        expected = np.arange(P)[None, :] < n[:, None]
        rows = np.nonzero((real != expected).any(axis=1))[0]
        if rows.size:
            b = int(rows[0])
            raise ValueError(
                f"sources row {b} has length {int(n[b])} but its non-pad tokens are at "
                f"{np.nonzero(real[b])[0].tolist()}: the pad id {config.pad_id} must fill "
                "exactly the positions at and after the length")
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


def check_eos(config: TransformerConfig, eos_id) -> tuple[int, ...] | None:
    """None (never stop), one id or several, each in [0, vocab_size)."""
    if eos_id is None:
        return None
    ids = (eos_id,) if _is_int(eos_id) else tuple(eos_id)
    if not ids:
        raise ValueError("eos_id must be None, an int or a non-empty sequence of ints")
    for i in ids:
        if not _is_int(i) or not 0 <= i < config.vocab_size:
            raise ValueError(f"eos_id {i!r} must be an int in [0, vocab_size={config.vocab_size})")
    return tuple(int(i) for i in ids)


def per_row(value, name: str, batch: int, dtype) -> np.ndarray:
    """A scalar or one value per row, as an array of shape [B]."""
    a = np.asarray(value)
    if a.ndim == 0:
        a = np.full((batch,), a)
    if a.shape != (batch,):
        raise ValueError(f"{name} must be a scalar or have shape ({batch},), got shape {a.shape}")
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
        raise ValueError(f"{name} must be numeric, got dtype {a.dtype}")
    if np.issubdtype(dtype, np.integer) and not np.all(np.mod(a, 1) == 0):
        raise ValueError(f"{name}={value!r} must be integers")
    return a.astype(dtype)


def check_in_range(a: np.ndarray, name: str, lo, hi, lo_open=False, hi_open=False) -> None:
    """Every value in [lo, hi] (an end open where asked); NaN fails too."""
    ok_lo = a > lo if lo_open else a >= lo
    ok_hi = a < hi if hi_open else a <= hi
    bad = a[~(ok_lo & ok_hi)]
    if bad.size:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        value = bad.flat[0].item()
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise ValueError(f"{name}={shown} is outside {interval}")
