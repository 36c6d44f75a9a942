"""Incremental detokenization and stop-string detection (host side, no JAX).

``IncrementalDetokenizer`` turns a growing list of generated token ids into text deltas:

* it decodes a small window of tokens (``prefix_offset:``) rather than the whole output each step, the way
  vLLM does, so the cost per token is O(window), not O(output length);
* a delta whose decoding ends in U+FFFD (an incomplete multi-byte character) is held back until the
  character completes;
* stop strings: after each token the new text is searched for every stop string (only the region a new
  match could touch); on a match the text is cut before the stop string and ``stopped`` becomes True;
* while stop strings are set, the last ``max(len(stop)) - 1`` characters are held back from the streamed
  delta so a caller never sees a partial stop string; ``flush()`` releases them when the request ends.

The tokenizer needs only ``decode(ids: list[int]) -> str`` (a ``tokenizers.Tokenizer`` or an HF tokenizer
both work; ``skip_special_tokens`` is passed when the method accepts it).
"""
from __future__ import annotations

import inspect
from typing import Sequence

_REPLACEMENT = "\ufffd"


def _make_decode(tokenizer):
  fn = tokenizer.decode
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    params = {}
  if "skip_special_tokens" in params:
    return lambda ids: fn(list(ids), skip_special_tokens=True)
  return lambda ids: fn(list(ids))


class IncrementalDetokenizer:
  """Per-request incremental detokenizer. See the module docstring."""

  # Tokens kept before the read offset so the decoder sees the context it needs for spacing
  # (sentencepiece / byte-level BPE join rules).
  _CONTEXT_TOKENS = 5

  def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()):
    self._decode = _make_decode(tokenizer)
    self._ids: list[int] = list(prompt_token_ids[-self._CONTEXT_TOKENS:])
    self._prefix_offset = 0
    self._read_offset = len(self._ids)
    self.text = ""              # full output text so far (cut at a stop string once stopped)
    self._emitted = 0           # characters of ``text`` already returned as deltas
    self._stop = tuple(stop)
    self._hold = max((len(s) for s in self._stop), default=1) - 1
    self.stopped = False

  def add_token(self, token_id: int) -> str:
    """Appends one generated token; returns the text delta that is safe to stream now."""
    if self.stopped:
      return ""
    self._ids.append(int(token_id))
    prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
    new_text = self._decode(self._ids[self._prefix_offset:])
    if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
      old_len = len(self.text)
      self.text += new_text[len(prefix_text):]
      self._prefix_offset = self._read_offset
      self._read_offset = len(self._ids)
      if self._stop:
        self._check_stop(old_len)
    return self._delta(final=self.stopped)

  def _check_stop(self, old_len: int) -> None:
    for s in self._stop:
      start = max(0, old_len - len(s) + 1)
      idx = self.text.find(s, start)
      if idx >= 0:
        self.text = self.text[:idx]
        self.stopped = True
        return

  def _delta(self, final: bool) -> str:
    end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
    delta = self.text[self._emitted:end]
    self._emitted = end
    return delta

  def flush(self) -> str:
    """Releases any held-back text (call when the request finishes)."""
    return self._delta(final=True)
