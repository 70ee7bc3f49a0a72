"""Incremental detokenization with UTF-8 hold-back and stop-sequence hold-back (no torch).

Token ids arrive one at a time; text leaves only when it is final:
- a byte-level BPE token can end inside a multi-byte character: the decoder then yields U+FFFD,
  and we hold the text back until the character completes (prefix/read offsets as in vLLM's
  ``detokenize_incrementally``);
- text that could be the start of a stop sequence is held back until it either completes the stop
  sequence (generation ends, the stop text is never sent) or stops matching.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class DetokState:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    pending: str = ""  # decoded text not yet released (possible stop-sequence prefix)
    emitted_chars: int = 0


class IncrementalDetokenizer:
    """One per request. ``add(token_id) -> (text_to_send, stop_hit)``; ``flush() -> text``.

    Each ``add`` searches every stop sequence and tries hold-backs up to the longest one's length:
    ``sfcl.engine.request.check_stop`` bounds both for requests (``SamplingParams``)."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.s = DetokState()
        self.stop_hit: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Feed one generated token. Returns (text that is now final, stop sequence hit or None).
        After a stop hit, the caller must end generation; later calls return ("", hit)."""
        if self.stop_hit is not None:
            return "", self.stop_hit
        s = self.s
        s.ids.append(token_id)
        prefix = self._decode(s.ids[s.prefix_offset : s.read_offset])
        full = self._decode(s.ids[s.prefix_offset :])
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix):
            return "", None  # incomplete character (or nothing new yet): wait for more bytes
        new = full[len(prefix) :]
        s.prefix_offset, s.read_offset = s.read_offset, len(s.ids)
        return self._release(new)

    def _release(self, new: str) -> tuple[str, str | None]:
        s = self.s
        text = s.pending + new
        if self.stop:
            # Earliest complete stop sequence wins; text before it is released.
            cut, hit = -1, None
            for stop in self.stop:
                i = text.find(stop)
                if i != -1 and (cut == -1 or i < cut):
                    cut, hit = i, stop
            if hit is not None:
                self.stop_hit = hit
                s.pending = ""
                out = text[:cut]
                s.emitted_chars += len(out)
                return out, hit
            # Hold back the longest suffix that is a prefix of some stop sequence.
            hold = 0
            for k in range(min(len(text), self.max_stop - 1), 0, -1):
                suffix = text[-k:]
                if any(st.startswith(suffix) for st in self.stop):
                    hold = k
                    break
            out, s.pending = (text[:-hold], text[-hold:]) if hold else (text, "")
        else:
            out, s.pending = text, ""
        s.emitted_chars += len(out)
        return out, None

    def flush(self) -> str:
        """Text still held at the end of generation: a stop-sequence prefix that never completed.
        An incomplete trailing character (generation ended inside its bytes) is dropped, never
        sent as U+FFFD."""
        if self.stop_hit is not None:
            return ""
        s = self.s
        tail = self._decode(s.ids[s.prefix_offset :])
        prefix = self._decode(s.ids[s.prefix_offset : s.read_offset])
        rest = tail[len(prefix) :] if len(tail) > len(prefix) else ""
        rest = rest.rstrip(_REPLACEMENT)  # bytes of a character cut off by max_tokens: drop them
        out = s.pending + rest
        s.pending = ""
        s.read_offset = len(s.ids)
        s.emitted_chars += len(out)
        return out
