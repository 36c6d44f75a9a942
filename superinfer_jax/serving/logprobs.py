"""Log-probabilities as the OpenAI endpoints show them.

The engine computes them in its step (``SamplingParams.logprobs``): per output token a ``TokenLogprobs``
(its log-probability under the log-softmax of the raw logits, and the k most likely token ids with theirs).
Here they become token texts; nothing is scored again.
"""
from __future__ import annotations

from typing import Callable, Sequence

TextLogprobs = tuple[float, list[tuple[str, float]]]   # (logprob, [(alternative's text, logprob)], best first)


def as_text(token_ids: Sequence[int], logprobs: Sequence, token_text: Callable[[int], str]
            ) -> tuple[list[str], list[TextLogprobs]]:
  """(token texts, per token (logprob, top alternatives as text)) of ``token_ids`` and their engine
  ``logprobs`` (``TokenLogprobs``, one per token; ``ValueError`` when the counts differ)."""
  if len(logprobs) != len(token_ids):
    raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs")
  return ([token_text(t) for t in token_ids],
          [(lp.logprob, [(token_text(a), alp) for a, alp in lp.top]) for lp in logprobs])
