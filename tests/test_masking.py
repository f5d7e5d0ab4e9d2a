"""Masked-LM corruption (train/masking.py): the rates over many draws, special tokens and
padding never chosen, and the same masks however the rows are split or resumed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.masking import Masking, mask_tokens

MASK, V = 3, 50


def _batch(B=64, T=40, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(5, V, (B, T)).astype(np.int32)
    tokens[:, 0] = 1                                          # a [CLS]-like special
    lengths = rng.integers(10, T + 1, B)
    real = np.arange(T)[None, :] < lengths[:, None]
    tokens[np.arange(B), lengths - 1] = 2                     # a [SEP]-like special
    tokens[~real] = 0                                         # padding
    maskable = real & (tokens != 1) & (tokens != 2)
    return jnp.asarray(tokens), jnp.asarray(maskable)


def test_rates_match_15_percent_and_80_10_10():
    """Over ~60k maskable tokens the chosen fraction is 0.15 +- 0.005 and the split of the
    chosen ones 0.8 / 0.1 / 0.1 +- 0.015 (each about 5 standard deviations)."""
    chosen_n = masked = randomised = kept = maskable_n = 0
    for step in range(30):
        tokens, maskable = _batch(seed=step)
        inputs, chosen = mask_tokens(jax.random.key(step), tokens, maskable,
                                     jnp.arange(tokens.shape[0]), mask_id=MASK, vocab_size=V)
        inputs, chosen, tokens = map(np.asarray, (inputs, chosen, tokens))
        maskable_n += int(maskable.sum())
        chosen_n += int(chosen.sum())
        masked += int((chosen & (inputs == MASK)).sum())
        kept += int((chosen & (inputs == tokens)).sum())
        randomised += int((chosen & (inputs != MASK) & (inputs != tokens)).sum())
        assert np.array_equal(inputs[~chosen], tokens[~chosen])     # the rest is untouched
    assert abs(chosen_n / maskable_n - 0.15) < 0.005
    # A random draw may hit the mask id or the token itself (1/V each): count them back.
    random_share = randomised / chosen_n * V / (V - 2)
    assert abs(masked / chosen_n - 0.8 - 0.1 / V) < 0.015
    assert abs(random_share - 0.1) < 0.015
    assert abs(kept / chosen_n - 0.1 - 0.1 / V) < 0.015


def test_specials_and_padding_are_never_chosen():
    tokens, maskable = _batch()
    masking = Masking(rate=1.0, mask_fraction=1.0, random_fraction=0.0)
    inputs, chosen = mask_tokens(jax.random.key(0), tokens, maskable, jnp.arange(64),
                                 mask_id=MASK, vocab_size=V, masking=masking)
    np.testing.assert_array_equal(chosen, maskable)           # rate 1: every maskable one
    np.testing.assert_array_equal(np.asarray(inputs)[~np.asarray(maskable)],
                                  np.asarray(tokens)[~np.asarray(maskable)])


def test_split_rows_and_a_resumed_step_draw_the_same_masks():
    """Two devices masking rows 0-31 and 32-63 with their global indices equal one device
    masking all 64; the same key again (a resumed step) gives the same masks; another step's
    key gives others."""
    tokens, maskable = _batch()
    key = jax.random.key(7)
    whole = mask_tokens(key, tokens, maskable, jnp.arange(64), mask_id=MASK, vocab_size=V)
    halves = [mask_tokens(key, tokens[i:i + 32], maskable[i:i + 32], jnp.arange(i, i + 32),
                          mask_id=MASK, vocab_size=V) for i in (0, 32)]
    for k in range(2):
        np.testing.assert_array_equal(whole[k], jnp.concatenate([h[k] for h in halves]))
    again = mask_tokens(jax.random.key(7), tokens, maskable, jnp.arange(64), mask_id=MASK,
                        vocab_size=V)
    np.testing.assert_array_equal(whole[1], again[1])
    other = mask_tokens(jax.random.key(8), tokens, maskable, jnp.arange(64), mask_id=MASK,
                        vocab_size=V)
    assert not np.array_equal(whole[1], other[1])


@pytest.mark.parametrize("fields,message", [
    (dict(rate=0.0), r"rate=0.0 must be > 0"),
    (dict(rate=1.5), r"rate=1.5 must be in \[0, 1\]"),
    (dict(mask_fraction=0.95, random_fraction=0.1), r"mask_fraction=0.95 plus random_fraction"),
])
def test_bad_rates_name_themselves(fields, message):
    with pytest.raises(ValueError, match=message):
        Masking(**fields)
