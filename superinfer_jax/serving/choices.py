"""The engine requests behind one HTTP request: ``Choices`` (one engine request per choice, ``n`` of them)
and ``submit_choices``, which queues them on the ``EngineWorker``."""
from __future__ import annotations

import asyncio
import dataclasses

from superinfer_jax.serving import protocol as P
from superinfer_jax.serving.worker import EngineWorker


class Choices:
  """The engine requests of one HTTP request, their admission slots, and one queue their events arrive on
  as ``(index, kind, event)``. ``close()`` (idempotent) aborts the choices that have not finished and frees
  every slot."""

  def __init__(self, worker: EngineWorker):
    self.worker = worker
    self.rids: list[str] = []
    self.final: list[bool] = []
    self.events: asyncio.Queue = asyncio.Queue()
    self._pumps: list[asyncio.Task] = []
    self.closed = False

  def add(self, rid: str, q: asyncio.Queue) -> None:
    i = len(self.rids)
    self.rids.append(rid)
    self.final.append(False)
    self._pumps.append(asyncio.ensure_future(self._pump(i, q)))

  async def _pump(self, i: int, q: asyncio.Queue) -> None:
    while True:
      kind, ev = await q.get()
      self.events.put_nowait((i, kind, ev))
      if kind == "error" or ev.finished:
        return

  @property
  def all_final(self) -> bool:
    return all(self.final)

  def close(self) -> None:
    if self.closed:
      return
    self.closed = True
    for rid, final, pump in zip(self.rids, self.final, self._pumps):
      pump.cancel()
      if not final:
        self.worker.abort(rid)
      self.worker.done(rid)


def submit_choices(worker: EngineWorker, req, prompt_ids, params) -> Choices:
  """Queues the request's ``n`` choices (choice i's seed: ``seed + i``); on a refusal, the ones queued
  already are aborted and the error (``protocol.APIError``) raised."""
  choices = Choices(worker)
  try:
    for i in range(req.n):
      rid = req.request_id if req.n == 1 else f"{req.request_id}-{i}"
      p = params if i == 0 or params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % 2**32)
      choices.add(rid, worker.submit(rid, prompt_ids, p, ttft_slo=req.ttft_slo, tbt_slo=req.tbt_slo,
                                     cache_salt=req.cache_salt))
  except P.APIError:
    choices.close()
    raise
  return choices
