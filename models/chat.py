"""A model directory's chat template, rendered as transformers' `apply_chat_template` does.

    template = ChatTemplate.from_directory("path/to/Qwen2.5-0.5B-Instruct")   # None: none
    text = template.render([{"role": "user", "content": "Hi"}])
    ids = tokenizer.encode(text)          # the rendered text holds its own special tokens
    ids, assistant = template.encode(tokenizer, messages)   # for training: 1 on the
                                          # assistant's tokens (its end-of-turn included)

Used by the server's chat endpoint, `python -m decode --chat` and chat fine-tuning
(`finetune_chat`), so a model is trained on the text it is later prompted with.

The template is the directory's `chat_template.jinja` when it has one (what transformers
5 writes), else `tokenizer_config.json`'s `chat_template` (a string, or a list of named
templates whose "default" is used). It is rendered with jinja2 in an immutable sandbox
(the template comes with the checkpoint: it is data, not trusted code) set up as
transformers sets its own: `trim_blocks` and `lstrip_blocks`, the loop controls, the
`{% generation %}` blocks that mark the assistant's text, a
`tojson` that keeps non-ASCII text and takes `indent`/`separators`/`sort_keys`, and the
globals `raise_exception` (a `UserError` naming the template's message) and
`strftime_now`. The variables are `messages`, `add_generation_prompt` (True: the prompt
ends where the assistant's reply starts), `tools` and `documents` (None) and the
tokenizer's named special tokens (`bos_token`, `eos_token`, `unk_token`, `sep_token`,
`pad_token`, `cls_token`, `mask_token`) as its files spell them. A message's keys whose
value is None are dropped first (OpenAI's clients send `"name": null`), as transformers does.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os

from models.errors import UserError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
LEGACY_SPECIALS_FILE = "special_tokens_map.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class ChatTemplate:
    """One Jinja chat template, compiled once, and the special tokens it may read."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        try:
            import jinja2
            import jinja2.ext
            import jinja2.sandbox
        except ImportError:
            raise ImportError("chat templates need jinja2: "
                              "pip install 'jax-transformer-zoo[hf]'") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        class Generation(jinja2.ext.Extension):
            """`{% generation %}...{% endgeneration %}`: transformers' marks around what
            the assistant writes, rendered as their contents (`encode` finds it itself)."""
            tags = {"generation"}

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, Generation])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise UserError(f"the chat template does not compile: {e}") from None
        self._errors = jinja2.TemplateError

    def __eq__(self, other) -> bool:
        return (isinstance(other, ChatTemplate) and self.source == other.source
                and self.special_tokens == other.special_tokens)

    def __hash__(self) -> int:
        return hash((self.source, tuple(sorted(self.special_tokens.items()))))

    @property
    def identity(self) -> str:
        """A digest of the template and its special tokens (keys cached tokens)."""
        spec = json.dumps([self.source, self.special_tokens], sort_keys=True)
        return hashlib.sha256(spec.encode()).hexdigest()

    @classmethod
    def from_directory(cls, directory: str, template_file: str = "") -> ChatTemplate | None:
        """The directory's template and special tokens; None when it has no template.
        `template_file`: a Jinja file read instead of the directory's template (with the
        directory's special tokens).

        Raises:
            UserError: `template_file` is not a file, or a template does not compile.
        """
        config = _read_json(os.path.join(directory, CONFIG_FILE))
        specials = _read_json(os.path.join(directory, LEGACY_SPECIALS_FILE))
        specials.update(config)                 # tokenizer_config.json wins, as in transformers
        tokens = {name: _spelling(specials[name]) for name in SPECIAL_TOKENS
                  if specials.get(name) is not None}
        if template_file:
            if not os.path.isfile(template_file):
                raise UserError(f"chat_template={template_file!r} is not a file (a Jinja "
                                "chat template)")
            with open(template_file, encoding="utf-8") as f:
                return cls(f.read(), tokens)
        path = os.path.join(directory, TEMPLATE_FILE)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return cls(f.read(), tokens)
        source = config.get("chat_template")
        if isinstance(source, list):            # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise UserError(f"{os.path.join(directory, CONFIG_FILE)} has chat templates "
                                f"{sorted(map(str, named))} and none named 'default'")
            source = named["default"]
        if source is None:
            return None
        if not isinstance(source, str):
            raise UserError(f"{os.path.join(directory, CONFIG_FILE)}: chat_template must be a "
                            f"string, got {type(source).__name__}")
        return cls(source, tokens)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model reads it (its special tokens written as text).

        Raises:
            UserError: the template refused the conversation (its `raise_exception`
                message, such as "Conversation roles must alternate user/assistant/...").
        """
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except self._errors as e:
            raise UserError(f"the model's chat template refused the messages: {e}") from None


    def encode(self, tokenizer, messages: list[dict], *, where: str = "the conversation"
               ) -> tuple[list[int], list[int]]:
        """The conversation's token ids as transformers' `apply_chat_template(messages,
        tokenize=True)` gives them (the rendered text encoded without added special tokens),
        and a 0/1 flag per id: 1 on what each assistant message adds to the text (its
        content and the template's end of turn), 0 on everything else.

        Each assistant message's span is where the text rendered up to it with the
        generation prompt ends, to where the text rendered through it ends; an id is the
        assistant's when its characters start inside a span.

        Raises:
            UserError: naming `where`: no assistant message, or a template that renders a
                message differently once later messages follow it (so its span cannot be
                found in the whole).
        """
        if not hasattr(tokenizer, "hf"):
            raise UserError(f"{where}: chat templates need a Hugging Face tokenizer (a model "
                            "directory's tokenizer files)")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self.render(messages, add_generation_prompt=False)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = self.render(messages[:i], add_generation_prompt=True) if i else ""
            through = self.render(messages[:i + 1], add_generation_prompt=False)
            if not (through.startswith(start) and text.startswith(through)):
                raise UserError(f"{where}: the chat template renders message {i + 1} "
                                "differently once later messages follow it, so its tokens "
                                "cannot be told apart from the rest")
            spans.append((len(start), len(through)))
        if not spans:
            raise UserError(f"{where}: no assistant message, so nothing to learn from")
        encoded = tokenizer.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        flags = [int(any(a <= begin < b for a, b in spans) or
                     (begin == end and any(a < end <= b for a, b in spans)))
                 for begin, end in offsets]
        return list(map(int, ids)), flags


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _spelling(token) -> str:
    """A special token as text: a string, or an AddedToken's {"content": ...}."""
    return token["content"] if isinstance(token, dict) else str(token)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON: {e}") from None
    return value if isinstance(value, dict) else {}
