"""A long prompt into the cache in chunks: no [T, S] attention and no [T, V] logits.

    logits_BV, cache = prefill_in_chunks(model, params, prompts_BP, lengths_B, cache,
                                         chunk=512)

`model.apply(..., method="prefill")` runs a whole block at once: its attention is T queries
over the S cache slots and its output T logits per row. This runs the same prefill on
`chunk` tokens at a time in a `lax.scan` (compiled once, whatever the prompt's length):
each chunk attends over the slots the earlier chunks wrote, and only each row's last real
token gets logits. With 4 tokens per chunk, rows of 6 and 3 real tokens:

    chunk 0: tokens 0..3   new lengths [4, 3]   row 1 ends here: its logits at index 2
    chunk 1: tokens 4..7   new lengths [2, 0]   row 0 ends here: its logits at index 1
    -> cache.lengths [6, 3]; logits of token 5 of row 0 and token 2 of row 1

A row that has ended still runs the later chunks (with no new tokens: its length stops),
writing its padding into slots after its tokens, which its next tokens overwrite, as the
padding of a one-block prefill is.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from models.cache import KVCache
from models.errors import check_positive_int


def prefill_in_chunks(model: nn.Module, params, tokens_BP: Int[Array, "B P"],
                      lengths_B: Int[Array, " B"], cache: KVCache, *,
                      chunk: int) -> tuple[Float[Array, "B V"], KVCache]:
    """Prefills right-padded `tokens_BP` (row b's first lengths[b] are real) in chunks of
    `chunk` tokens, and returns each row's next-token logits (float32[B, V]) and the cache.

    The prompt width P is padded to whole chunks (a chunk wider than P is one chunk of
    P); the padding is written only where the cache has slots for it. Every row needs at
    least one real token.
    """
    B, P = tokens_BP.shape
    chunk = min(check_positive_int(chunk, "chunk"), P)
    n = -(-P // chunk)
    tokens_BP = jnp.pad(tokens_BP, ((0, 0), (0, n * chunk - P)))
    chunks_NBC = tokens_BP.reshape(B, n, chunk).transpose(1, 0, 2)
    lengths_B = lengths_B.astype(jnp.int32)
    last_B = lengths_B - 1                                # each row's last real token

    def one_chunk(carry, j_and_tokens):
        logits_BV, cache = carry
        j, tokens_BC = j_and_tokens
        start = j * chunk
        new_B = jnp.clip(lengths_B - start, 0, chunk)
        at_B = jnp.clip(last_B - start, 0, chunk - 1)
        chunk_logits_BV, cache = model.apply({"params": params}, tokens_BC, new_B, cache,
                                             at_B, method="prefill")
        ends_here_B = (last_B >= start) & (last_B < start + chunk)
        return (jnp.where(ends_here_B[:, None], chunk_logits_BV, logits_BV), cache), None

    logits_BV = jnp.zeros((B, model.config.vocab_size), jnp.float32)
    (logits_BV, cache), _ = lax.scan(one_chunk, (logits_BV, cache),
                                     (jnp.arange(n, dtype=jnp.int32), chunks_NBC))
    return logits_BV, cache
