"""Mask builders: each keeps exactly the pairs its rule names."""

import jax.numpy as jnp
import numpy as np

from models import masks


def test_causal_mask_over_absolute_positions():
    # Two new tokens at positions 3 and 4 of a 6-slot cache see slots 0..3 and 0..4.
    q = jnp.array([[3, 4]])
    k = jnp.arange(6)[None, :]
    np.testing.assert_array_equal(
        masks.causal_mask(q, k)[0], [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])


def test_padding_mask_is_outer_and():
    m = masks.padding_mask(jnp.array([[True, False]]), jnp.array([[True, True, False]]))
    np.testing.assert_array_equal(m[0], [[1, 1, 0], [0, 0, 0]])


def test_segment_mask_separates_segments_and_hides_padding():
    seg = jnp.array([[1, 1, 2, 2, 0]])
    m = masks.segment_mask(seg, seg)[0]
    expected = np.zeros((5, 5), bool)
    expected[:2, :2] = expected[2:4, 2:4] = True
    np.testing.assert_array_equal(m, expected)


def test_combine_masks_ands_and_skips_none():
    a = jnp.array([[[True, True, False]]])
    b = jnp.array([[[True, False, True]]])
    np.testing.assert_array_equal(masks.combine_masks(a, None, b), [[[True, False, False]]])
    assert masks.combine_masks(None, None) is None


def test_positions_like():
    np.testing.assert_array_equal(masks.positions_like(jnp.zeros((2, 3), jnp.int32)),
                                  [[0, 1, 2]] * 2)
