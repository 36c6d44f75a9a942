"""Incremental detokenization and stop strings (superinfer_jax/engine/detokenizer.py)."""
import numpy as np
import pytest

from superinfer_jax.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def smol_tok(smollm2_path):
  from superinfer_jax.model import load_tokenizer
  return load_tokenizer(smollm2_path)


def _stream(tok, prompt, ids, stop=()):
  d = IncrementalDetokenizer(tok, prompt, stop)
  out = ""
  for t in ids:
    out += d.add_token(t)
    if d.stopped:
      break
  out += d.flush()
  return out, d


def test_incremental_equals_full_decode(smol_tok):
  text = "Héllo wörld — 東京タワー 🚀🚀 naïve café, 3.14159! \n\tend"
  ids = smol_tok.encode(text)
  prompt = smol_tok.encode("Prompt:")
  out, d = _stream(smol_tok, prompt, ids)
  assert out == smol_tok.decode(ids, skip_special_tokens=True) == d.text
  rng = np.random.default_rng(0)
  for _ in range(5):   # random ids, including partial multi-byte sequences
    ids = rng.integers(0, 49152, size=40).tolist()
    out, _ = _stream(smol_tok, prompt, ids)
    assert out == smol_tok.decode(ids, skip_special_tokens=True)


def test_deltas_never_contain_a_replacement_char_mid_character(smol_tok):
  ids = smol_tok.encode("🚀東")
  d = IncrementalDetokenizer(smol_tok, [], ())
  deltas = [d.add_token(t) for t in ids]
  assert "".join(deltas) == "🚀東" and not any("\ufffd" in x for x in deltas)


def test_stop_string_cuts_text_and_holds_back(smol_tok):
  ids = smol_tok.encode("The answer is 42. STOP here and more text")
  out, d = _stream(smol_tok, [], ids, stop=("STOP",))
  assert d.stopped and out == "The answer is 42. " and d.text == out
  # A stop string spanning several tokens, streamed: no delta ever shows a prefix of the stop string
  # once the stop string completes.
  d = IncrementalDetokenizer(smol_tok, [], ("is 42",))
  deltas = []
  for t in ids:
    deltas.append(d.add_token(t))
    if d.stopped:
      break
  deltas.append(d.flush())
  assert "".join(deltas) == "The answer " and d.stopped
  # No stop string in the text: everything comes out after flush.
  out, d = _stream(smol_tok, [], ids, stop=("zebra",))
  assert not d.stopped and out == smol_tok.decode(ids)
