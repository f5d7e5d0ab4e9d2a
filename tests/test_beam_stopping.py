"""Beam search's stopping rule (`early_stopping`) against transformers' `generate(num_beams=4)`
on BART and Marian checkpoints saved with their published generation settings.

Each checkpoint is a tiny random one (`pretrained_helpers.decoding_ckpt`) whose end token's
logit bias is raised by 1 more, so that beams end early enough for the rules to disagree,
saved with a generation_config.json shaped like a published one, scaled to N_NEW new tokens:

    bart    facebook/bart-large-cnn: num_beams 4, length_penalty 2.0, early_stopping true,
            no_repeat_ngram_size 3, min_length 56 and max_length 142 (here 3 and N_NEW + 1),
            forced_bos_token_id 0, forced_eos_token_id 2
    marian  Helsinki-NLP/opus-mt-en-de: num_beams 4, max_length 512 (here N_NEW + 1),
            bad_words_ids [[pad]], forced_eos_token_id 0, the decoder starting from pad; no
            early_stopping (transformers' default, false)

On a ragged batch, all four beams of every source and their scores equal transformers':
with the file's rule (`DecodeRequest.from_generation`), then with each of the three rules
given to both. The file's rule gives other beams than the exact stop ("never", the
project's default) on 3 of the 4 sources of each, so beam search that ignored the field
would fail here.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import decode
import models
from tests import pretrained_helpers as ph
from tests.pretrained_helpers import N_NEW, hf_seq2seq_load, their_new_tokens, torch

seq2seq_ckpt, decoding_ckpt = ph.seq2seq_ckpt, ph.decoding_ckpt          # shared fixtures
highest_precision = ph.highest_precision

W = 4
PUBLISHED = {
    "bart": dict(num_beams=W, length_penalty=2.0, early_stopping=True, no_repeat_ngram_size=3,
                 min_length=3, max_length=N_NEW + 1, forced_bos_token_id=0,
                 forced_eos_token_id=2),
    "marian-shared": dict(num_beams=W, max_length=N_NEW + 1, bad_words_ids=[[65]],
                          forced_eos_token_id=0, decoder_start_token_id=65),
}
RULES = (True, False, "never")
EXTRA_END_BIAS = 1.0        # +0: every beam of every rule runs to the forced end here


def _with_published_settings(d, name: str, tmp_path) -> str:
    """The decoding checkpoint with its end token favoured more, saved with the published
    settings over its own generation config."""
    model = copy.deepcopy(d.model)
    with torch.no_grad():
        model.final_logits_bias[0, model.generation_config.eos_token_id] += EXTRA_END_BIAS
    model.generation_config.update(**PUBLISHED[name])
    path = str(tmp_path / name)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _theirs(model, d, **options) -> tuple[list, np.ndarray]:
    """transformers' W beams of each source (new tokens up to the end) and their scores,
    the rest of the settings from the checkpoint's generation_config.json."""
    mask = np.arange(d.src.shape[1])[None, :] < d.src_lens[:, None]
    with torch.no_grad():
        out = model.generate(input_ids=torch.as_tensor(d.src, dtype=torch.long),
                             attention_mask=torch.as_tensor(mask, dtype=torch.long),
                             num_return_sequences=W, output_scores=True,
                             return_dict_in_generate=True, **options)
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    seqs = out.sequences.numpy()
    beams = [[their_new_tokens(seqs[b * W + w], pad, eos).tolist() for w in range(W)]
             for b in range(len(d.src))]
    return beams, out.sequences_scores.numpy().reshape(-1, W)


def _ours(pre, d, request) -> tuple[list, np.ndarray]:
    out = decode.beam_search(pre.model, pre.params, d.src, d.src_lens, request)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    beams = [[tokens[b, w, :lengths[b, w]].tolist() for w in range(W)]
             for b in range(len(d.src))]
    return beams, np.asarray(out.scores)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_beam_search_equals_generate_under_the_files_rule_and_each_rule(
        name, decoding_ckpt, highest_precision, tmp_path):
    d = decoding_ckpt(name)
    path = _with_published_settings(d, name, tmp_path)
    pre, hf = models.load(path), hf_seq2seq_load(path)
    request = decode.DecodeRequest.from_generation(pre.generation, pre.config)
    file_rule = PUBLISHED[name].get("early_stopping", False)
    assert (request.strategy, request.beam_size, request.max_new_tokens) == ("beam", W, N_NEW)
    assert request.early_stopping is file_rule
    assert (d.src_lens < d.src.shape[1]).any()                                 # ragged

    results = {}
    for rule in (None, *RULES):                 # None: neither side is told; the file's rule
        ours = _ours(pre, d, request if rule is None else request.replace(early_stopping=rule))
        theirs = _theirs(hf, d, **({} if rule is None else {"early_stopping": rule}))
        assert ours[0] == theirs[0], f"early_stopping={rule!r}"
        np.testing.assert_allclose(ours[1], theirs[1], atol=1e-4, rtol=1e-5,
                                   err_msg=f"early_stopping={rule!r}")
        results[rule] = ours
    assert results[None][0] == results[file_rule][0]
    # The file's rule and the exact stop give different beams: a rule ignored fails above.
    differ = [b for b in range(len(d.src))
              if results[file_rule][0][b] != results["never"][0][b]]
    print(f"{name}: sources whose beams differ between early_stopping={file_rule!r} and "
          f"'never': {differ}; lengths {[len(s) for s in results[file_rule][0][0]]}")
    assert differ, "the rules agree here: the test cannot see a rule ignored"
