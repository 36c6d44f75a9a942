"""Minimal, validating safetensors reader (numpy + ml_dtypes, so bfloat16 works without torch).

File format: 8-byte little-endian header length N, N bytes of JSON ``{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}``, then the raw tensor bytes. We check that the header
parses, every tensor's byte range matches its dtype and shape and lies inside the file (a truncated file
fails here with a clear message), and return lazy read-only memmap views.
"""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from superinfer_jax.model.params import WeightLoadError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
  """One ``.safetensors`` file: ``names()`` and ``get(name) -> np.ndarray`` (read-only memmap view)."""

  def __init__(self, path: str):
    self.path = path
    try:
      size = os.path.getsize(path)
      with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
          raise WeightLoadError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
          raise WeightLoadError(f"{path}: corrupt or truncated safetensors file (header length {n}, "
                                f"file size {size})")
        header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise WeightLoadError(f"{path}: cannot read safetensors header: {e}") from e
    if not isinstance(header, dict):
      raise WeightLoadError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    self._data_start = 8 + n
    data_size = size - self._data_start
    self._entries = {}
    for name, e in header.items():
      try:
        dtype = np.dtype(_DTYPES[e["dtype"]])
        shape = tuple(int(s) for s in e["shape"])
        begin, end = (int(x) for x in e["data_offsets"])
      except (KeyError, TypeError, ValueError) as err:
        raise WeightLoadError(f"{path}: corrupt safetensors entry for {name!r}: {e!r}") from err
      nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
      if end - begin != nbytes or begin < 0:
        raise WeightLoadError(f"{path}: tensor {name!r} byte range [{begin}, {end}) does not match "
                              f"{e['dtype']} {list(shape)} ({nbytes} bytes)")
      if end > data_size:
        raise WeightLoadError(f"{path}: truncated file: tensor {name!r} needs bytes up to {end} of the data "
                              f"section, only {data_size} present")
      self._entries[name] = (dtype, shape, begin)
    self._mm = None

  def names(self) -> list[str]:
    return list(self._entries)

  def get(self, name: str) -> np.ndarray:
    dtype, shape, begin = self._entries[name]
    if self._mm is None:
      self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
    count = int(np.prod(shape, dtype=np.int64))
    start = self._data_start + begin
    return np.frombuffer(self._mm, dtype=dtype, count=count, offset=start).reshape(shape)
