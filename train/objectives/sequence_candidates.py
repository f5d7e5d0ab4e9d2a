"""Candidates for the sequence-level objectives: drawn from the current parameters by the
project's jitted decoding, and scored teacher-forced with gradients.

    keys_B2 = row_keys(key, row_ids)                            # one key per global row
    tokens_BKN, lengths_BK = draw(model, params, sources_BS, source_lengths_B, keys_B2,
                                  drawing=Drawing(candidates=4, max_new_tokens=16))
    logp_BK = candidate_logprobs(model, params, batch, tokens_BKN, lengths_BK, bos_id=2,
                                 dropout_rng=rng, train=True)

Each source's candidates are one `decode.generate` call (its K copies as a batch, with its
row's key) under `jax.vmap` over the sources, so a source draws the same candidates
whichever device holds it and however many rows share the device: the draws are a function
of the step key and the row's global index (as masked LM draws its masks), and a resumed
run draws what the straight run did. Beam search (`sampling="beam"`) gives each source's K
best beams instead; both are `lax.scan` loops, traced into the train step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

import decode
from train.objectives.next_token import forward, shift_right


@dataclasses.dataclass(frozen=True)
class Drawing:
    """How candidates are drawn (the `sequence.*` keys they come from).

    Attributes:
        candidates: K per source.
        sampling: "sample" or "beam".
        temperature, top_k: the sampling values.
        max_new_tokens: N, each candidate's longest length (end token included).
    """

    candidates: int
    sampling: str = "sample"
    temperature: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32


def row_keys(key: jax.Array, row_ids: Int[Array, " B"]) -> jax.Array:
    """uint32[B, 2]-style key data, one key per row: `fold_in(key, global row id)`."""
    return jax.vmap(lambda r: jax.random.key_data(jax.random.fold_in(key, r)))(row_ids)


def draw(model, params, sources_BS, lengths_B, keys_B, *, drawing: Drawing
         ) -> tuple[Int[Array, "B K N"], Int[Array, "B K"]]:
    """K candidates per source from `params` (no gradient flows into them): tokens (pad
    after the end token) and lengths (the end token included)."""
    params = jax.lax.stop_gradient(params)
    K, N = drawing.candidates, drawing.max_new_tokens

    def one(source_S, length, key_data):
        if drawing.sampling == "beam":
            out = decode.beam_search(model, params, source_S[None], length[None], beam_size=K,
                                     max_new_tokens=N)
            return out.tokens[0], out.lengths[0]
        src_KS = jnp.broadcast_to(source_S[None], (K,) + source_S.shape)
        out = decode.generate(model, params, src_KS, jnp.full((K,), length), max_new_tokens=N,
                              rng=jax.random.wrap_key_data(key_data),
                              temperature=drawing.temperature, top_k=drawing.top_k)
        return out.tokens, out.lengths

    # A source with no tokens (a padding row) decodes from one token; its candidates are
    # never counted.
    return jax.vmap(one)(sources_BS, jnp.maximum(lengths_B, 1), keys_B)


def greedy(model, params, sources_BS, lengths_B, *, max_new_tokens: int
           ) -> tuple[Int[Array, "B N"], Int[Array, " B"]]:
    """Each source's greedy output (self-critical training's baseline), no gradient."""
    out = decode.generate(model, jax.lax.stop_gradient(params), sources_BS,
                          jnp.maximum(lengths_B, 1), max_new_tokens=max_new_tokens,
                          temperature=0.0)
    return out.tokens, out.lengths


def pad_width(tokens, width: int):
    """`tokens` (last axis the sequence) right-padded with 0 to `width`."""
    extra = width - tokens.shape[-1]
    return jnp.pad(tokens, [(0, 0)] * (tokens.ndim - 1) + [(0, extra)])


def candidate_logprobs(model, params, batch: dict, tokens_BKW, lengths_BK, *, bos_id: int,
                       dropout_rng, train: bool) -> Float[Array, "B K"]:
    """log p(candidate | source): the sum of its tokens' teacher-forced log-probabilities
    (end token included), by the model's ordinary forward on the [B * K, W] candidates
    beside their sources repeated K times. Differentiable in `params`.

        candidate [5 6 1 0]  length 3  ->  decoder input [BOS 5 6 0],
        log p = log p(5 | BOS) + log p(6 | BOS 5) + log p(1 | BOS 5 6)
    """
    B, K, W = tokens_BKW.shape
    rows = {k: jnp.repeat(batch[k], K, axis=0)
            for k in ("inputs", "inputs_segmentation", "inputs_position")}
    targets_MW = tokens_BKW.reshape(B * K, W)
    real_MW = jnp.arange(W)[None, :] < lengths_BK.reshape(B * K, 1)
    rows["targets_segmentation"] = real_MW.astype(jnp.int32)
    rows["targets_position"] = jnp.where(real_MW, jnp.arange(W)[None, :], 0)
    dec_in = shift_right(targets_MW, rows["targets_position"], rows["targets_segmentation"],
                         bos_id)
    logits_MWV = forward(model, params, rows, dec_in, dropout_rng=dropout_rng,
                         deterministic=not train).astype(jnp.float32)
    token_MW = (jnp.take_along_axis(logits_MWV, targets_MW[..., None], axis=-1)[..., 0]
                - jax.nn.logsumexp(logits_MWV, axis=-1))
    return jnp.sum(jnp.where(real_MW, token_MW, 0.0), axis=-1).reshape(B, K)
