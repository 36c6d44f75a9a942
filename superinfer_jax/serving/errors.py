"""How an ``protocol.APIError`` goes out: the JSON error body, and ``Retry-After`` on a 429 or 503."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from superinfer_jax.serving import protocol as P

RETRY_AFTER_S = 1   # what a 429 (queue full) or 503 (starting, draining) tells the client to wait


def error_response(e: P.APIError) -> JSONResponse:
  """The error body; a 429 or 503 also says when to retry (``Retry-After``, seconds)."""
  headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
  return JSONResponse(e.body(), status_code=e.status, headers=headers)
