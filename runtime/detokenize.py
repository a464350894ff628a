"""Token ids to text as they come: the one incremental detokenizer of `helmc run`, `helmc chat` and `helmc serve`.

A byte-level BPE token can hold part of a character (a CJK character or an emoji is 3-4 bytes, often over 2-4
tokens), and a SentencePiece-style decoder drops or keeps a word's leading space by what precedes it, so a token's
text depends on its neighbours. tokenizers' DecodeStream decodes a short window of ids and releases text only once
it ends in whole characters; each chunk is final, and the chunks put together are the one-shot decode of every id
(`tokenizer.decode(ids)`, special tokens skipped). What is still held at the end (bytes no later token completed)
comes out of `flush()`, as the one-shot decode writes it (U+FFFD).

    d = Detokenizer(tokenizer)
    for t in tokens:
        out.write(d.add(t))          # "" while a character is incomplete
    out.write(d.flush())
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

_CONTEXT = 4      # ids before the held ones that `flush` decodes with them (their leading space, as in the window)


class Detokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []        # ids since the last released chunk
        self._context: list[int] = []     # the last ids before them
        self.text = ""                    # released so far

    def add(self, token: int) -> str:
        """The text that one more token releases ("" while it ends inside a character)."""
        token = int(token)
        self._held.append(token)
        try:
            chunk = self._stream.step(self.tokenizer, token)
        except Exception:                 # the window's decode no longer starts with its prefix: decode it here
            chunk = self._window_text()
            if chunk.endswith("\ufffd"):
                return ""
            self._restart()
        if not chunk:
            return ""
        return self._release(chunk)

    def flush(self) -> str:
        """At the end of the tokens: what is still held (an incomplete character decodes to U+FFFD)."""
        if not self._held:
            return ""
        chunk = self._window_text()
        self._restart()
        return self._release(chunk) if chunk else self._forget_held()

    def _restart(self) -> None:
        """A new stream whose window starts after the last ids seen (their text already released)."""
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for t in (self._context + self._held)[-_CONTEXT:]:
            self._stream.step(self.tokenizer, t)

    def _window_text(self) -> str:
        """The held ids' text, decoded after the ids before them (whose text it leaves out)."""
        before = self.tokenizer.decode(self._context, skip_special_tokens=self.skip_special_tokens)
        both = self.tokenizer.decode(self._context + self._held, skip_special_tokens=self.skip_special_tokens)
        if both.startswith(before):
            return both[len(before):]
        return self.tokenizer.decode(self._held, skip_special_tokens=self.skip_special_tokens)

    def _release(self, chunk: str) -> str:
        self.text += chunk
        self._forget_held()
        return chunk

    def _forget_held(self) -> str:
        self._context = (self._context + self._held)[-_CONTEXT:]
        self._held = []
        return ""
