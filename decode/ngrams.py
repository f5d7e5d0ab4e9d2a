"""No repeated n-grams: each row's decoder sequence, and which tokens would repeat one.

transformers' NoRepeatNGramLogitsProcessor bans, at every step, each token that would
complete an n-gram the sequence already holds: the sequence being the decoder's whole input
(a decoder-only model's prompt and new tokens; an encoder-decoder's start token and new
tokens). Matching the last n - 1 tokens against every earlier window at every step costs
O(L * n); here one int per position, updated in O(L) per token, does it for any n, so n is
a traced value:

    match[t] = the length of the longest common suffix of seq[:t] and seq (the whole
               sequence so far), for t < len(seq)

The token at t, seq[t], completes a repeat exactly when match[t] >= n - 1 (the n - 1 tokens
before it equal the sequence's last n - 1). Appending x gives the new match from the old,
shifted by one: match'[t] = match[t - 1] + 1 if seq[t - 1] == x, else 0 (match'[0] = 0).

    seq [7, 8, 9, 7, 8]          match [0, 0, 2, 0, 0]   (seq[:2] = [7, 8] ends like seq)
    n = 3: seq[2] = 9 is banned  (the 3-gram 7 8 9 is there; 7 8 is the current suffix)
    append 9: match' [0, 0, 0, 3, 0, 0]  -> for any n <= 4, seq[3] = 7 would repeat

Row b holds its `length[b]` tokens at positions 0 .. length[b] - 1, so prompts of
different lengths and beams that share a parent need no padding inside the sequence
(transformers left-pads a batch and counts the padding in its n-grams; the same prompt
alone gives what this gives).
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Int


@flax.struct.dataclass
class NgramHistory:
    """Each row's decoder sequence and its suffix matches.

    Attributes:
        tokens: int32[B, L] row b's sequence at positions < length[b] (0 beyond).
        match: int32[B, L] match[b, t] for t < length[b] (see the module docstring).
        length: int32[B] the sequence lengths.
    """

    tokens: Int[Array, "B L"]
    match: Int[Array, "B L"]
    length: Int[Array, " B"]

    def take_rows(self, rows_R) -> NgramHistory:
        """The histories of rows `rows_R` (beam search: each new beam takes its parent's)."""
        return NgramHistory(self.tokens[rows_R], self.match[rows_R], self.length[rows_R])


def append(h: NgramHistory, token_B, valid_B=True) -> NgramHistory:
    """Appends `token_B` to each row where `valid_B` holds (a scalar or one per row).

        tokens [[7, 8, 9, 7, 0, 0]], length [4], match [[0, 1, 0, 0, 0, 0]], append 8
        -> tokens [[7, 8, 9, 7, 8, 0]], length [5], match [[0, 0, 2, 0, 0, 0]]
    """
    B, L = h.tokens.shape
    valid_B = jnp.broadcast_to(jnp.asarray(valid_B), (B,))
    prev_BL = jnp.pad(h.tokens[:, :-1], ((0, 0), (1, 0)))       # seq[t - 1] at t
    prev_match_BL = jnp.pad(h.match[:, :-1], ((0, 0), (1, 0)))
    t_L = jnp.arange(L)
    match_BL = jnp.where((prev_BL == token_B[:, None]) & (t_L[None, :] >= 1), prev_match_BL + 1, 0)
    # Positions at or beyond the length hold 0 and a match that is never read.
    tokens_BL = jnp.where(valid_B[:, None] & (t_L[None, :] == h.length[:, None]),
                          token_B[:, None], h.tokens)
    return NgramHistory(tokens=tokens_BL, match=jnp.where(valid_B[:, None], match_BL, h.match),
                        length=h.length + valid_B.astype(jnp.int32))


def start(prefix_BP, lengths_B, max_len: int) -> NgramHistory:
    """The history of each row's first `lengths_B` tokens of `prefix_BP` (a decoder-only
    model's prompts, or the start token), with room for `max_len` tokens in all."""
    B, P = prefix_BP.shape
    empty = NgramHistory(tokens=jnp.zeros((B, max_len), jnp.int32),
                         match=jnp.zeros((B, max_len), jnp.int32),
                         length=jnp.zeros((B,), jnp.int32))
    return lax.fori_loop(0, P, lambda i, h: append(h, prefix_BP[:, i], i < lengths_B), empty)


def repeated(h: NgramHistory, n, vocab_size: int) -> Bool[Array, "B V"]:
    """bool[B, V]: the tokens that would complete an n-gram the row already holds (none for
    n = 0, or while a row is shorter than n).

        tokens [[7, 8, 9, 7, 8]], match [[0, 0, 2, 0, 0]], n = 3 -> token 9 only
    """
    B, L = h.tokens.shape
    n = jnp.asarray(n, jnp.int32)
    inside_BL = jnp.arange(L)[None, :] < h.length[:, None]
    repeats_BL = inside_BL & (h.match >= n - 1) & (n > 0)
    rows_BL = jnp.broadcast_to(jnp.arange(B)[:, None], (B, L))
    return jnp.zeros((B, vocab_size), bool).at[rows_BL, h.tokens].max(repeats_BL)
