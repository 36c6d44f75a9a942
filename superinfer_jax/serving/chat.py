"""Chat prompts for the server: the renderer lives in ``superinfer_jax/model/chat_template.py`` (next to the
tokenizer that carries the template), so the multi-turn workload (``workload/multiturn.py``) renders its
prompts with the very same code; this module re-exports it under its old name."""
from superinfer_jax.model.chat_template import (FALLBACK_TEMPLATE, ChatTemplateError, chat_template_of,
                                                render_chat)

__all__ = ["FALLBACK_TEMPLATE", "ChatTemplateError", "chat_template_of", "render_chat"]
