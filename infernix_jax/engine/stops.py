"""Host-side stop handling: detokenize incrementally, cut at stop strings, and hold back text that
might be the start of a stop string so a stream never shows part of one."""
from __future__ import annotations

from ..tokenizer import IncrementalDecoder, Tokenizer


class TextTracker:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = stop
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.matched: str | None = None      # the stop string that ended the text

    def _holdback(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that is now safe to emit. Sets .stopped on a stop string."""
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += self.decoder.push(token_id)
        if self.stop:
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                i, self.matched = min(hits)
                self.text = self.text[:i]
                self.stopped = True
                return self._take(len(self.text))
        return self._take(len(self.text) - self._holdback())

    def finish(self) -> str:
        """Everything not yet emitted (the run ended for another reason than a stop string)."""
        if not self.stopped:
            self.text += self.decoder.flush()
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out
