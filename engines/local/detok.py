"""Incremental detokenization: the text of an answer grows by the characters each new token
completes, for constant work per token (a decode of the last few tokens, never of the whole
answer). The window starts one token before the unread ones, so a tokenizer that drops a
leading space from a decoded piece, or that needs the next token to finish a character, still
gives the text a whole decode gives."""

from __future__ import annotations

from typing import Any

INCOMPLETE = "\ufffd"  # what a decode shows for the bytes of a character not yet complete


class IncrementalText:
    """The decoded text of ``ids`` as they are appended one by one."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # the window's first token: already read, decoded for context
        self._read = 0  # the first token whose characters are not in ``text`` yet

    def _decode(self, start: int, end: int) -> str:
        text: str = self._tokenizer.decode(self.ids[start:end], skip_special_tokens=True)
        return text

    def _pending(self) -> str:
        """The characters the unread tokens add to the text."""
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self.ids))
        return after[len(before) :] if len(after) > len(before) else ""

    def append(self, token: int) -> str:
        """Add ``token``; the characters it completes (none while a character is partial)."""
        self.ids.append(token)
        delta = self._pending()
        if not delta or delta.endswith(INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The whole text, with any partial character at the end as a whole decode shows it."""
        return self.text + self._pending()
