"""The Gated DeltaNet layer's state between calls (`models.gated_deltanet.LinearState`):
a right-padded ragged prompt, in one call or two, then one token a call, gives each row's
outputs of its whole sequence in one call, and the state it would have reached. The
layer's agreement with transformers is tested in tests/test_pretrained_qwen3_next.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.errors import UserError
from models.gated_deltanet import GatedDeltaNet, LinearState

# Two value heads per key head, chunks of 4 (a prompt spans several), a window of 3.
CFG = models.get_config("qwen3-next-tiny").replace(linear_chunk_size=4, linear_conv_width=4)
B, D = 2, CFG.d_model
LENGTHS = (7, 4)          # the prompts: row 1 right-padded by 3
NEW = 3                   # tokens after each prompt, one a call


@pytest.fixture(scope="module")
def layer():
    module = GatedDeltaNet(CFG)
    x = jnp.asarray(np.random.default_rng(0).normal(0, 1, (B, 12, D)), jnp.float32)
    params = module.init(jax.random.key(0), x[:, :2])
    # Every parameter random (the initial decay bias and norm scale are constants).
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(1)
    params = jax.tree.unflatten(tree, [jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype)
                                       for a in leaves])
    apply = jax.jit(lambda x, lengths, state: module.apply(params, x, lengths_B=lengths,
                                                           state=state))
    whole = jax.jit(lambda x: module.apply(params, x))
    return x, apply, whole


def _row(state: LinearState, b: int) -> LinearState:
    return LinearState(state.recurrent[b], state.window[b])


def _alone(layer, b: int, length: int):
    """Row b's outputs and end state over its first `length` inputs, in one call alone."""
    x, apply, whole = layer
    out, state = apply(x[b:b + 1, :length], jnp.array([length]), None)
    chex.assert_trees_all_close(out, whole(x[b:b + 1, :length]), atol=1e-6)
    return out[0], jax.tree.map(lambda a: a[0], state)


def test_a_ragged_prompt_then_steps_equal_each_rows_sequence_in_one_call(layer):
    x, apply, _ = layer
    width = max(LENGTHS)
    block = jnp.stack([jnp.where(jnp.arange(width)[:, None] < n, x[b, :width], 7.0)
                       for b, n in enumerate(LENGTHS)])       # padding of another value
    out, state = apply(block, jnp.array(LENGTHS), None)
    chex.assert_shape(state.recurrent, (B, 4, 16, 16))
    chex.assert_shape(state.window, (B, 2 * 2 * 16 + 4 * 16, 3))
    for i in range(NEW):
        token = jnp.stack([x[b, n + i] for b, n in enumerate(LENGTHS)])[:, None]
        step_out, state = apply(token, jnp.ones((B,), jnp.int32), state)
        for b, n in enumerate(LENGTHS):
            want, _ = _alone(layer, b, n + i + 1)
            chex.assert_trees_all_close(step_out[b, 0], want[n + i], atol=2e-5, rtol=2e-5)
    for b, n in enumerate(LENGTHS):
        want, want_state = _alone(layer, b, n + NEW)
        chex.assert_trees_all_close(out[b, :n], want[:n], atol=2e-5, rtol=2e-5)
        chex.assert_trees_all_close(_row(state, b), want_state,
                                    atol=2e-5, rtol=2e-5)


def test_a_prompt_in_two_pieces_equals_it_in_one(layer):
    """Chunked prefill: the second piece starts from the first's state (its window and
    the delta rule's), ragged in both."""
    x, apply, _ = layer
    first, second = jnp.array([5, 2]), jnp.array([4, 6])
    out1, state = apply(x[:, :5], first, None)
    shifted = jnp.stack([x[b, int(n):int(n) + 6] for b, n in enumerate(first)])
    out2, state = apply(shifted, second, state)
    for b in range(B):
        n1, n2 = int(first[b]), int(second[b])
        want, want_state = _alone(layer, b, n1 + n2)
        chex.assert_trees_all_close(out1[b, :n1], want[:n1], atol=2e-5, rtol=2e-5)
        chex.assert_trees_all_close(out2[b, :n2], want[n1:n1 + n2], atol=2e-5, rtol=2e-5)
        chex.assert_trees_all_close(_row(state, b), want_state,
                                    atol=2e-5, rtol=2e-5)


def test_the_zero_state_is_a_sequences_start_and_bad_sizes_are_named(layer):
    x, apply, _ = layer
    zeros = LinearState.zeros(CFG, B)
    chex.assert_trees_all_close(apply(x[:, :5], jnp.array([5, 5]), zeros),
                                apply(x[:, :5], jnp.array([5, 5]), None))
    with pytest.raises(UserError, match="window"):
        apply(x[:, :5], jnp.array([5, 5]), zeros._replace(window=zeros.window[:, :, :2]))
    module = GatedDeltaNet(CFG)
    params = module.init(jax.random.key(0), x[:, :2])
    with pytest.raises(UserError, match=r"segment_ids \(packed rows\) or lengths_B"):
        module.apply(params, x[:, :5], lengths_B=jnp.array([5, 5]),
                     segment_ids=jnp.ones((B, 5), jnp.int32))
    with pytest.raises(UserError, match=r"segment_ids has shape \(2, 4\), expected"):
        module.apply(params, x[:, :5], segment_ids=jnp.ones((B, 4), jnp.int32))


@pytest.mark.parametrize("paged", [False, True], ids=["KVCache", "PagedKVCache"])
def test_the_cache_holds_a_state_per_linear_layer_and_commits_only_active_rows(paged):
    """`KVCache.create` (and `PagedKVCache.create`, a state per row beside its pages) gives
    each linear layer a zero state and keys/values without heads (nothing to read);
    `commit` takes a read step's new state for the active rows only, as it writes an
    attention layer's slot."""
    from models.paged_cache import PagedKVCache
    cfg = CFG.replace(vocab_size=64)
    cache = models.KVCache.create(cfg, B, 8)
    if paged:
        cache = PagedKVCache.create(cfg, rows=B, num_pages=2 * B, page_size=4,
                                    pages_per_row=2).replace(
            page_table=jnp.arange(2 * B, dtype=jnp.int32).reshape(B, 2))
    linear = [kind == "linear" for kind in cfg.layer_types]
    assert [s is not None for s in cache.linear] == linear
    assert [k.shape[1] for k in cache.k] == [0 if lin else cfg.num_kv_heads for lin in linear]
    model = models.build(cfg)
    tokens = jnp.asarray([5, 9], jnp.int32)
    params = model.init(jax.random.key(0), tokens[:, None])["params"]
    _, update = model.apply({"params": params}, tokens, cache, method="read_step")
    after = cache.commit(update, jnp.asarray([True, False]))
    np.testing.assert_array_equal(after.lengths, [1, 0])
    for layer in np.flatnonzero(linear):
        new, old = after.linear[layer], cache.linear[layer]
        assert not np.allclose(new.recurrent[0], old.recurrent[0])
        chex.assert_trees_all_equal(_row(new, 1), _row(old, 1))
        chex.assert_trees_all_equal(_row(new, 0), _row(update.layers[layer], 0))
