"""decode.TextDecoder, the text service: exactly one output per input in order, the length
limit checked before anything is decoded, bucketed or fixed batch shapes, per-batch
requests; and `length_limit`."""

import functools

import jax
import numpy as np
import pytest

import decode
from decode import Batching, DecodeRequest, LengthLimit, TextDecoder, length_limit
from models.errors import UserError
from models.tokenizer import ByteTokenizer
from tests.helpers import fns, tiny

# Token ids as text (no tokenizer): 10 inputs, blank ones among them, of several lengths.
TEXTS = ["5 6 7", "", "9 10 11 12 13", "20", "   ", "8 8 8 8 8 8 8 8 8 8", "30 31", "",
         "40 41 42", "50"]
REQUEST = DecodeRequest(max_new_tokens=4, eos_id=None)


@functools.cache
def setup(arch="decoder_only", vocab_size=61):
    f = fns(tiny(arch, max_len=32, vocab_size=vocab_size))
    return f.model, f.init()


def alone(model, params, ids: list[int], request=REQUEST) -> list[int]:
    """One input decoded by itself, as `decode.run` gives it (padded to at most 28)."""
    width = min(decode.bucket_width(len(ids)), 28)
    out = decode.run(model, params, *decode.pad_prompts([ids], width=width), request)
    return np.asarray(out.tokens[0, :int(out.lengths[0])]).tolist()


def recorded_runs(monkeypatch) -> list:
    """(prompts shape, request) of every batch the service decodes."""
    calls, run = [], decode.text.run

    def recording(model, params, prompts, lengths, request, **kw):
        calls.append((prompts.shape, request))
        return run(model, params, prompts, lengths, request, **kw)

    monkeypatch.setattr(decode.text, "run", recording)
    return calls


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_one_output_per_input_in_order_each_as_decoded_alone(arch, monkeypatch):
    model, params = setup(arch)
    calls = recorded_runs(monkeypatch)
    service = TextDecoder(model, params, batching=Batching(size=3))
    got = service.decode(TEXTS, REQUEST)
    assert len(got) == len(TEXTS)
    for text, out in zip(TEXTS, got, strict=True):
        if not text.strip():
            assert out == ""                               # blank in, blank out
        else:
            want = alone(model, params, [int(t) for t in text.split()])
            assert out == " ".join(map(str, want)), text
    # 7 non-blank inputs in batches of 3, 3, 1, each padded to its bucket (8, 16, 8 wide).
    assert [shape for shape, _ in calls] == [(3, 8), (3, 16), (1, 8)]


def test_the_limit_is_checked_before_anything_is_decoded(monkeypatch):
    model, params = setup()
    calls = recorded_runs(monkeypatch)
    texts = ["5 6", " ".join(["7"] * 29), "8"]             # 29 > 32 - 4 new tokens
    with pytest.raises(UserError, match=r"^input 2 is 29 tokens long; the model takes at most 28 "
                                        r"\(max_len - max_new_tokens\)$"):
        TextDecoder(model, params).decode(texts, REQUEST)
    limit = LengthLimit(28, "max_len - max_new_tokens", advice="shorten it")
    with pytest.raises(UserError, match=r"at most 28 \(max_len - max_new_tokens\); shorten it$"):
        TextDecoder(model, params, limit=limit).decode(texts, REQUEST)
    assert calls == []                                     # nothing was decoded
    warnings = []
    cut = TextDecoder(model, params, limit=LengthLimit(28, overlong="cut"),
                      warn=warnings.append).decode(texts, REQUEST)
    assert warnings == ["input 2 cut from 29 to 28 tokens"]
    assert cut[1] == " ".join(map(str, alone(model, params, [7] * 28)))
    kept = TextDecoder(model, params, limit=LengthLimit(3, overlong="cut_keep_last"),
                       warn=warnings.append).decode(["5 6 7 9"], REQUEST)
    assert kept == [" ".join(map(str, alone(model, params, [5, 6, 9])))]   # cut, last kept
    assert len(warnings) == 1                              # silently
    decoded = len(calls)
    with pytest.raises(UserError, match=r"input 3: 'x y' is not a list of space-separated "
                                        r"token ids"):
        TextDecoder(model, params).decode(["5", "", "x y"], REQUEST)
    with pytest.raises(UserError, match=r"input 1: token id 61 is outside \[0, vocab_size=61\)"):
        TextDecoder(model, params).decode(["61"], REQUEST)
    assert len(calls) == decoded


def test_fixed_shape_batches_pad_rows_and_give_the_same_outputs(monkeypatch):
    model, params = setup("encoder_decoder")
    calls = recorded_runs(monkeypatch)
    bucketed = TextDecoder(model, params, batching=Batching(size=4)).decode(TEXTS, REQUEST)
    n = len(calls)
    fixed = TextDecoder(model, params, batching=Batching(size=4, width=12, pad_row=(1,)))
    assert fixed.decode(TEXTS, REQUEST) == bucketed
    assert [shape for shape, _ in calls[n:]] == [(4, 12), (4, 12)]   # 7 inputs, one shape
    with pytest.raises(UserError, match="pad_row fills batches to one shape: it needs a width"):
        Batching(size=4, pad_row=(1,))


def test_a_request_function_is_asked_for_each_batchs_longest_input(monkeypatch):
    model, params = setup()
    calls = recorded_runs(monkeypatch)
    asked = []

    def request_for(prompt_len: int) -> DecodeRequest:
        asked.append(prompt_len)
        return REQUEST.replace(max_new_tokens=prompt_len)

    service = TextDecoder(model, params, limit=LengthLimit(16), batching=Batching(size=3))
    got = service.decode(TEXTS, request_for)
    # First for the longest input of all (its mistakes before any decoding), then per batch.
    assert asked[0] == 10 and [r.max_new_tokens for _, r in calls] == [5, 10, 1]
    assert [len(out.split()) for out in got if out] == [5, 5, 5, 10, 10, 10, 1]
    with pytest.raises(UserError, match="a request function needs an explicit TextDecoder limit"):
        TextDecoder(model, params).decode(TEXTS, request_for)
    with pytest.raises(UserError, match="request must be a decode.DecodeRequest or a function"):
        service.decode(TEXTS, {"max_new_tokens": 4})


def test_text_in_and_out_with_a_tokenizer_and_rows_sampled_by_their_own_key():
    tok = ByteTokenizer().with_specials(add_bos=False, add_eos=True)
    model, params = setup("encoder_decoder", tok.vocab_size)
    sources = ["ab", "", "héllo"]
    service = TextDecoder(model, params, tok)
    got = service.decode(sources, REQUEST)
    for source, out in zip(sources, got, strict=True):
        ids = tok.encode(source, add_special_tokens=True) if source else None
        assert out == ("" if ids is None else tok.decode(alone(model, params, ids)))
    sample = REQUEST.replace(strategy="sample", temperature=1.5)
    a = service.decode(sources, sample, rng=jax.random.key(4))
    assert a == service.decode(sources, sample, rng=jax.random.key(4)) and a[1] == ""
    with pytest.raises(UserError, match="rng is required"):
        service.decode(sources, sample)


def test_length_limit_names_the_rule_and_refuses_what_leaves_no_room():
    deconly, encdec = tiny(max_len=128), tiny("encoder_decoder", max_len=64)
    assert length_limit(deconly, 8) == LengthLimit(120, "max_len - max_new_tokens")
    assert length_limit(deconly, max_length=20) == LengthLimit(19, "the directory's "
                                                                   "max_length - 1")
    assert length_limit(encdec, 63) == LengthLimit(64, "max_len")
    assert length_limit(encdec, max_length=20) == LengthLimit(64, "max_len")
    with pytest.raises(UserError, match=r"max new tokens 128 leaves no room for a prompt in the "
                                        r"model's max_len 128"):
        length_limit(deconly, 128)
    with pytest.raises(UserError, match=r"max new tokens 64 \+ the start token exceeds the "
                                        r"model's max_len 64"):
        length_limit(encdec, 64)
    with pytest.raises(UserError, match=r"the directory's max_length=129 exceeds the model's "
                                        r"max_len 128"):
        length_limit(deconly, max_length=129)
