"""The loop driven by a stub step_fn: exact sequences, EOS handling, no model calls after
everyone is done, scan == while."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode.loop import SplitStep, decode_loop, initial_state
from decode.processors import SamplingParams, Strategy

V = 7


def counting_stub():
    """Next token = previous + 1 (mod V); the cache counts the model calls per row."""
    def step_fn(tokens_B, calls_B):
        return jax.nn.one_hot((tokens_B + 1) % V, V) * 10.0, calls_B + 1
    return step_fn


def _run(first_tokens, n, eos_ids, while_loop=False, sample=False):
    B = len(first_tokens)
    params = SamplingParams(jnp.full((B,), 1.0 if sample else 0.0), jnp.zeros(B, jnp.int32),
                            jnp.ones(B), jnp.zeros(B), jnp.ones(B))
    state = initial_state(jax.nn.one_hot(jnp.array(first_tokens), V) * 10.0,
                          jnp.zeros((B,), jnp.int32), jax.random.key(0), n)
    return jax.jit(lambda s: decode_loop(
        counting_stub(), s, eos_ids=eos_ids, pad_id=0, params=params,
        strategy=Strategy(sample=sample), while_loop=while_loop))(state)


@pytest.mark.parametrize("while_loop", [False, True])
def test_stub_gives_exact_sequences_and_stops_at_eos(while_loop):
    s = _run([3, 5], 6, eos_ids=(1,), while_loop=while_loop)
    np.testing.assert_array_equal(s.tokens, [[3, 4, 5, 6, 0, 1], [5, 6, 0, 1, 0, 0]])
    np.testing.assert_array_equal(s.lengths, [6, 4])
    np.testing.assert_array_equal(s.done, [True, True])
    assert float(s.logprobs[1, 4:].max()) == 0.0 and float(s.logprobs[1, :4].min()) < 0.0
    # Row 0 needed 5 model calls (none after the last token); both rows share each call.
    np.testing.assert_array_equal(s.cache, [5, 5])


def test_no_model_calls_once_every_row_is_done():
    s = _run([6, 6], 10, eos_ids=(0, 1))     # 6 -> 0: both rows end at the second token
    np.testing.assert_array_equal(s.tokens[:, :3], [[6, 0, 0], [6, 0, 0]])
    np.testing.assert_array_equal(s.lengths, [2, 2])
    np.testing.assert_array_equal(s.cache, [1, 1])   # one call (for token 2), then none


def test_several_end_ids_and_none():
    s = _run([2, 4], 5, eos_ids=(4, 5))
    np.testing.assert_array_equal(s.tokens, [[2, 3, 4, 0, 0], [4, 0, 0, 0, 0]])
    s = _run([2], 5, eos_ids=None)
    np.testing.assert_array_equal(s.tokens, [[2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(s.cache, [4])


def test_scan_and_while_loops_agree_when_sampling():
    a = _run([3, 5, 1], 6, eos_ids=(1,), sample=True)
    b = _run([3, 5, 1], 6, eos_ids=(1,), sample=True, while_loop=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)


def counting_split_stub():
    """`counting_stub` in two parts (`decode.SplitStep`): `read` only reads the cache (the
    calls so far) and says what to add; `commit` adds it to the rows `active_B` names."""
    def read(tokens_B, calls_B):
        return jax.nn.one_hot((tokens_B + 1) % V, V) * 10.0, jnp.ones_like(calls_B)

    def commit(calls_B, update_B, active_B):
        return calls_B + jnp.where(active_B, update_B, 0)
    return SplitStep(read, commit)


@pytest.mark.parametrize("while_loop", [False, True])
def test_a_split_step_gives_the_tokens_and_calls_of_the_whole_step(while_loop):
    """The same sequences, and commits only for the steps that ran: after every row is
    done (and after the last token) nothing is committed."""
    for first, n, eos in (([3, 5], 6, (1,)), ([6, 6], 10, (0, 1)), ([2], 5, None)):
        whole = _run(first, n, eos_ids=eos, while_loop=while_loop)
        B = len(first)
        params = SamplingParams(jnp.zeros(B), jnp.zeros(B, jnp.int32), jnp.ones(B),
                                jnp.zeros(B), jnp.ones(B))
        state = initial_state(jax.nn.one_hot(jnp.array(first), V) * 10.0,
                              jnp.zeros((B,), jnp.int32), jax.random.key(0), n)
        split = jax.jit(lambda s, eos=eos, params=params: decode_loop(
            counting_split_stub(), s, eos_ids=eos, pad_id=0, params=params,
            strategy=Strategy(), while_loop=while_loop))(state)
        np.testing.assert_array_equal(split.tokens, whole.tokens)
        np.testing.assert_array_equal(split.cache, whole.cache)
