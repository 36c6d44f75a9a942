"""Tokenizer loading: HF tokenizer files, or the byte-level BPE vocabulary embedded in a GGUF file.

``load_tokenizer(path_or_name)`` accepts an HF directory (``tokenizer.json`` [+ ``tokenizer_config.json``]),
a ``.gguf`` file, an orbax dir written by ``scripts/convert_checkpoint.py`` (which stores ``tokenizer.json``)
or a built-in model name. The GGUF path builds a ``tokenizers.Tokenizer`` the way transformers'
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` does for ``tokenizer.ggml.model == "gpt2"``
(byte-level BPE, GPT-2 split regex, control tokens added as special tokens), so ids agree with it.

``encode_text(tokenizer, text)`` is the one place text becomes token ids (engine prompts, workload
lengths); it accepts our ``Tokenizer`` and the other tokenizer shapes callers pass (see its docstring).

No JAX: the workload package (numpy only) imports this module. The GGUF reader, whose module pulls in JAX
through ``params``, is imported only when a GGUF tokenizer is actually read.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from superinfer_jax.model.paths import resolve_model_path

_CONTROL = 3  # llama.cpp token type CONTROL
_USER_DEFINED = 4

# Split regexes by ``tokenizer.ggml.pre`` (as transformers' GGUF tokenizer mapping has them); any other
# value (e.g. SmolLM2's "smollm", "gpt2") uses byte-level BPE's built-in GPT-2 regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def byte_level_pre_tokenizer(pre: str | None):
  """The pre-tokenizer for a GGUF ``tokenizer.ggml.pre`` value."""
  split = PRE_TOKENIZER_SPLITS.get(pre or "")
  if split is None:
    return pre_tokenizers.ByteLevel(add_prefix_space=False)
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])


@dataclasses.dataclass
class Tokenizer:
  """A ``tokenizers.Tokenizer`` plus the special ids and chat template the model files declare."""
  backend: tokenizers.Tokenizer
  bos_id: int | None = None
  eos_ids: tuple[int, ...] = ()
  add_bos: bool = False
  chat_template: str | None = None

  @property
  def eos_id(self) -> int | None:
    return self.eos_ids[0] if self.eos_ids else None

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Token ids of ``text``; a BOS id is prepended when ``add_bos`` (default: the model files' setting)."""
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def encode_text(tokenizer: Any, text: str) -> list[int]:
  """Token ids of ``text`` under ``tokenizer``, as a list of Python ints.

  ``tokenizer`` is anything with ``encode(str) -> list[int]`` (our ``Tokenizer``, with its default BOS
  setting; a transformers tokenizer), a ``tokenizers.Tokenizer`` (whose ``encode`` returns an
  ``Encoding``; its ``.ids`` are used) or a bare callable ``str -> list[int]``.
  """
  encode = getattr(tokenizer, "encode", None)
  if encode is None:
    if not callable(tokenizer):
      raise TypeError(f"tokenizer {tokenizer!r} has no encode() and is not callable")
    encode = tokenizer
  out = encode(text)
  ids = getattr(out, "ids", out)  # tokenizers.Encoding -> .ids
  return [int(t) for t in ids]


def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable unicode character map."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
      list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, (chr(c) for c in cs)))


def tokenizer_from_gguf(path: str) -> Tokenizer:
  """Byte-level BPE tokenizer from a GGUF file's ``tokenizer.ggml.*`` fields."""
  # Local: gguf_loader imports JAX (see the module docstring).
  from superinfer_jax.model.loaders.gguf_loader import open_gguf  # pylint: disable=import-outside-toplevel
  reader = open_gguf(path)
  fields = reader.fields

  def get(key, default=None):
    return fields[key].contents() if key in fields else default

  kind = get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE 'gpt2')")
  tokens = get("tokenizer.ggml.tokens")
  merges = get("tokenizer.ggml.merges")
  if not tokens or merges is None:
    raise ValueError(f"{path}: GGUF has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
  types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
  spelling = bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab = {}
  for i, tok in enumerate(tokens):
    if not set(tok) <= alphabet:
      tok = "".join(spelling[b] for b in tok.encode("utf-8"))
    vocab[tok] = i
  bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges])
  backend = tokenizers.Tokenizer(bpe)
  backend.pre_tokenizer = byte_level_pre_tokenizer(get("tokenizer.ggml.pre"))
  backend.decoder = decoders.ByteLevel()
  control = [t for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in control])
  user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
  if user:
    backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in user])
  eos = get("tokenizer.ggml.eos_token_id")
  bos = get("tokenizer.ggml.bos_token_id")
  return Tokenizer(backend=backend, bos_id=None if bos is None else int(bos),
                   eos_ids=() if eos is None else (int(eos),),
                   add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=get("tokenizer.chat_template"))


def _token_id(backend: tokenizers.Tokenizer, tok) -> int | None:
  if isinstance(tok, dict):
    tok = tok.get("content")
  return None if tok is None else backend.token_to_id(tok)


def tokenizer_from_dir(path: str) -> Tokenizer:
  """From ``tokenizer.json`` (+ ``tokenizer_config.json``, ``config.json`` for ids) in a directory."""
  tj = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(tj):
    raise FileNotFoundError(f"{path}: no tokenizer.json")
  try:
    backend = tokenizers.Tokenizer.from_file(tj)
  except Exception as e:
    raise ValueError(f"{tj}: cannot parse tokenizer: {e}") from e
  tc = {}
  for name in ("tokenizer_config.json",):
    p = os.path.join(path, name)
    if os.path.isfile(p):
      with open(p) as f:
        tc = json.load(f)
  bos = _token_id(backend, tc.get("bos_token"))
  eos = _token_id(backend, tc.get("eos_token"))
  template = tc.get("chat_template")
  tp = os.path.join(path, "chat_template.jinja")
  if template is None and os.path.isfile(tp):
    with open(tp) as f:
      template = f.read()
  return Tokenizer(backend=backend, bos_id=bos, eos_ids=() if eos is None else (eos,),
                   add_bos=bool(tc.get("add_bos_token", False)), chat_template=template)


def save_tokenizer(tok: Tokenizer, path: str) -> None:
  """Writes ``tokenizer.json`` + ``tokenizer_config.json`` (readable by ``tokenizer_from_dir``)."""
  os.makedirs(path, exist_ok=True)
  tok.backend.save(os.path.join(path, "tokenizer.json"))
  ident = tok.backend.id_to_token
  tc = {"bos_token": None if tok.bos_id is None else ident(tok.bos_id),
        "eos_token": None if tok.eos_id is None else ident(tok.eos_id),
        "add_bos_token": tok.add_bos, "chat_template": tok.chat_template}
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(tc, f, indent=2)


def load_tokenizer(path_or_name: str) -> Tokenizer:
  """Tokenizer of a model: built-in name, ``.gguf`` file, HF dir or orbax dir with tokenizer files."""
  path = resolve_model_path(path_or_name)
  if os.path.isdir(path):
    return tokenizer_from_dir(path)
  if path.endswith(".gguf") and os.path.isfile(path):
    return tokenizer_from_gguf(path)
  raise FileNotFoundError(f"no tokenizer at {path_or_name!r} (expected a dir with tokenizer.json, a .gguf "
                          f"file or a built-in model name)")
