"""Speculative decoding: a small draft model proposes k tokens, the target checks them in one
call, and every row keeps what the target would have chosen itself.

    out = decode.generate(model, params, prompts, lengths, max_new_tokens=64,
                          draft_model=small, draft_params=small_params, draft_tokens=4)

Each iteration, for every row at once (Leviathan et al. 2023; Chen et al. 2023):

    1. the draft feeds the row's last token and proposes d_1 .. d_k, one step each,
       sampling from its own processed distributions q_1 .. q_k (greedy: their argmax);
    2. the target reads [last, d_1 .. d_k] in one parallel call over its cache (a prefill
       of k + 1 tokens) and gives its processed distributions p_0 .. p_k;
    3. d_i is accepted while the earlier ones were, with probability min(1, p(d_i) / q(d_i))
       under p_(i-1) and q_i (greedy: while it is the target's argmax); the first rejected
       position i is replaced by a token drawn from max(0, p_(i-1) - q_i), normalised, and
       when all k are accepted one more is drawn from p_k. So a row gains 1 to k + 1 tokens
       per iteration, and they are distributed exactly as the target's own sampling (or,
       greedy, equal to its own greedy tokens);
    4. both caches roll back by lengths: they wrote all k + 1 tokens, and keep the accepted
       ones (the next iteration overwrites the rest). A model with linear (Gated DeltaNet)
       layers cannot roll a recurrent state back, which has taken in every token: its cache
       takes the states from before the iteration again and reads the kept tokens once more
       (a prefill of k + 1 tokens, each row's kept ones real), which costs that model a
       second call of k + 1 tokens per iteration.

    row 0, k = 3: draft a b c, target agrees on a b, not c -> a b x (x from p_2 - q_3)
    row 1, k = 3: draft d e f, target agrees on all       -> d e f y (y from p_3)

The processors and token constraints apply to each position as `decode.generate` applies
them to that new token (its index for forced and minimum-length ids, the tokens before it
for the repetition penalty and repeated n-grams), to p and to q alike. Rows stop at an end
token or at `max_new_tokens`; a row that stops inside an iteration keeps only its tokens up
to there. The loop is a `lax.while_loop` (it ends once every row has), not differentiable.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from decode import ngrams
from decode.processors import (
    Constraints,
    SamplingParams,
    Strategy,
    constrain_logits,
    process_logits,
)


@flax.struct.dataclass
class Models:
    """The target and the draft, as the loop calls them (static modules, traced params)."""

    target: object = flax.struct.field(pytree_node=False)
    target_params: object = None
    draft: object = flax.struct.field(pytree_node=False, default=None)
    draft_params: object = None


@flax.struct.dataclass
class Rules:
    """What chooses a token: the sampling values, the strategy, the constraints (or None),
    the end ids, the row count N and the pad id written after a row's end."""

    sampling: SamplingParams
    constraints: Constraints | None
    strategy: Strategy = flax.struct.field(pytree_node=False)
    eos_ids: tuple[int, ...] | None = flax.struct.field(pytree_node=False, default=None)
    max_new_tokens: int = flax.struct.field(pytree_node=False, default=1)
    pad_id: int = flax.struct.field(pytree_node=False, default=0)


@flax.struct.dataclass
class History:
    """What the processors read of a row's sequence so far (None where not compiled in)."""

    seen: Bool[Array, "B V"] | None
    ngrams: ngrams.NgramHistory | None

    def add(self, token_B, valid_B=True) -> History:
        """The history with `token_B` appended where `valid_B` holds."""
        seen = self.seen
        if seen is not None:
            valid = jnp.broadcast_to(jnp.asarray(valid_B), token_B.shape)
            rows = jnp.arange(seen.shape[0])
            seen = seen.at[rows, token_B].set(seen[rows, token_B] | valid)
        grams = None if self.ngrams is None else ngrams.append(self.ngrams, token_B, valid_B)
        return History(seen, grams)


@flax.struct.dataclass
class SpecState:
    """The loop carry.

    Attributes:
        n: int32[B] tokens each row has emitted; its last one is `last`, in neither cache.
        last: int32[B] the last emitted token, the next one both models read.
        target_cache, draft_cache: the models' caches, holding every emitted token but
            `last`.
        history: the processors' view of each row's sequence (its emitted tokens).
        rng: the PRNG key.
        done: bool[B] rows that ended (an end token, or N tokens).
        tokens: int32[B, N]; logprobs: float32[B, N] the target's log-probability of each
            (before any processor), 0 after the end.
        drafted, accepted: int32[B] draft tokens proposed to, and accepted by, each row.
    """

    n: Int[Array, " B"]
    last: Int[Array, " B"]
    target_cache: object
    draft_cache: object
    history: History
    rng: jax.Array
    done: Bool[Array, " B"]
    tokens: Int[Array, "B N"]
    logprobs: Float[Array, "B N"]
    drafted: Int[Array, " B"]
    accepted: Int[Array, " B"]


def distribution(logits_BV, step_B, history: History, rules: Rules):
    """The processed distribution of new token `step_B` (one index per row): the processors
    and constraints `decode.generate` applies, then softmax, or one-hot at the argmax in a
    greedy row (temperature 0, or no sampling compiled in)."""
    constrain = None
    if rules.constraints is not None:
        c = rules.constraints
        repeated = (None if history.ngrams is None else
                    ngrams.repeated(history.ngrams, c.no_repeat_ngram_size, logits_BV.shape[-1]))
        def constrain(logits):                                            # noqa: E306
            return constrain_logits(logits, c, step_B, rules.max_new_tokens - 1, repeated)
    processed = process_logits(logits_BV, history.seen, rules.sampling, rules.strategy,
                               constrain)
    greedy = jax.nn.one_hot(jnp.argmax(processed, axis=-1), processed.shape[-1])
    if not rules.strategy.sample:
        return greedy
    sampled = jax.nn.softmax(processed.astype(jnp.float32), axis=-1)
    return jnp.where((rules.sampling.temperature > 0)[:, None], sampled, greedy)


def draw(probs_BV, key):
    """A token per row from `probs_BV` (a one-hot row gives its token)."""
    return jax.random.categorical(key, jnp.log(probs_BV), axis=-1).astype(jnp.int32)


def propose(models: Models, s: SpecState, rules: Rules, k: int, key):
    """The draft's k tokens after each row's `last` (step 1): (d_BK, q_BKV, the draft cache
    with `last`, d_1 .. d_k written, history after d_1 .. d_k). k + 1 draft steps: the last
    one writes d_k, so a row that accepts all k finds it in the cache."""
    def one(carry, j):
        token_B, cache, history = carry
        logits_BV, cache = models.draft.apply({"params": models.draft_params}, token_B, cache,
                                              method="step")
        q_BV = distribution(logits_BV.astype(jnp.float32), s.n + j, history, rules)
        d_B = draw(q_BV, jax.random.fold_in(key, j))
        return (d_B, cache, history.add(d_B)), (d_B, q_BV)

    (_, cache, _), (d_KB, q_KBV) = lax.scan(one, (s.last, s.draft_cache, s.history),
                                            jnp.arange(k + 1))
    return d_KB[:k].T, q_KBV[:k].transpose(1, 0, 2), cache


def verify(models: Models, s: SpecState, d_BK, rules: Rules):
    """The target's logits after `last` and each draft token, in one call (step 2):
    (raw logits float32[B, k + 1, V], processed distributions p_BKV [B, k + 1, V], the
    target cache with all k + 1 written)."""
    B, k = d_BK.shape
    tokens_BT = jnp.concatenate([s.last[:, None], d_BK], axis=1)
    logits_BTV, cache = models.target.apply(
        {"params": models.target_params}, tokens_BT, jnp.full((B,), k + 1, jnp.int32),
        s.target_cache, method="prefill")
    logits_BTV = logits_BTV.astype(jnp.float32)
    history, p = s.history, []
    for i in range(k + 1):
        p.append(distribution(logits_BTV[:, i], s.n + i, history, rules))
        if i < k:
            history = history.add(d_BK[:, i])
    return logits_BTV, jnp.stack(p, axis=1), cache


def accept(d_BK, q_BKV, p_BTV, key):
    """(a_B, the tokens each row gains [B, k + 1]) of step 3: a_B accepted draft tokens, then
    the replacement (or, a_B = k, the extra) token at index a_B; entries past it are unused.

        d [[4, 7]], p(4) / q(4) = 1, p(7) / q(7) = 0.1, u = [0.5, 0.3]
        -> a = 1 (7 is rejected: 0.3 > 0.1); tokens [4, x], x from max(0, p_1 - q_2)
    """
    B, k = d_BK.shape
    u_key, r_key = jax.random.split(key)
    p_d = jnp.take_along_axis(p_BTV[:, :k], d_BK[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q_BKV, d_BK[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(u_key, (B, k))
    ok_BK = u * q_d < p_d                       # u < p / q, without dividing by q = 0
    a_B = jnp.sum(jnp.cumprod(ok_BK.astype(jnp.int32), axis=1), axis=1)
    p_a = jnp.take_along_axis(p_BTV, a_B[:, None, None], axis=1)[:, 0]
    q_next = jnp.concatenate([q_BKV, jnp.zeros_like(q_BKV[:, :1])], axis=1)
    q_a = jnp.take_along_axis(q_next, a_B[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_a - q_a, 0.0)
    total = residual.sum(-1, keepdims=True)
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_a)
    extra_B = draw(residual, r_key)
    gained = jnp.concatenate([d_BK, jnp.zeros((B, 1), jnp.int32)], axis=1)
    gained = jnp.where(jnp.arange(k + 1)[None, :] == a_B[:, None], extra_B[:, None], gained)
    return a_B, gained


def rolled_back(model, params, before, after, tokens_BT, keep_B):
    """The cache `after` (all of `tokens_BT` written) as if only each row's first `keep_B`
    had been: its lengths moved back (the next writes overwrite the rest), and, with linear
    layers, their states rebuilt from `before`'s by reading the kept tokens again."""
    lengths = before.lengths + keep_B
    if after.linear is None:
        return after.replace(lengths=lengths)
    _, cache = model.apply({"params": params}, tokens_BT, keep_B,
                           after.replace(linear=before.linear, lengths=before.lengths),
                           method="prefill")
    return cache.replace(lengths=lengths)


def iteration(models: Models, s: SpecState, rules: Rules, k: int) -> SpecState:
    """One iteration for every row (the module docstring's steps 1 to 4)."""
    B, N = s.tokens.shape
    rng, draft_key, accept_key = jax.random.split(s.rng, 3)
    d_BK, q_BKV, draft_cache = propose(models, s, rules, k, draft_key)
    logits_BTV, p_BTV, target_cache = verify(models, s, d_BK, rules)
    a_B, gained_BT = accept(d_BK, q_BKV, p_BTV, accept_key)
    # The tokens kept: up to a + 1, the row's room, and its first end token.
    T = k + 1
    index_T = jnp.arange(T)
    keep_B = jnp.minimum(a_B + 1, N - s.n)
    if rules.eos_ids is not None:
        ends_BT = jnp.isin(gained_BT, jnp.asarray(rules.eos_ids, jnp.int32)) & (
            index_T[None, :] < keep_B[:, None])
        first_end_B = jnp.where(ends_BT.any(1), jnp.argmax(ends_BT, axis=1), T)
        keep_B = jnp.minimum(keep_B, first_end_B + 1)
    else:
        ends_BT = jnp.zeros((B, T), bool)
    keep_B = jnp.where(s.done, 0, keep_B)
    kept_BT = index_T[None, :] < keep_B[:, None]
    logprob_BT = jnp.take_along_axis(jax.nn.log_softmax(logits_BTV), gained_BT[..., None],
                                     axis=-1)[..., 0]
    slots_BT = jnp.where(kept_BT, s.n[:, None] + index_T[None, :], N)      # N: dropped
    rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    tokens = s.tokens.at[rows_BT, slots_BT].set(gained_BT, mode="drop")
    logprobs = s.logprobs.at[rows_BT, slots_BT].set(logprob_BT, mode="drop")
    history = s.history
    for i in range(T):
        history = history.add(gained_BT[:, i], kept_BT[:, i])
    n = s.n + keep_B
    ended_B = (ends_BT & kept_BT).any(1)
    last = jnp.take_along_axis(gained_BT, jnp.maximum(keep_B - 1, 0)[:, None], axis=1)[:, 0]
    # Both caches hold `last` and d_1 .. d_k (T tokens); each row keeps its first keep_B.
    fed_BT = jnp.concatenate([s.last[:, None], d_BK], axis=1)
    return SpecState(
        n=n, last=jnp.where(keep_B > 0, last, s.last),
        target_cache=rolled_back(models.target, models.target_params, s.target_cache,
                                 target_cache, fed_BT, keep_B),
        draft_cache=rolled_back(models.draft, models.draft_params, s.draft_cache,
                                draft_cache, fed_BT, keep_B), history=history,
        rng=rng, done=s.done | ended_B | (n >= N), tokens=tokens, logprobs=logprobs,
        drafted=s.drafted + jnp.where(s.done, 0, k),
        accepted=s.accepted + jnp.where(s.done, 0, jnp.minimum(a_B, keep_B)))


def speculative_loop(models: Models, start: SpecState, rules: Rules, k: int) -> SpecState:
    """Iterations until every row is done (a `lax.while_loop`)."""
    return lax.while_loop(lambda s: ~jnp.all(s.done),
                          lambda s: iteration(models, s, rules, k), start)


def first_token(logits_BV, history: History, rules: Rules, key):
    """The first new token of each row, from the target's prefill logits: as `generate`
    chooses it (new token 0), with its log-probability."""
    B = logits_BV.shape[0]
    probs = distribution(logits_BV.astype(jnp.float32), jnp.zeros((B,), jnp.int32), history,
                         rules)
    token_B = draw(probs, key)
    logprob_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV.astype(jnp.float32)),
                                    token_B[:, None], axis=-1)[:, 0]
    return token_B, logprob_B


def start_state(first, caches, history: History, rules: Rules, rng) -> SpecState:
    """The carry after the first token: `first` = (token_B, logprob_B), `caches` = (the
    target's, the draft's) after the decoder prompt."""
    token_B, logprob_B = first
    B, N = token_B.shape[0], rules.max_new_tokens
    ended = (jnp.zeros((B,), bool) if rules.eos_ids is None
             else jnp.isin(token_B, jnp.asarray(rules.eos_ids, jnp.int32)))
    tokens = jnp.zeros((B, N), jnp.int32).at[:, 0].set(token_B)
    logprobs = jnp.zeros((B, N), jnp.float32).at[:, 0].set(logprob_B)
    zeros = jnp.zeros((B,), jnp.int32)
    return SpecState(n=jnp.ones((B,), jnp.int32), last=token_B, target_cache=caches[0],
                     draft_cache=caches[1], history=history.add(token_B), rng=rng,
                     done=ended | (N == 1), tokens=tokens, logprobs=logprobs, drafted=zeros,
                     accepted=zeros)


def finish(s: SpecState, rules: Rules):
    """(tokens with the pad id after each row's end, logprobs 0 there, lengths)."""
    after_BN = jnp.arange(s.tokens.shape[1])[None, :] >= s.n[:, None]
    return (jnp.where(after_BN, rules.pad_id, s.tokens), jnp.where(after_BN, 0.0, s.logprobs),
            s.n)
