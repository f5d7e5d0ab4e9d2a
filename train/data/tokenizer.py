"""Training the project's sentencepiece tokenizer on a dataset's text (offline, in memory)."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable

import sentencepiece as spm

from models.errors import UserError
from models.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, SentencePieceTokenizer

MIN_SENTENCEPIECE_VOCAB = 300   # 4 specials + 256 byte-fallback pieces + some characters


def train_sentencepiece(texts: Iterable[str], vocab_size: int, *,
                        model_type: str = "unigram", character_coverage: float = 1.0,
                        max_sentences: int = 1_000_000, seed_sentencepiece_size: int = 200_000,
                        mask: bool = False) -> SentencePieceTokenizer:
    """Trains a sentencepiece model in memory, with byte fallback and the fixed special ids.

    Args:
        texts: training sentences (both sides of a translation corpus for a shared vocabulary).
        vocab_size: pieces including the 4 specials and the 256 byte pieces; at least 300.
        max_sentences: sentences sampled for training (sentencepiece's input_sentence_size).
        mask: add masked LM's mask token, the piece "[MASK]" (kept whole in text).

    Raises:
        UserError: for a vocabulary below 300 or a corpus with no text.
    """
    if vocab_size < MIN_SENTENCEPIECE_VOCAB:
        raise UserError(f"sentencepiece vocab_size={vocab_size} is below "
                         f"{MIN_SENTENCEPIECE_VOCAB}: byte fallback alone needs 260 ids; use the "
                         "byte tokenizer for smaller vocabularies")
    texts = [t for t in texts if t]
    if not texts:
        raise UserError("cannot train a sentencepiece model on an empty corpus")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, character_coverage=character_coverage, byte_fallback=True,
        pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
        input_sentence_size=max_sentences, shuffle_input_sentence=True,
        seed_sentencepiece_size=seed_sentencepiece_size, hard_vocab_limit=False,
        num_threads=os.cpu_count() or 1, minloglevel=2,
        user_defined_symbols=[SentencePieceTokenizer.MASK_TOKEN] if mask else [])
    return SentencePieceTokenizer(model.getvalue())
