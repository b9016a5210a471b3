"""A row's text as it decodes, released only once it can no longer change: never a stop string
or what follows it, never a partial character. What `tts generate` prints as it goes and what
Serve streams, one `StableText` per row."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StableText:
    """The text of one row's tokens so far, and how much of it has been released."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode, self.stop = decode, tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=0)  # a stop string may be starting
        self.ids: list[int] = []
        self.sent = 0  # characters released

    def commit(self, tokens: Sequence[int]) -> str:
        """A step's tokens: the text they made final ('' while nothing is)."""
        self.ids.extend(tokens)
        text = self.decode(self.ids)
        for s in self.stop:  # never a stop string or what follows
            if s in text:
                text = text[: text.index(s)]
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":  # a character still in bytes
            safe -= 1
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent : safe], safe
        return delta

    def finish(self, text: str) -> str:
        """The row ended with `text` (its output's, stop strings cut): what is left of it."""
        rest, self.sent = text[self.sent :], max(self.sent, len(text))
        return rest
