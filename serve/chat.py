"""A model directory's chat template, rendered as transformers' `apply_chat_template` does.

    template = ChatTemplate.from_directory("path/to/Qwen2.5-0.5B-Instruct")   # None: none
    text = template.render([{"role": "user", "content": "Hi"}])
    ids = tokenizer.encode(text)          # the rendered text holds its own special tokens

The template is the directory's `chat_template.jinja` when it has one (what transformers
5 writes), else `tokenizer_config.json`'s `chat_template` (a string, or a list of named
templates whose "default" is used). It is rendered with jinja2 in an immutable sandbox
(the template comes with the checkpoint: it is data, not trusted code) set up as
transformers sets its own: `trim_blocks` and `lstrip_blocks`, the loop controls, a
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
                              "pip install 'jax-transformer-zoo[serve]'") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise UserError(f"the chat template does not compile: {e}") from None
        self._errors = jinja2.TemplateError

    @classmethod
    def from_directory(cls, directory: str) -> ChatTemplate | None:
        """The directory's template and special tokens; None when it has no template."""
        config = _read_json(os.path.join(directory, CONFIG_FILE))
        specials = _read_json(os.path.join(directory, LEGACY_SPECIALS_FILE))
        specials.update(config)                 # tokenizer_config.json wins, as in transformers
        tokens = {name: _spelling(specials[name]) for name in SPECIAL_TOKENS
                  if specials.get(name) is not None}
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
