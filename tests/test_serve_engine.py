"""The serving engine (`serve.Engine`): continuous batching over a paged KV cache.

Tiny random models of both generative families with the byte tokenizer, one engine per
family for the module, with a pool small enough that requests are preempted and a prompt
chunk small enough that long prompts are prefilled over several steps. Checked: every
greedy request's tokens equal `decode.generate` on that request alone, whatever arrived
around it; a seeded sampled request repeats itself; end ids, stop strings and the token
limit finish requests as OpenAI's finish reasons say; cancellation and stopping free every
slot and page; and each request the engine cannot decode is refused by name.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
import pytest

import decode
import models
import serve
from models.errors import UserError
from models.pretrained import GenerationDefaults, Pretrained
from serve.engine import Engine
from serve.text import Detokenizer

MAX_LEN = 64
SIZES = dict(max_slots=4, page_size=4, num_pages=12, max_tokens_per_step=16, prefill_chunk=8)


class _Letters:
    """Ids as letters: id i is chr(97 + i % 26) (prefix-stable, so a stop string's place
    in the whole text is its place in the text so far)."""

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def _pretrained(family: str) -> Pretrained:
    name = "gpt-tiny" if family == "decoder_only" else "transformer-tiny"
    cfg = models.get_config(name, vocab_size=260, max_len=MAX_LEN)
    model = models.build(cfg)
    z = np.zeros((1, 4), np.int32)
    params = model.init(jax.random.key(3), *((z,) if family == "decoder_only" else (z, z)))
    return Pretrained(model=model, config=cfg, params=params["params"], tokenizer=_Letters(),
                      generation=GenerationDefaults(), model_type=family)


@pytest.fixture(scope="module", params=["decoder_only", "encoder_decoder"])
def engine(request):
    engine = Engine(_pretrained(request.param), **SIZES).start(warmup=False)
    yield engine
    engine.stop(drain=False)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 260, size=n).tolist() for n in lengths]


def _alone(engine: Engine, prompt, new: int, logprobs: bool = False, **options):
    """`decode.generate`'s tokens for `prompt` alone (and their log-probs)."""
    prompts, lengths = decode.pad_prompts([prompt])
    out = decode.generate(engine.model, engine.params, prompts, lengths, max_new_tokens=new,
                          **options)
    n = int(out.lengths[0])
    tokens = out.tokens[0, :n].tolist()
    return (tokens, np.asarray(out.logprobs[0, :n])) if logprobs else tokens


def _idle(engine: Engine) -> None:
    gauges = engine.gauges()
    assert (gauges["running"], gauges["waiting"], gauges["pages_used"]) == (0, 0, 0)


def test_greedy_requests_equal_generate_alone_through_arrivals_preemptions_and_chunks(engine):
    request = decode.DecodeRequest(max_new_tokens=14, eos_id=None)
    first = _prompts(0, (3, 17, 1, 9))
    later = _prompts(1, (25, 5, 30, 2))        # arrive while the first ones decode
    handles = [engine.submit(serve.Submission(tuple(p), request)) for p in first]
    events = handles[0].events()
    opening = next(events)                       # one token out: decoding has begun
    before = engine.preemptions
    handles += [engine.submit(serve.Submission(tuple(p), request)) for p in later]
    ids = [[*opening.token_ids, *(i for e in events for i in e.token_ids)]]
    ids += [h.result()[1] for h in handles[1:]]
    for prompt, got in zip(first + later, ids, strict=True):
        assert got == _alone(engine, prompt, 14, eos_id=None)
    # 12 pages of 4 positions cannot hold 4 slots of 15 positions or more: some gave way.
    assert engine.preemptions > before
    _idle(engine)


def test_every_token_of_every_request_equals_generate(engine):
    """The first token too (the test above reads one event before its arrivals)."""
    request = decode.DecodeRequest(max_new_tokens=9, eos_id=None)
    prompts = _prompts(2, (11, 4, 20, 7, 1, 13))
    handles = [engine.submit(serve.Submission(tuple(p), request)) for p in prompts]
    for prompt, handle in zip(prompts, handles, strict=True):
        _, ids, last = handle.result()
        want, logprobs = _alone(engine, prompt, 9, logprobs=True, eos_id=None)
        assert ids == want
        # The same numbers, not only the same argmax: a cache that misplaces a key shows.
        np.testing.assert_allclose(last.logprobs, logprobs, atol=2e-5)
        assert last.usage.prompt_tokens == len(prompt)
    _idle(engine)


def test_with_nothing_waiting_one_call_makes_four_tokens_a_row(engine):
    """decode_steps=4 (the default): a lone request's 12 tokens take 3 decode calls (and,
    decoder-only, the prompt's own step, which makes the first), not 12; the same tokens."""
    prompt = _prompts(9, (5,))[0]
    request = decode.DecodeRequest(max_new_tokens=12, eos_id=None)
    before = engine.steps
    ids = engine.submit(serve.Submission(tuple(prompt), request)).result()[1]
    assert ids == _alone(engine, prompt, 12, eos_id=None)
    prompt_steps = 1 if engine.config.architecture == "decoder_only" else 0
    assert engine.steps - before == prompt_steps + 3
    _idle(engine)


def test_a_seeded_sampled_request_repeats_whatever_its_batch_mates(engine):
    request = decode.DecodeRequest(strategy="sample", temperature=0.9, top_p=0.95, top_k=50,
                                   max_new_tokens=10, eos_id=None)
    prompt = tuple(_prompts(3, (6,))[0])
    alone = engine.submit(serve.Submission(prompt, request, seed=11)).result()[1]
    crowd = [engine.submit(serve.Submission(tuple(p), request, seed=s))
             for s, p in enumerate(_prompts(4, (9, 30, 2)))]
    again = engine.submit(serve.Submission(prompt, request, seed=11))
    other = engine.submit(serve.Submission(prompt, request, seed=12))
    assert again.result()[1] == alone
    assert other.result()[1] != alone            # the seed matters (10 tokens of 260)
    for h in crowd:
        h.result()
    _idle(engine)


def test_the_repetition_penalty_equals_generates(engine):
    prompt = _prompts(10, (6,))[0]
    request = decode.DecodeRequest(max_new_tokens=10, eos_id=None, repetition_penalty=1.8)
    ids = engine.submit(serve.Submission(tuple(prompt), request)).result()[1]
    assert ids == _alone(engine, prompt, 10, eos_id=None, repetition_penalty=1.8)
    _idle(engine)


def test_presence_and_frequency_penalties_are_openais_on_generated_tokens():
    """Greedy under OpenAI's penalties (logit - presence * [count > 0] - frequency * count,
    counting generated tokens only) against a loop over the full forward pass."""
    pre = _pretrained("decoder_only")
    engine = Engine(pre, **SIZES).start(warmup=False)
    prompt = _prompts(11, (4,))[0]
    request = decode.DecodeRequest(max_new_tokens=8, eos_id=None)
    got = engine.submit(serve.Submission(tuple(prompt), request, presence_penalty=1.5,
                                         frequency_penalty=0.7)).result()[1]
    plain = engine.submit(serve.Submission(tuple(prompt), request)).result()[1]
    engine.stop()
    tokens, want = list(prompt), []
    for _ in range(8):
        logits = np.asarray(pre.model.apply({"params": pre.params}, np.array([tokens])))[0, -1]
        counts = np.bincount(want, minlength=logits.size)
        want.append(int(np.argmax(logits - 1.5 * (counts > 0) - 0.7 * counts)))
        tokens.append(want[-1])
    assert got == want and got != plain


def test_an_end_id_and_a_stop_string_finish_with_stop(engine):
    prompt = _prompts(5, (7,))[0]
    greedy = _alone(engine, prompt, 12, eos_id=None)
    end = greedy[5]
    cut = greedy.index(end)                      # the first time it comes
    request = decode.DecodeRequest(max_new_tokens=12, eos_id=end)
    text, ids, last = engine.submit(serve.Submission(tuple(prompt), request)).result()
    assert (ids, last.finish_reason) == (greedy[:cut], "stop")
    assert last.usage.completion_tokens == cut   # the end token is not counted

    whole = engine.tokenizer.decode(greedy)
    stop = whole[4:6]
    request = decode.DecodeRequest(max_new_tokens=12, eos_id=None)
    text, ids, last = engine.submit(serve.Submission(tuple(prompt), request,
                                                     stop=(stop,))).result()
    assert (text, last.finish_reason) == (whole[:whole.index(stop)], "stop")
    _idle(engine)


def test_after_the_warm_up_no_request_waits_for_a_compile():
    """Every shape a request can need is compiled at start: decode steps of each page-table
    width, prompt chunks of each row bucket, the encoder of each arrival bucket and source
    width; then a mix of requests compiles nothing more."""
    from serve import step
    engine = Engine(_pretrained("encoder_decoder"), **{**SIZES, "max_slots": 3}).start()
    # page widths {1, 2, 4, 8, 16}; rows {1, 2, 3}; sources {16, 32, 64} x rows {1, 2, 3}
    assert engine.compiled_shapes == 5 * 2 + 3 + 9       # decode steps of 1 and 4 tokens
    compiled = step.run_step._cache_size(), step.admit_sources._cache_size()
    request = decode.DecodeRequest(max_new_tokens=14, eos_id=None)
    handles = [engine.submit(serve.Submission(tuple(p), request))
               for p in _prompts(8, (3, 17, 1, 9, 60, 33, 2))]
    for h in handles:
        h.result()
    assert (step.run_step._cache_size(), step.admit_sources._cache_size()) == compiled
    engine.stop()


def test_cancelled_and_stopped_requests_free_their_slots_and_pages():
    engine = Engine(_pretrained("decoder_only"), **SIZES).start(warmup=False)
    request = decode.DecodeRequest(max_new_tokens=30, eos_id=None)
    handles = [engine.submit(serve.Submission(tuple(p), request))
               for p in _prompts(6, (5, 9, 3, 4, 6))]
    next(iter(handles[0].events()))
    handles[0].cancel()
    handles[4].cancel()                          # still waiting for a slot, maybe
    assert handles[0].result()[2].finish_reason == "cancelled"
    assert handles[4].result()[2].finish_reason == "cancelled"
    done = threading.Event()
    threading.Thread(target=lambda: (engine.stop(drain=True), done.set())).start()
    for h in handles[1:4]:                       # drained: each finishes its 30 tokens
        assert h.result()[2].finish_reason == "length"
    assert done.wait(60)
    with pytest.raises(serve.EngineStopped):
        engine.submit(serve.Submission((5, 6), request))
    _idle(engine)


def test_an_error_in_the_loop_ends_every_request_with_it_and_refuses_new_ones(monkeypatch):
    engine = Engine(_pretrained("decoder_only"), **SIZES)
    submitted = threading.Event()

    def broken(rows):              # fails once every request is in (running or waiting)
        submitted.wait(timeout=60)
        raise RuntimeError("a bug in the step")
    monkeypatch.setattr(engine, "_decode", broken)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)   # the thread's report
    engine.start(warmup=False)
    request = decode.DecodeRequest(max_new_tokens=4)
    handles = [engine.submit(serve.Submission((5, 6), request)) for _ in range(6)]
    submitted.set()
    for h in handles:                            # running or waiting: each hears of it
        last = h.result()[2]
        assert (last.finish_reason, last.error) == ("error", "RuntimeError: a bug in the step")
    with pytest.raises(serve.EngineStopped, match="stopped after an error: RuntimeError"):
        engine.submit(serve.Submission((5,), request))


def test_a_full_queue_refuses_with_queue_full():
    engine = Engine(_pretrained("decoder_only"), **{**SIZES, "max_queue": 2})  # not started
    request = decode.DecodeRequest(max_new_tokens=4)
    engine.submit(serve.Submission((5,), request))
    engine.submit(serve.Submission((6,), request))
    with pytest.raises(serve.QueueFull, match="2 requests are waiting"):
        engine.submit(serve.Submission((7,), request))


def test_a_forced_first_token_is_generates_first_token_then_the_same_tokens():
    """A translation model's target language: `forced_bos_id` is the first of
    max_new_tokens, fed after the start token; the tokens after it are generate's, and a
    request without it in the same batch is unchanged."""
    engine = Engine(_pretrained("encoder_decoder"), **SIZES).start(warmup=False)
    try:
        prompts = _prompts(12, (7, 12, 3))
        forced = decode.DecodeRequest(max_new_tokens=9, eos_id=None, forced_bos_id=200)
        plain = forced.replace(forced_bos_id=None)
        handles = [engine.submit(serve.Submission(tuple(p), r))
                   for p in prompts for r in (forced, plain)]
        for i, prompt in enumerate(prompts):
            want = _alone(engine, prompt, 9, eos_id=None, forced_bos_id=200)
            assert want[0] == 200
            assert handles[2 * i].result()[1] == want[1:]
            unforced = handles[2 * i + 1].result()[1]
            assert unforced == _alone(engine, prompt, 9, eos_id=None)
            assert want[1:] != unforced[:8]                      # the forced token matters
        _idle(engine)
    finally:
        engine.stop(drain=False)


@pytest.mark.parametrize("submission, message", [
    (dict(ids=(5,) * 60, request=decode.DecodeRequest(max_new_tokens=8)),
     "the prompt is 60 tokens; the model takes at most 56"),
    (dict(ids=(), request=decode.DecodeRequest(max_new_tokens=8)), "the prompt is empty"),
    (dict(ids=(5, 999), request=decode.DecodeRequest(max_new_tokens=8)),
     "token id 999 is outside the vocabulary"),
    (dict(ids=(5,), request=decode.DecodeRequest(strategy="beam")), "beam search"),
    (dict(ids=(5,), request=decode.DecodeRequest(max_new_tokens=8, banned_ids=(3,))),
     r"banned_ids=\(3,\): the engine bans the same ids for every request, \(\)"),
    (dict(ids=(5,), request=decode.DecodeRequest(max_new_tokens=8, min_new_tokens=2)),
     "min_new_tokens=2"),
    (dict(ids=(5,), request=decode.DecodeRequest(max_new_tokens=8, forced_bos_id=7)),
     "forced_bos_id=7: the engine forces a first token for a text encoder-decoder"),
    (dict(ids=(5,), presence_penalty=3.0), r"presence_penalty=3.0 is outside \[-2.0, 2.0\]"),
    (dict(ids=(5,), stop=("",)), "each stop must be a non-empty string"),
    (dict(ids=(5,), seed=-1), r"seed=-1 must be in \[0, 2\*\*32\)"),
])
def test_what_the_engine_cannot_decode_is_refused_by_name(submission, message):
    engine = Engine(_pretrained("decoder_only"), **SIZES)
    submission = {"request": decode.DecodeRequest(max_new_tokens=8), **submission}
    with pytest.raises(UserError, match=message):
        engine.submit(serve.Submission(**submission))


def test_engine_sizes_are_checked_by_name():
    pre = _pretrained("decoder_only")
    with pytest.raises(UserError, match="max_slots"):
        Engine(pre, max_slots=0)
    with pytest.raises(UserError, match="max_tokens_per_step=2 must be at least max_slots=4"):
        Engine(pre, max_slots=4, max_tokens_per_step=2)
    with pytest.raises(UserError, match="positions need 4 pages; the pool has 2"):
        Engine(pre, page_size=16, num_pages=2).submit(
            serve.Submission((5,) * 50, decode.DecodeRequest(max_new_tokens=10)))


class _Bytes:
    """A tokenizer whose ids are characters: 0 'a', 1 'b', ..., 9 a lone UTF-8 lead byte."""

    def decode(self, ids):
        raw = b"".join(b"\xc3" if i == 9 else bytes([97 + i]) for i in ids)
        return raw.decode("utf-8", errors="replace")


def test_the_detokenizer_holds_back_partial_characters_and_stop_string_starts():
    d = Detokenizer(_Bytes(), stops=("cd",))
    assert d.add(0) == ("a", False)
    assert d.add(2) == ("", False)               # "c" may start "cd"
    assert d.add(1) == ("cb", False)             # it did not
    assert d.add(9) == ("", False)               # half of a character
    assert d.add(2) == ("\ufffd", False)         # ... which never completes; "c" held again
    assert d.add(3) == ("", True)                # "cd": the text stops before it
    assert d.text == "acb\ufffd"
    d = Detokenizer(_Bytes(), stops=("zz",))
    assert (d.add(0), d.add(25)) == (("a", False), ("", False))
    assert (d.flush(), d.text) == ("z", "az")   # the request ended: the held "z" goes out


def _whisper(suppress=(), begin_suppress=()) -> Pretrained:
    """A tiny random Whisper (4 mel bins, a 12-frame window) whose generation config
    suppresses tokens as checkpoints do."""
    cfg = models.get_config("whisper-tiny", vocab_size=64, d_model=32, num_heads=4,
                            mlp_dim=48, num_encoder_layers=1, num_decoder_layers=1,
                            max_len=32, pad_id=0, eos_id=1, bos_id=2,
                            audio=dict(num_mel_bins=4, max_source_positions=6))
    model = models.build(cfg)
    params = model.init(jax.random.key(4), np.zeros((1, 4, 12), np.float32),
                        np.zeros((1, 3), np.int32))["params"]
    raw = dict(decoder_start_token_id=2, eos_token_id=1, suppress_tokens=list(suppress),
               begin_suppress_tokens=list(begin_suppress), forced_decoder_ids=[[1, 5]],
               max_length=20)
    return Pretrained(model=model, config=cfg, params=params, tokenizer=None,
                      generation=GenerationDefaults(raw=raw), model_type="whisper")


def _transcribed(pre, features) -> list[list[int]]:
    from decode.whisper import transcribe
    out = transcribe(pre, features, max_new_tokens=12)
    return [[t for t in row[:n] if t != 1] for row, n in zip(
        out.tokens.tolist(), out.lengths.tolist(), strict=True)]


def test_whisper_requests_equal_transcribe_alone_with_its_suppressed_tokens():
    features = np.random.default_rng(0).normal(size=(5, 4, 12)).astype(np.float32)
    free = _transcribed(_whisper(), features)
    # Suppress what the model likes best, so the bans change what it says.
    favourite = max(set(sum(free, [])), key=sum(free, []).count)
    pre = _whisper(suppress=(favourite,), begin_suppress=(free[0][0],))
    engine = Engine(pre, max_slots=2, page_size=4, num_pages=8, max_tokens_per_step=8,
                    prefill_chunk=4).start(warmup=False)
    assert engine.banned_ids == (favourite,)
    prompt = (2, 5)                       # the start token and the forced one, as transcribe's
    request = decode.DecodeRequest(max_new_tokens=12, eos_id=1)
    handles = [engine.submit(serve.Submission(prompt, request, features=f)) for f in features]
    got = [h.result() for h in handles]
    engine.stop()
    want = _transcribed(pre, features)
    assert want != free
    assert [ids for _, ids, _ in got] == want
    assert {last.usage.prompt_tokens for _, _, last in got} == {2}
    _idle(engine)


@pytest.mark.parametrize("family", ["decoder_only", "encoder_decoder"])
def test_parameters_split_over_a_tensor_axis_of_4_devices_give_one_devices_tokens(family):
    """The pool is split by kv heads like the parameters (each device holds K / 4 of every
    page), and the tokens and log-probs are the unsplit engine's."""
    from decode.placement import cache_sharding
    from models.axes import param_shardings
    from train.sharding import make_mesh
    cfg = models.TransformerConfig(architecture=family, vocab_size=64, d_model=32,
                                   num_heads=8, num_kv_heads=4, mlp_dim=48, num_layers=1,
                                   num_encoder_layers=1, num_decoder_layers=1, max_len=32)
    model = models.build(cfg)
    z = np.zeros((1, 4), np.int32)
    params = model.init(jax.random.key(5), *((z,) if family == "decoder_only" else (z, z)))
    pre = Pretrained(model=model, config=cfg, params=params["params"], tokenizer=None,
                     generation=GenerationDefaults(), model_type=family)
    sharded = jax.device_put(pre.params, param_shardings(model, make_mesh((1, 1, 4))))
    prompts = _prompts(7, (5, 12, 3))
    prompts = [[t % 64 for t in p] for p in prompts]
    request = decode.DecodeRequest(max_new_tokens=8, eos_id=None)
    sizes = dict(max_slots=2, page_size=4, num_pages=8, max_tokens_per_step=8,
                 prefill_chunk=4)
    results = []
    for p in (pre.params, sharded):
        engine = Engine(dataclasses.replace(pre, params=p), **sizes).start(warmup=False)
        handles = [engine.submit(serve.Submission(tuple(x), request)) for x in prompts]
        results.append([h.result() for h in handles])
        pool = engine._state.cache.k[0]
        engine.stop()
    assert cache_sharding(sharded) is not None
    assert pool.sharding.shard_shape(pool.shape)[1] == cfg.num_kv_heads // 4
    for (_, ids_one, one), (_, ids_four, four) in zip(*results, strict=True):
        assert ids_four == ids_one
        np.testing.assert_allclose(four.logprobs, one.logprobs, atol=1e-5)


def test_a_stream_whose_event_loop_closed_is_cancelled_not_the_engine():
    """A consumer's asyncio loop that closes mid-stream (a server shutting down) cancels
    its request; the engine goes on serving the others."""
    import asyncio
    engine = Engine(_pretrained("decoder_only"), **SIZES).start(warmup=False)
    request = decode.DecodeRequest(max_new_tokens=30, eos_id=None)
    handle = engine.submit(serve.Submission((5, 6, 7), request))

    async def first_event():
        async for event in handle.stream():
            return event
    loop = asyncio.new_event_loop()
    assert loop.run_until_complete(first_event()).token_ids
    loop.close()
    other = engine.submit(serve.Submission((8, 9), request)).result()[2]
    assert other.finish_reason == "length" and engine.failure is None
    engine.stop()
    _idle(engine)


def test_an_idle_slot_in_a_step_over_every_slot_keeps_what_its_request_has_seen():
    """A step over every slot (`all_slots`, as the engine's multi-token steps run) feeds
    some slots and leaves others idle (a padding row: no tokens, position 0 as the host
    leaves it). An idle slot keeps its tokens seen (the repetition penalty), its counts
    (OpenAI's penalties) and its linear layers' states, so its request goes on where it
    stopped; a real row at position 0 starts from none of them."""
    from serve import step as device
    cfg = models.get_config("qwen3-next-tiny", vocab_size=64, max_len=16)
    model = models.build(cfg)
    params = model.init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"]
    _, banned = device.Banned.for_model(Pretrained(
        model=model, config=cfg, params=params, tokenizer=None,
        generation=GenerationDefaults(), model_type="qwen3_next"))
    state = device.create_state(cfg, slots=2, num_pages=8, page_size=4, pages_per_slot=4,
                                source_len=None)

    def rows(fed: dict, T: int):
        r = device.StepRows.padding(2, T, 4, slots=2, num_pages=8)
        for i, (slot, tokens, length) in enumerate(fed.values()):
            r.set(i, slots=slot, n_new=len(tokens), lengths=length, generated_from=0,
                  generated=length, repetition_penalty=1.5, presence=0.5)
            r.tokens[i, :len(tokens)] = tokens
            r.page_table[i] = [4 * slot + m for m in range(4)]
        return r
    # Slot 1's prompt, then slot 0's first token over every slot, slot 1 idle.
    _, _, state = device.run_step(model, params, state, rows({1: (1, [5, 6, 7], 0)}, 3),
                                  banned)
    before = jax.device_get(state)
    assert before.seen[1, [5, 6, 7]].all() and before.counts[1].sum() == 3
    all_slots = device.StepRows.padding(2, 1, 4, slots=2, num_pages=8)
    all_slots.ints[device.INTS.index("slots")] = [0, 1]
    all_slots.set(0, n_new=1, repetition_penalty=1.5)
    all_slots.tokens[0, 0] = 9
    all_slots.page_table[:] = [[0, 1, 2, 3], [4, 5, 6, 7]]
    _, _, state = device.run_step(model, params, state, all_slots, banned, all_slots=True)
    after = jax.device_get(state)
    np.testing.assert_array_equal(after.seen[1], before.seen[1])
    np.testing.assert_array_equal(after.counts[1], before.counts[1])
    for was, now in zip(before.cache.linear, after.cache.linear, strict=True):
        if was is not None:
            np.testing.assert_array_equal(now.recurrent[1], was.recurrent[1])
            np.testing.assert_array_equal(now.window[1], was.window[1])
            assert np.abs(now.recurrent[0]).max() > 0          # slot 0 was fed
    assert after.seen[0, 9] and not after.seen[0, [5, 6, 7]].any()
