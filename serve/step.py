"""The engine's device side: one jitted step over fixed shapes, and the encoder's admission.

    tokens, logprobs, state = run_step(model, params, state, rows)    # R rows x T tokens
    state = admit_sources(model, params, state, slots_R, src_RS, lengths_R)  # enc-dec

`DeviceState` is everything the device keeps between steps: the paged cache's pools (and,
for an encoder-decoder, each slot's cross-attention keys/values; with linear layers, each
slot's recurrent state, zeroed when its row starts at position 0), and each slot's tokens
seen (the repetition penalty) and generated-token counts (OpenAI's presence and frequency
penalties). The host sends the rest with every step (`StepRows`): which slots the R rows
are, their page tables and lengths, the block of tokens each feeds, and its sampling values.
So a step's shapes are fixed by (R, T, M) alone and the host decides everything else
between steps.

A row's block is right-padded: `n_new[r]` of its T tokens are real (0: a padding row,
whose slot index is out of range, so nothing of it is written). Each real row gets the
token chosen from the logits of its last real token: for a prompt chunk that does not end
the prompt the host ignores it. Row r's random key is `fold_in(key(seed[r]), generated[r])`:
its n-th sampled token depends on its seed and n alone, not on its batch mates.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from decode.placement import constrain_cache
from decode.processors import (
    SamplingParams,
    Strategy,
    ban_tokens,
    process_logits,
)
from models.cache import self_leaves
from models.errors import UserError
from models.lora import join
from models.paged_cache import PagedKVCache
from serve.adapters import rows_of

# Every processor is compiled in: a value that is off (temperature 0, top_k 0, top_p 1,
# min_p 0, penalty 1) leaves the logits bit for bit, so greedy rows choose what
# `decode.generate` chooses, and one compilation serves every mix of requests.
STRATEGY = Strategy(sample=True, top_k=True, top_p=True, min_p=True, penalty=True)


@flax.struct.dataclass
class DeviceState:
    """What the device keeps between steps (donated to each step, updated in place).

    Attributes:
        cache: the pools of pages (and per-slot cross-attention regions); its page table
            and lengths are placeholders, replaced by each step's rows.
        seen: bool[slots, V] the tokens each slot's decoder has been fed.
        counts: int32[slots, V] how often each slot generated each token.
    """

    cache: PagedKVCache
    seen: Bool[Array, "Sl V"]
    counts: Int[Array, "Sl V"]


# The per-row values of a step, packed into one int and one float array: a step sends four
# arrays to the device, not fifteen (each a transfer of its own, most of a small model's
# step time on a CPU host).
INTS = ("slots", "n_new", "lengths", "generated_from", "generated", "seed", "top_k",
        "adapter")
FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence", "frequency")
# A padding row: no slot, nothing fed, every processor off.
PADDING = dict(temperature=0.0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence=0.0,
               frequency=0.0)


@flax.struct.dataclass
class StepRows:
    """The R rows of one step (host values, sent with each step).

    Attributes:
        ints: int32[8, R], by `INTS`: each row's slot (>= the slot count for a padding
            row); its real tokens in the block (0: padding row); the positions its slot
            held before the block; the first position of a generated token (the decoder
            prompt's length: fed tokens from there on count as generated); the tokens
            generated so far (the index of the one chosen now); its sampling seed (the
            bits of a uint32); its top_k; its LoRA adapter (`serve.adapters`; 0: none).
        floats: float32[6, R], by `FLOATS`: temperature, top_p, min_p, the repetition
            penalty, OpenAI's presence and frequency penalties.
        tokens: int32[R, T] each row's block, right-padded.
        page_table: int32[R, M] each row's pages.
    """

    ints: Int[Array, "I R"]
    floats: Float[Array, "F R"]
    tokens: Int[Array, "R T"]
    page_table: Int[Array, "R M"]

    @classmethod
    def padding(cls, R: int, T: int, M: int, *, slots: int, num_pages: int) -> StepRows:
        """R padding rows as numpy arrays, for the host to fill row by row."""
        ints = np.zeros((len(INTS), R), np.int32)
        ints[INTS.index("slots")] = slots
        floats = np.array([[PADDING[n]] * R for n in FLOATS], np.float32).reshape(-1, R)
        return cls(ints, floats, np.zeros((R, T), np.int32),
                   np.full((R, M), num_pages, np.int32))

    def set(self, r: int, **values) -> None:
        """Row r's values by name (host side, numpy)."""
        for name, value in values.items():
            if name in INTS:
                self.ints[INTS.index(name), r] = np.array(value, np.uint32).view(np.int32) \
                    if name == "seed" else value
            else:
                self.floats[FLOATS.index(name), r] = value

    def __getattr__(self, name):
        if name in INTS:
            return self.ints[INTS.index(name)]
        if name in FLOATS:
            return self.floats[FLOATS.index(name)]
        raise AttributeError(name)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty)


def create_state(config, *, slots: int, num_pages: int, page_size: int, pages_per_slot: int,
                 source_len: int | None, cache_sharding=None,
                 kv_cache_dtype: str = "auto") -> DeviceState:
    """An empty state: no page written, no token seen; made where it will live (split
    over kv heads by `cache_sharding`, never whole on one device first). The pool holds
    `kv_cache_dtype` pages ("auto": the config's dtype; "int8")."""
    def make():
        cache = PagedKVCache.create(config, rows=slots, num_pages=num_pages,
                                    page_size=page_size, pages_per_row=pages_per_slot,
                                    source_len=source_len, dtype=kv_cache_dtype)
        V = config.vocab_size
        return pinned(DeviceState(cache, jnp.zeros((slots, V), bool),
                                  jnp.zeros((slots, V), jnp.int32)), cache_sharding)
    return jax.jit(make)()


def _rows_of(x, slots_R, all_slots: bool):
    """Per-slot arrays (leading axis the slots) as the R rows' (the slots themselves when
    the step covers every slot in order)."""
    if all_slots:
        return x
    return jnp.take(x, jnp.minimum(slots_R, x.shape[0] - 1), axis=0)


def _cross_rows(cache: PagedKVCache, slots_R, all_slots: bool):
    if cache.cross_k is None or all_slots:
        return cache.cross_k, cache.cross_v, cache.cross_mask
    looped = isinstance(cache.cross_k, tuple)

    def take(x):
        if looped:
            return tuple(_rows_of(layer, slots_R, False) for layer in x)
        return jnp.take(x, jnp.minimum(slots_R, x.shape[1] - 1), axis=1)
    return take(cache.cross_k), take(cache.cross_v), _rows_of(cache.cross_mask, slots_R, False)


@flax.struct.dataclass
class Banned:
    """The engine's token bans, the same for every request (a model's own: Marian's pad
    token, Whisper's suppressed tokens).

    Attributes:
        always: bool[V] ids never generated.
        first: bool[V] ids not generated as a request's first new token.
    """

    always: Bool[Array, " V"]
    first: Bool[Array, " V"]

    @classmethod
    def for_model(cls, pre, always=None, first=None) -> tuple[tuple[int, ...], Banned]:
        """(the ids banned always, as a sorted tuple; the `Banned` masks), the model's own where
        not given."""
        cfg = pre.config
        if cfg.audio is not None and (always is None or first is None):
            from decode.whisper import WhisperSettings
            settings = WhisperSettings.from_generation(pre.generation, cfg)
            always = settings.suppress if always is None else always
            first = settings.begin_suppress if first is None else first
        always = tuple(getattr(pre.generation, "banned_ids", None) or ()) if always is None \
            else tuple(always)
        masks = []
        for name, ids in (("banned_ids", always), ("banned_first_ids", first or ())):
            ids = [int(i) for i in ids]
            if any(not 0 <= i < cfg.vocab_size for i in ids):
                raise UserError(f"{name}={ids} has ids outside [0, "
                                f"vocab_size={cfg.vocab_size})")
            mask = np.zeros((cfg.vocab_size,), bool)
            mask[ids] = True
            masks.append(mask)
        return tuple(sorted(set(always))), cls(*masks)


def pinned(state: DeviceState, sharding) -> DeviceState:
    """The state's pools and cross-attention regions split like the parameters' kv heads
    (`decode.placement.cache_sharding`; None: as the compiler likes). Inside jit."""
    return state.replace(cache=constrain_cache(state.cache, sharding))


@functools.partial(jax.jit, static_argnames=("model", "all_slots", "cache_sharding", "steps"),
                   donate_argnums=(2,))
def run_step(model, params, state: DeviceState, rows: StepRows, banned: Banned,
             adapters=None, *, all_slots: bool = False, cache_sharding=None, steps: int = 1):
    """Feeds each row its block and chooses its next token: the model's logits, then
    transformers' order (`decode.processors`): the repetition penalty (and OpenAI's
    presence and frequency penalties), the bans, the sampling values.

    With `steps` > 1 (one-token blocks only) it goes on: each row is fed the token it just
    chose, `steps` times in one computation (`lax.scan`), so the host sends one step's
    rows and reads `steps` tokens per row. The host gives each row the pages for all of
    them; a row that ends on the way (an end id, a stop string) ignores the rest.

    `adapters`: a `serve.adapters` stacked tree (the model built with its per-row config),
    of which each row takes its own entry, or None.

    Returns:
        (tokens int32[steps, R], logprobs float32[steps, R]: the model's log-probability of
        each chosen token, before any processor), and the state.
    """
    state = pinned(state, cache_sharding)
    if adapters is not None:
        params = join(params, rows_of(adapters, rows.adapter))
    if steps == 1:
        token_R, logprob_R, state = _one_step(model, params, state, rows, banned, all_slots)
        return token_R[None], logprob_R[None], pinned(state, cache_sharding)
    if rows.tokens.shape[1] != 1:
        raise ValueError(f"steps={steps} feeds one token a row; the block is "
                         f"{rows.tokens.shape[1]} wide")

    def body(carry, _):
        state, rows = carry
        token_R, logprob_R, state = _one_step(model, params, state, rows, banned, all_slots)
        real_R = (rows.n_new > 0).astype(jnp.int32)
        ints = rows.ints.at[INTS.index("lengths")].add(real_R)
        ints = ints.at[INTS.index("generated")].add(real_R)
        rows = rows.replace(ints=ints, tokens=token_R[:, None])
        return (pinned(state, cache_sharding), rows), (token_R, logprob_R)
    (state, _), (tokens_SR, logprobs_SR) = jax.lax.scan(body, (state, rows), None,
                                                        length=steps)
    return tokens_SR, logprobs_SR, pinned(state, cache_sharding)


def _one_step(model, params, state: DeviceState, rows: StepRows, banned: Banned,
              all_slots: bool):
    """One step of `run_step`: (tokens int32[R], logprobs float32[R], the state)."""
    R, T = rows.tokens.shape
    cross_k, cross_v, cross_mask = _cross_rows(state.cache, rows.slots, all_slots)
    # A real row that starts at position 0 (a new request, or one preempted and fed again
    # from its start) starts from nothing seen, no counts and zero linear states. A padding
    # row keeps its slot's (in a step over every slot, it is an idle slot: its request may
    # be waiting its turn).
    fresh_R = (rows.lengths == 0) & (rows.n_new > 0)
    linear = jax.tree.map(
        lambda x: jnp.where(fresh_R.reshape((-1,) + (1,) * (x.ndim - 1)), 0,
                            _rows_of(x, rows.slots, all_slots)), state.cache.linear)
    cache = state.cache.replace(page_table=rows.page_table, lengths=rows.lengths,
                                cross_k=cross_k, cross_v=cross_v, cross_mask=cross_mask,
                                linear=linear)
    logits_RV, cache = model.apply({"params": params}, rows.tokens, rows.n_new, cache,
                                   jnp.maximum(rows.n_new - 1, 0), method="prefill")

    # What each row's decoder has been fed, and generated, up to its last real token.
    fresh_R1 = fresh_R[:, None]
    seen_RV = _rows_of(state.seen, rows.slots, all_slots) & ~fresh_R1
    counts_RV = jnp.where(fresh_R1, 0, _rows_of(state.counts, rows.slots, all_slots))
    t_T = jnp.arange(T, dtype=jnp.int32)[None, :]
    real_RT = t_T < rows.n_new[:, None]
    generated_RT = real_RT & (rows.lengths[:, None] + t_T >= rows.generated_from[:, None])
    rows_RT = jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32)[:, None], (R, T))
    seen_RV = seen_RV.at[rows_RT, rows.tokens].max(real_RT)
    counts_RV = counts_RV.at[rows_RT, rows.tokens].add(generated_RT.astype(jnp.int32))

    penalised_RV = (logits_RV - rows.presence[:, None] * (counts_RV > 0)
                    - rows.frequency[:, None] * counts_RV)
    first_R1 = (rows.generated == 0)[:, None]

    def constrain(x_RV):
        return ban_tokens(ban_tokens(x_RV, banned.always), banned.first[None, :] & first_R1)
    # The penalties and bans, then greedy rows' argmax (the sampling processors keep the
    # top token, so they could not change it); the sampling processors and the draws run
    # only in a step with a sampled row (a branch: a greedy step pays nothing for them).
    greedy_R = jnp.argmax(process_logits(penalised_RV, seen_RV, rows.sampling,
                                         Strategy(penalty=True), constrain),
                          axis=-1).astype(jnp.int32)

    def sampled():
        processed_RV = process_logits(penalised_RV, seen_RV, rows.sampling, STRATEGY,
                                      constrain)
        seeds_R = jax.lax.bitcast_convert_type(rows.seed, jnp.uint32)
        keys_R = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(
            seeds_R, rows.generated)
        draws_R = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys_R, processed_RV)
        return jnp.where(rows.sampling.temperature > 0, draws_R.astype(jnp.int32), greedy_R)
    token_R = jax.lax.cond(jnp.any(rows.sampling.temperature > 0), sampled, lambda: greedy_R)
    logprob_R = (jnp.take_along_axis(logits_RV, token_R[:, None], axis=-1)[:, 0]
                 - jax.nn.logsumexp(logits_RV, axis=-1))

    def put(x, new):
        return new if all_slots else x.at[rows.slots].set(new, mode="drop")
    state = DeviceState(
        cache=state.cache.replace(**self_leaves(cache), linear=jax.tree.map(
            put, state.cache.linear, cache.linear)),
        seen=put(state.seen, seen_RV), counts=put(state.counts, counts_RV))
    return token_R, logprob_R, state


@functools.partial(jax.jit, static_argnames=("model", "cache_sharding"), donate_argnums=(2,))
def admit_sources(model, params, state: DeviceState, slots_R, src_RS, lengths_R=None,
                  adapters=None, adapter_R=None, *, cache_sharding=None):
    """Encodes the R arriving sources and gives their slots the cross-attention keys and
    values, kept for the request's life. Text: right-padded ids with their `lengths_R`;
    audio (Whisper): features [R, mel, frames], every encoder position real. A padding
    row's slot is out of range (nothing of it is kept). With `adapters`, row r's encoder
    and cross-attention projections are adapted by its entry `adapter_R[r]`."""
    if adapters is not None:
        params = join(params, rows_of(adapters, adapter_R))
    variables = {"params": params}
    encoded_RSD = model.apply(variables, src_RS, lengths=lengths_R, method="encode")
    cross_k, cross_v = model.apply(variables, encoded_RSD,
                                   method=lambda m, x: m.cross_kv(x))
    S = encoded_RSD.shape[1]
    mask_RS = (jnp.ones((src_RS.shape[0], S), bool) if lengths_R is None
               else jnp.arange(S)[None, :] < lengths_R[:, None])
    state = pinned(state, cache_sharding)
    return pinned(state.replace(cache=state.cache.set_cross(slots_R, cross_k, cross_v,
                                                            mask_RS)), cache_sharding)
