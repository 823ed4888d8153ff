"""Progress of a long prefill on a terminal: ``prefill 1024/2913 tokens, 41 tokens/s``.

Shown only where someone is watching: the stream is a terminal. On a pipe, a file or with
``--format json`` nothing is written (``for_stream`` returns None), so logs and JSON stay clean.
"""

from __future__ import annotations

import time


class TokenProgress:
    """progress(done, total): rewrites one status line on `stream`; close() clears it."""

    def __init__(self, stream, label: str = "prefill", clock=time.perf_counter):
        self.stream, self.label, self.clock = stream, label, clock
        self.start = clock()
        self.shown = False

    def __call__(self, done: int, total: int):
        elapsed = self.clock() - self.start
        rate = f", {done / elapsed:.0f} tokens/s" if elapsed > 0 and done else ""
        self.stream.write(f"\r\x1b[K{self.label} {done}/{total} tokens{rate}")
        self.stream.flush()
        self.shown = True

    def close(self):
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def for_stream(stream, enabled: bool = True) -> TokenProgress | None:
    """A TokenProgress on `stream` if enabled and the stream is a terminal, else None."""
    isatty = getattr(stream, "isatty", None)
    if not enabled or isatty is None or not isatty():
        return None
    return TokenProgress(stream)
