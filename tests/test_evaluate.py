"""Evaluation on known outputs: scores by hand, translations of hand-built models, loss sums.

Two encoder-decoder models are built by setting their weights, so what they decode is known
without running them:

* `copy_model`: cross-attention reads source position t at decoder position t, so it
  copies its source, EOS included: `translate` must return each (truncated) source.
* `trap_model`: the next token depends only on the previous one (a Markov chain written
  into the weights) so that greedy, beam search and the length penalty give three different,
  hand-computed answers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu

import models
from decode import DecodeRequest
from tests.helpers import tiny
from tests.train_helpers import next_token_steps, tiny_train_config
from train import evaluate, parallel
from train.data import BOS_ID, EOS_ID, ByteTokenizer, Dataset, load_dataset
from train.model_config import ModelChoice

TOK = ByteTokenizer()


def _ids(text: str) -> list[int]:
    return TOK.encode(text)


def _zero_params(model):
    """Zeros in the model's parameter shapes (numpy, writable), every norm scale 1."""
    shapes = jax.eval_shape(lambda: model.init(
        jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32)))
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes["params"])
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if path[-1].key == "scale":
            leaf[...] = 1.0
    return params


# ------------------------------------------------------------------------------------------
# The copy model.


@functools.cache
def copy_model():
    """An encoder-decoder that copies its source: decoder position t emits source token t.

    D = V + P: dims [0, V) one-hot tokens, dims [V, V + P) one-hot positions (learned
    position tables set to them). Every self-attention and MLP writes zero, so the encoder
    output is rmsnorm(e_token + e_position). In the decoder's cross-attention the query and
    key read only the position dims (scores 5 * 146 / sqrt(292) ~ 43 at the same position,
    0 elsewhere: one-hot attention) and the value only the token dims, so decoder position
    t adds ~12 * e_{source token t} to its residual e_{previous token} + e_t. The tied
    output projection reads the token dims: logit ~17 for the source token, ~1.4 for the
    previous one, 0 for the rest, i.e. p(copy) > 0.9999 at every step.
    """
    V, P = TOK.vocab_size, 32
    D = V + P
    cfg = tiny("encoder_decoder", vocab_size=V, d_model=D, num_heads=1, mlp_dim=4,
               num_encoder_layers=1, num_decoder_layers=1, max_len=P, positions="learned",
               norm="rmsnorm", use_bias=False)
    model = models.build(cfg)
    p = _zero_params(model)
    tok_D, pos_D = np.arange(V), V + np.arange(P)
    p["src_tokens"]["embedding"][tok_D, tok_D] = 1.0          # shared with the target, tied
    for side in ("src_embed", "tgt_embed"):
        p[side]["positions"]["embedding"][np.arange(P), pos_D] = 1.0
    cross = p["decoder"]["layer_0"]["cross_attention"]
    cross["query"]["kernel"][pos_D, 0, pos_D] = 5.0
    p["cross_kv"]["key_kernel"][0, pos_D, 0, pos_D] = 1.0
    p["cross_kv"]["value_kernel"][0, tok_D, 0, tok_D] = 1.0
    cross["out"]["kernel"][0, tok_D, tok_D] = 1.0
    return model, p


# Source 3 is max_source_length - 1 = 7 bytes (kept whole); 4 and 5 are longer (cut to 7 and
# EOS). With batch_size 4 the second batch holds one source and three padding rows.
SOURCES = ["hello", "", "abcdefg", "abcdefgh", "qrstuvwxyz"]
COPIES = ["hello", "", "abcdefg", "abcdefg", "qrstuvw"]


@pytest.mark.parametrize("beam_size", [1, 2])
def test_translate_copies_each_source_in_order_across_a_partial_last_batch(beam_size):
    model, params = copy_model()
    got = evaluate.translate(model, params, TOK, SOURCES, max_source_length=8,
                             max_new_tokens=8, beam_size=beam_size, batch_size=4)
    # Exactly one output per source, in input order; padding rows add nothing; a source
    # longer than max_source_length keeps its first max_source_length - 1 tokens and EOS
    # (the copy of EOS is what ends each output).
    assert got == COPIES


def test_translate_cuts_sources_in_tokens_not_characters():
    model, params = copy_model()
    # "é" is two bytes: a cut between them leaves the first, which decodes as U+FFFD.
    got = evaluate.translate(model, params, TOK, ["abcdefé", "abcdeé"], max_source_length=8,
                             max_new_tokens=8, batch_size=4)
    assert got == ["abcdef\ufffd", "abcdeé"]


# ------------------------------------------------------------------------------------------
# The trap model: greedy, beam search and the length penalty disagree.

# next-token probabilities after each token; every token not listed ends (-> EOS).
_A, _B, _C, _D, _E, _F, _G, _H, _I = (_ids(c)[0] for c in "abcdefghi")
CHAIN = {
    BOS_ID: {_A: 0.52, _B: 0.48},
    _A: {_C: 0.28, _D: 0.24, _H: 0.24, _I: 0.24},
    _B: {EOS_ID: 0.6, _E: 0.4},
    _E: {_F: 1.0},
    _F: {_G: 1.0},
}
# Hand computation (length counts EOS; GNMT score = log p / ((5 + length) / 6) ** alpha):
#   greedy: a (.52), then c (.28)                  -> "ac"    p = .1456, length 3
#   beam 2 keeps a and b; after step 2 the best two are b EOS (.288) and b e (.192) > a c:
#     "b"     log p = -1.245, length 2
#     "befg"  log p = -1.650, length 5
#     "ac"    log p = -1.927, length 3
#   alpha 0:   "b" -1.245 > "befg" -1.650 > "ac"
#   alpha 0.6: "b" -1.135 > "befg" -1.214
#   alpha 2:   "befg" -0.594 > "b" -0.915 > "ac" -1.084
TRAP_GREEDY = "ac"
TRAP_BEAM = {0.0: "b", 0.6: "b", 2.0: "befg"}
TRAP_LENGTHS = dict(max_source_length=8, max_decode_length=6)


@functools.cache
def trap_model():
    """An encoder-decoder whose logits are log CHAIN[previous token] (else -30).

    Attention and MLPs write zero, so the decoder's last residual is its input embedding.
    The (untied) target embedding maps each previous token to a one-hot state e_s in D = 8
    dims; the final rmsnorm, with scale 1/sqrt(D), leaves e_s as it is; the untied head's
    row s holds the state's next-token log-probabilities. The source is ignored.
    """
    V, D = TOK.vocab_size, 8
    cfg = tiny("encoder_decoder", vocab_size=V, d_model=D, num_heads=1, mlp_dim=4,
               num_encoder_layers=1, num_decoder_layers=1, max_len=16, positions="rope",
               norm="rmsnorm", use_bias=False, share_embeddings=False, tie_embeddings=False)
    model = models.build(cfg)
    p = _zero_params(model)
    p["decoder"]["final_norm"]["scale"][:] = D ** -0.5
    state = {prev: s for s, prev in enumerate(CHAIN)}
    end = len(CHAIN)                                        # every other token: -> EOS
    head_DV = np.full((D, V), -30.0, np.float32)
    for s, following in enumerate([*CHAIN.values(), {EOS_ID: 1.0}]):
        for token, prob in following.items():
            head_DV[s, token] = math.log(prob)
    p["head"]["kernel"][...] = head_DV
    states_V = np.array([state.get(v, end) for v in range(V)])
    p["tgt_tokens"]["embedding"][np.arange(V), states_V] = 1.0
    return model, p


def test_translate_beam_search_and_its_length_penalty_beat_greedy():
    model, params = trap_model()
    args = dict(max_source_length=TRAP_LENGTHS["max_source_length"],
                max_new_tokens=TRAP_LENGTHS["max_decode_length"])
    sources = ["x", "yy", "zzz"]
    assert evaluate.translate(model, params, TOK, sources, **args) == [TRAP_GREEDY] * 3
    for alpha, best in TRAP_BEAM.items():
        got = evaluate.translate(model, params, TOK, sources, beam_size=2,
                                 length_penalty=alpha, **args)
        assert got == [best] * 3, alpha


# ------------------------------------------------------------------------------------------
# scores: hand-computed exact match and BLEU.


def test_exact_match_compares_whitespace_stripped_strings():
    hyps = ["a b", " c ", "d", "e f"]
    refs = ["a b", "c", "e", "e  f"]                  # inner whitespace still counts
    assert evaluate.scores(hyps, refs, "exact_match") == {"exact_match": 0.5}
    with pytest.raises(ValueError):                   # one hypothesis per reference
        evaluate.scores(hyps[:3], refs, "exact_match")


def test_bleu_is_corpus_bleu_by_hand():
    # One sentence, equal lengths (brevity penalty 1): n-gram precisions 5/6, 3/5, 2/4, 1/3.
    hyp, ref = "the cat sat on the mat", "the cat sat on a mat"
    one = evaluate.scores([hyp], [ref], "bleu")["bleu"]
    assert one == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, abs=1e-6)
    # Corpus BLEU pools n-gram counts over sentences (not a mean of sentence BLEUs): with
    # "a b c d" (4/4, 3/3, 2/2, 1/1) added the precisions are 9/10, 6/8, 4/6, 2/4.
    two = evaluate.scores([hyp, "a b c d"], [ref, "a b c d"], "bleu")["bleu"]
    assert two == pytest.approx(100 * (9 / 10 * 6 / 8 * 4 / 6 * 2 / 4) ** 0.25, abs=1e-6)
    same = ["the cat sat on the mat", "a b c d"]
    assert evaluate.scores(same, same, "bleu")["bleu"] == pytest.approx(100.0)
    assert evaluate.scores(["p q r s"], ["w x y z"], "bleu")["bleu"] == 0.0


def test_metric_names_select_scores():
    hyps, refs = ["the cat sat on the mat", "x"], ["the cat sat on a mat", "x"]
    em = evaluate.scores(hyps, refs, "exact_match")
    bleu = evaluate.scores(hyps, refs, "bleu")
    assert set(em) == {"exact_match"} and set(bleu) == {"bleu"}
    assert evaluate.scores(hyps, refs, "both") == {**em, **bleu}
    assert em["exact_match"] == 0.5
    assert bleu["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)


# ------------------------------------------------------------------------------------------
# decoded_metrics on a real dataset and on a small in-memory one.


def test_decoded_metrics_of_the_copy_model_on_the_copy_task(data_dir):
    model, params = copy_model()
    ds = load_dataset("copy", data_dir)
    config = tiny_train_config(data_dir, max_source_length=11, max_decode_length=12,
                               metric="both")
    got, triples = evaluate.decoded_metrics(model, params, TOK, ds, split="validation", n=40,
                                            request=_greedy(config), **_scoring(config))
    pairs = ds.examples("validation", range(40))
    # Sources longer than 10 bytes are cut to 10 (and EOS); the copy model copies the rest.
    assert triples == [(s, t, s[:10]) for s, t in pairs]
    short = np.mean([len(t) <= 10 for _, t in pairs])
    assert 0 < short < 1                              # both kinds are in the sample
    assert got["exact_match"] == short
    # (BLEU here is 0 whatever the outputs: each example is a single word, with no 4-grams.)
    assert got == evaluate.scores([s[:10] for s, _ in pairs], [t for _, t in pairs], "both")


def _greedy(config) -> DecodeRequest:
    """Evaluation's greedy request for a model trained from scratch."""
    return evaluate.decode_request(config, ModelChoice(None), beam=False)


def _scoring(config) -> dict:
    return {"metric": config.metric, "max_source_length": config.max_source_length}


class _Records:
    """A random-access source like `tfds.data_source`: len, [i], and batched reads."""

    def __init__(self, pairs):
        self.records = [{"inputs": s.encode(), "targets": t.encode()} for s, t in pairs]

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]

    def __getitems__(self, indices):
        return [self.records[i] for i in indices]


def _in_memory(pairs) -> Dataset:
    return Dataset("in_memory", "translation", {"validation": _Records(pairs)},
                   ("inputs", "targets"))


def test_decoded_metrics_pairs_sources_references_and_hypotheses_and_clips_n():
    model, params = copy_model()
    pairs = [("abc", "abc"), ("hello", "hellp"), ("qq", "qq"), ("zyx", "xyz"), ("", "")]
    config = tiny_train_config("", max_source_length=11, max_decode_length=12, metric="both")
    got, triples = evaluate.decoded_metrics(model, params, TOK, _in_memory(pairs),
                                            split="validation", n=100,
                                            request=_greedy(config), **_scoring(config))
    assert triples == [(s, t, s) for s, t in pairs]   # n = 100 is clipped to all 5
    assert got["exact_match"] == 3 / 5
    assert got["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu([s for s, _ in pairs], [[t for _, t in pairs]]).score)
    got2, triples2 = evaluate.decoded_metrics(model, params, TOK, _in_memory(pairs),
                                              split="validation", n=2,
                                              request=_greedy(config), **_scoring(config))
    assert triples2 == triples[:2] and got2["exact_match"] == 1 / 2


def test_decoded_metrics_decodes_with_the_beam_size_and_length_penalty_given():
    model, params = trap_model()
    pairs = [("x", "befg"), ("y", "b"), ("z", "ac"), ("w", "befg")]
    config = tiny_train_config("", metric="exact_match", **TRAP_LENGTHS)
    for beam_size, alpha, hyp, em in ((1, 2.0, TRAP_GREEDY, 1 / 4), (2, 2.0, "befg", 2 / 4),
                                      (2, 0.0, "b", 1 / 4)):
        config.length_penalty, config.beam_size = alpha, beam_size
        request = evaluate.decode_request(config, ModelChoice(None), beam=True)
        got, triples = evaluate.decoded_metrics(model, params, TOK, _in_memory(pairs),
                                                split="validation", n=4,
                                                request=request, **_scoring(config))
        assert [h for _, _, h in triples] == [hyp] * 4, (beam_size, alpha)
        assert got == {"exact_match": em}


# ------------------------------------------------------------------------------------------
# loss_metrics: sums over batches and devices, against a reference written here.

R, B, W = 4, 2, 10          # fake devices (conftest), rows per device, row width


@functools.cache
def loss_setup():
    cfg = tiny("encoder_decoder", max_len=W, use_bias=False, num_encoder_layers=1,
               num_decoder_layers=1)
    model = models.build(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, W), jnp.int32),
                                 jnp.zeros((1, W), jnp.int32))["params"]
    train_fn, eval_fn = next_token_steps(model, tiny_train_config(""))[0].functions()
    dp = parallel.DataParallel("pmap", train_fn, eval_fn)
    return model, params, dp


def _batch(seed: int, rows_per_device: int = B) -> dict:
    """Right-padded rows of one source/target pair each, [R, B, W] (eval_batches' layout)."""
    r = np.random.default_rng(seed)
    n = R * rows_per_device
    out = {}
    for side in ("inputs", "targets"):
        lengths = r.integers(1, W + 1, n)
        valid = np.arange(W)[None, :] < lengths[:, None]
        out[side] = np.where(valid, r.integers(4, 61, (n, W)), 0).astype(np.int32)
        out[f"{side}_segmentation"] = valid.astype(np.int32)
        out[f"{side}_position"] = np.where(valid, np.arange(W)[None, :], 0).astype(np.int32)
    out["example_index"] = np.arange(n, dtype=np.int32) + 100 * seed
    return {k: v.reshape(R, rows_per_device, *v.shape[1:]) for k, v in out.items()}


def _padding_batch() -> dict:
    """All-empty rows, as eval_batches pads its last batches: example_index -1."""
    pad = jax.tree.map(np.zeros_like, _batch(0))
    pad["example_index"][...] = -1
    return pad


def _reference(model, params, batches) -> dict:
    """Token-mean NLL and accuracy of the teacher-forced forward pass, every row alone."""
    rows = {k: np.concatenate([b[k].reshape(-1, W) for b in batches])
            for k in ("inputs", "targets", "inputs_segmentation", "targets_segmentation")}
    tgt, valid = rows["targets"], rows["targets_segmentation"] > 0
    dec_in = np.where(valid, np.concatenate(
        [np.full((len(tgt), 1), BOS_ID), tgt[:, :-1]], axis=1), 0)
    logits = np.asarray(model.apply(
        {"params": params}, rows["inputs"], dec_in, src_segment_ids=rows["inputs_segmentation"],
        tgt_segment_ids=rows["targets_segmentation"]), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, tgt[..., None], -1)[..., 0]
    correct = logits.argmax(-1) == tgt
    return {"nll": nll[valid].mean(), "accuracy": correct[valid].mean(), "tokens": valid.sum()}


def test_loss_metrics_are_token_means_over_all_batches_and_devices():
    model, params, dp = loss_setup()
    batches = [_batch(1), _batch(2), _padding_batch()]
    got = evaluate.loss_metrics(dp, dp.put_state(params), batches)
    ref = _reference(model, params, batches)
    assert got["tokens"] == ref["tokens"]
    np.testing.assert_allclose(got["nll"], ref["nll"], rtol=1e-5)
    np.testing.assert_allclose(got["loss"], ref["nll"], rtol=1e-5)    # no smoothing, z_loss 0
    np.testing.assert_allclose(got["perplexity"], np.exp(ref["nll"]), rtol=1e-5)
    assert got["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-9)


def test_loss_metrics_split_batches_equal_one_batch_and_padding_adds_nothing():
    _, params, dp = loss_setup()
    params = dp.put_state(params)
    b1, b2, pad = _batch(3), _batch(4), _padding_batch()
    joined = {k: np.concatenate([b1[k], b2[k]], axis=1) for k in b1}     # [R, 2B, W]
    split = evaluate.loss_metrics(dp, params, [b1, b2])
    one = evaluate.loss_metrics(dp, params, [joined])
    padded = evaluate.loss_metrics(dp, params, [pad, b1, pad, b2, pad])
    assert split["tokens"] == one["tokens"] == padded["tokens"]
    for k in ("loss", "nll", "accuracy", "perplexity"):
        # Summation order differs between one batch and two: float32 rounding only.
        np.testing.assert_allclose(one[k], split[k], rtol=1e-6)
        assert padded[k] == split[k], k                # adding exact zeros changes nothing
