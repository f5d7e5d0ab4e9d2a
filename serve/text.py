"""Incremental detokenisation: each new token's text delta, with stop strings.

    d = Detokenizer(tokenizer, stops=("\\n\\n",))
    d.add(id)   -> ("the new text", False)     whole characters; at a stop, (text before, True)

A delta is what the decoded text gained, less what may still change: a trailing partial
character (a byte-level token that ends inside a UTF-8 sequence decodes to U+FFFD until its
next bytes come) and a tail that could be the start of a stop string. `flush` gives what was
held back when the request ends for another reason.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class Detokenizer:
    """One request's text so far (`tokenizer` None: token ids only, every delta empty)."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.ids: list[int] = []
        self.text = ""            # the decoded text of `ids`
        self.sent = 0             # characters of it handed out

    def add(self, token: int) -> tuple[str, bool]:
        """The delta after `token`, and whether a stop string ended the text (the delta
        then stops before it)."""
        if self.tokenizer is None:
            return "", False
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            delta, self.sent = self.text[self.sent:end], end
            self.text = self.text[:end]
            return delta, True
        safe = len(self.text.rstrip(REPLACEMENT))
        for stop in self.stops:
            for k in range(min(len(stop) - 1, safe - self.sent), 0, -1):
                if self.text[:safe].endswith(stop[:k]):
                    safe = min(safe, len(self.text[:safe]) - k)
                    break
        if safe <= self.sent:
            return "", False
        delta, self.sent = self.text[self.sent:safe], safe
        return delta, False

    def flush(self) -> str:
        """What was held back (the request ended without a stop string)."""
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta
