"""Committed token ids -> text deltas, for streaming and for stop strings.

`TextAssembler` is fed each decoding round's newly committed ids and returns the text that is
safe to show now. Two things make that more than `decode(new_ids)`:

- a token may end inside a multi-byte character (the decoder yields U+FFFD for the
  incomplete tail), and tokenizers that strip a leading space decode a lone token differently
  than inside a sequence; so each delta is the difference between decoding a short window of
  earlier ids with and without the new ones (the window slides forward as text is emitted);
- a stop string may straddle rounds, so the last `longest stop - 1` characters are held back
  until the next round (or the end) shows they do not begin a stop string.

The same assembler serves streamed and non-streamed responses, so both give the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

_INCOMPLETE_CHAR = "\ufffd"


class TextAssembler:
    """Accumulates generated ids and the text they decode to, cut at the first stop."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop_strings: Sequence[str] = (),
        stop_token_ids: Collection[int] = (),
    ) -> None:
        self._decode = decode
        self._stop_strings = [s for s in stop_strings if s]
        self._hold_back = max((len(s) for s in self._stop_strings), default=1) - 1
        self._stop_token_ids = frozenset(stop_token_ids)
        self._ids: list[int] = []  # generated ids before any stop token
        self._window_start = 0  # ids[window_start:read_end] decode to the text's tail
        self._read_end = 0
        self._text = ""
        self._emitted = 0  # characters of _text already handed out
        self.stopped = False  # a stop token or stop string ended the text

    @property
    def text(self) -> str:
        return self._text

    @property
    def taken(self) -> int:
        """How many ids the text holds: those before a stop token (or the stop)."""
        return len(self._ids)

    def add(self, ids: Sequence[int]) -> str:
        """Take one round's committed ids; return the text that may be shown now."""
        if self.stopped:
            return ""
        for token in ids:
            if token in self._stop_token_ids:
                self.stopped = True
                break
            self._ids.append(token)
        self._decode_new_ids(flush=False)
        self._cut_at_stop_string()
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """The generation is over: return whatever is still held back."""
        if not self.stopped:
            self._decode_new_ids(flush=True)
            self._cut_at_stop_string()
        return self._take(final=True)

    def _decode_new_ids(self, *, flush: bool) -> None:
        if len(self._ids) == self._read_end:
            return
        known = self._decode(self._ids[self._window_start : self._read_end])
        extended = self._decode(self._ids[self._window_start :])
        if len(extended) <= len(known) or (extended.endswith(_INCOMPLETE_CHAR) and not flush):
            return  # wait for the rest of the character
        self._text += extended[len(known) :]
        self._window_start, self._read_end = self._read_end, len(self._ids)

    def _cut_at_stop_string(self) -> None:
        # Only the new text, plus enough before it to hold a straddling stop string, is searched.
        search_from = max(0, self._emitted - self._hold_back)
        hits = [i for s in self._stop_strings if (i := self._text.find(s, search_from)) >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            self.stopped = True

    def _take(self, *, final: bool) -> str:
        end = len(self._text) if final else max(self._emitted, len(self._text) - self._hold_back)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta
