"""`python -m decode --chat`: each input is a user's message, rendered in the model
directory's chat template with the generation prompt (`models.chat`, as transformers'
`apply_chat_template(..., add_generation_prompt=True)` renders it), so the model answers
as an assistant; decoding also stops at the template's end of turn (ChatML's <|im_end|>,
Llama 3's <|eot_id|>) besides the directory's end tokens.

    python -m decode --model runs/chat/model --chat "What is the capital of France?"
"""

from __future__ import annotations

import dataclasses

from models.chat import ChatTemplate
from models.errors import UserError


def add_flag(p) -> None:
    p.add_argument("--chat", action="store_true",
                   help="each input is a user's message in the model's chat template; the "
                        "model answers as the assistant")


def check_flags(args) -> None:
    """Raises `UserError` for --chat with a flag that reads no text as a generative model
    does (--audio, --fill-mask, --classify)."""
    for flag in ("audio", "fill_mask", "classify"):
        if args.chat and getattr(args, flag):
            raise UserError(f"--chat renders text for a generative model; --"
                            f"{flag.replace('_', '-')} reads no chat")


def setup(args, tok, gen):
    """(the texts' encoder, the decoding defaults with the end of turn as an end token)
    for `--chat`; (None, `gen`) without it.

    Raises:
        UserError: --chat for a model directory without a chat template or a Hugging Face
            tokenizer.
    """
    if not args.chat:
        return None, gen
    template = ChatTemplate.from_directory(args.model) if args.model else None
    if template is None or tok is None or not hasattr(tok, "hf"):
        raise UserError(f"--chat: {args.model or 'the model'} has no chat template "
                        "(chat_template.jinja or tokenizer_config.json's chat_template) "
                        "with a Hugging Face tokenizer")

    def encode(texts):
        return [None if not text.strip() else tok.encode(template.render(
            [{"role": "user", "content": text}], add_generation_prompt=True))
            for text in texts]

    turn_end = end_of_turn(template, tok)
    if turn_end is not None and gen.eos_ids is not None and turn_end not in gen.eos_ids:
        gen = dataclasses.replace(gen, eos_ids=(*gen.eos_ids, turn_end))
    elif turn_end is not None and gen.eos_ids is None:
        gen = dataclasses.replace(gen, eos_ids=(turn_end,))
    return encode, gen


def end_of_turn(template: ChatTemplate, tok) -> int | None:
    """The first special token the template writes after an assistant's words (None when
    it writes none)."""
    ids, flags = template.encode(tok, [{"role": "user", "content": "x"},
                                       {"role": "assistant", "content": "y"}])
    special = set(tok.special_ids) | set(tok.hf.added_tokens_decoder)
    return next((i for i, f in zip(ids, flags, strict=True) if f and i in special), None)
