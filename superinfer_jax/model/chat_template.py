"""Chat prompts: the model's own chat template (Jinja, as HF renders it), else a documented fallback.

``superinfer_jax.model.tokenizer.Tokenizer.chat_template`` holds the template the model files declare
(``tokenizer_config.json`` / ``chat_template.jinja`` of an HF dir, ``tokenizer.chat_template`` of a GGUF,
e.g. SmolLM2's ``<|im_start|>role ... <|im_end|>``). It is rendered the way transformers'
``apply_chat_template`` does: a sandboxed Jinja environment with ``trim_blocks`` / ``lstrip_blocks``,
``messages``, ``add_generation_prompt=True``, ``bos_token`` / ``eos_token`` and ``raise_exception``.

A model without a template gets ``FALLBACK_TEMPLATE``: one line ``"<role>: <content>"`` per message and
a final ``"assistant:"`` line to generate from::

  system: You are terse.
  user: Hi
  assistant:
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

FALLBACK_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")


class ChatTemplateError(ValueError):
  """The template failed to render these messages (e.g. it raised on an unsupported role)."""


def _token_text(tokenizer: Any, token_id: Optional[int]) -> str:
  if tokenizer is None or token_id is None:
    return ""
  backend = getattr(tokenizer, "backend", None)
  if backend is not None:
    return backend.id_to_token(int(token_id)) or ""
  return ""


def chat_template_of(tokenizer: Any) -> tuple[str, bool]:
  """(template, is the model's own)."""
  t = getattr(tokenizer, "chat_template", None)
  if isinstance(t, str) and t.strip():
    return t, True
  return FALLBACK_TEMPLATE, False


def render_chat(tokenizer: Any, messages: Sequence[dict], template: Optional[str] = None) -> str:
  """The prompt text of ``messages`` ([{"role", "content"}]) under the model's template (or ``template``)."""
  import jinja2  # pylint: disable=import-outside-toplevel
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=import-outside-toplevel
  if template is None:
    template, _ = chat_template_of(tokenizer)

  def raise_exception(msg):
    raise ChatTemplateError(msg)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals["raise_exception"] = raise_exception
  try:
    tmpl = env.from_string(template)
    eos_ids = getattr(tokenizer, "eos_ids", ()) or ()
    return tmpl.render(messages=list(messages), add_generation_prompt=True,
                       bos_token=_token_text(tokenizer, getattr(tokenizer, "bos_id", None)),
                       eos_token=_token_text(tokenizer, eos_ids[0] if eos_ids else None))
  except ChatTemplateError:
    raise
  except jinja2.TemplateError as e:
    raise ChatTemplateError(f"the chat template failed: {e}") from None


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
  """Token ids of a rendered chat prompt: ``encode_text``, minus the BOS the tokenizer prepends when the
  template already wrote one (no double BOS, as transformers' ``apply_chat_template(tokenize=True)``)."""
  from superinfer_jax.model.tokenizer import encode_text  # pylint: disable=import-outside-toplevel
  ids = encode_text(tokenizer, text)
  bos = getattr(tokenizer, "bos_id", None)
  if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
    ids = ids[1:]
  return ids
