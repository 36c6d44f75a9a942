"""Ragged paged attention on XLA:CPU as a C++ custom call (``cpu_paged_attention.cc``, XLA FFI).

Same contract as ``pallas_kernels/reference.py`` (``ragged_paged_attention_reference``, the pure-JAX reference
beside it); registered as the attention backend ``"cpu_kernel"`` (``superinfer_jax/model/attention.py``).

Why: at decode on XLA:CPU the reference spends most of its time outside arithmetic. Each layer gathers every
token's K and V blocks, transposes them to ``[token, kv head, key, dim]`` for its batched dots and runs one tiny
dot per (token, kv head); at 16 sequences of SmolLM2 that was ~0.7 ms per layer, ~20 ms of an ~85 ms step
(WORKSPACE_NOTES, 2026-12-02). The kernel reads each K / V row once, in place in the cache, and scores the query
heads of a GQA group against it together; nothing is gathered or transposed.

Build: the source, together with ``cpu_dense.cc`` (the dense projection of ``cpu_dense.py``; one library holds
both custom calls), is compiled on first use with the host C++ compiler (``$CXX``, else ``c++``/``g++``) against
the XLA FFI headers of the installed jaxlib (``jax.ffi.include_dir()``), ``-O3 -march=native``, into a cache
directory (``$SUPERINFER_KERNEL_CACHE``, else ``~/.cache/superinfer_jax/kernels``) under a name derived from the
sources, the flags, the compiler, the jaxlib version and the CPU, so a cached library is never reused across
machines or versions; the build writes a temporary file and renames it (concurrent builds are safe).
``available()`` says whether the kernel can be built and loaded here; ``build_error()`` why not. Attention
``"auto"`` picks this backend on a CPU where it builds and the reference otherwise (``model/attention.py``,
logged once); asked for by name where it cannot be built, it raises ``RuntimeError`` with the reason.

Contract details beyond the reference's docstring: ``query_start_loc[0]`` is 0 (tokens before it give 0); a
``layer`` outside ``[0, L)`` is a runtime error (the reference would read clipped rows); a block id outside the
cache is clipped to it (never read out of bounds).

Numerics: float32 throughout (bf16 inputs are widened, the output rounded to nearest even), scores
max-subtracted; dot products sum in a fixed order of 16 interleaved partial sums, so results match the
reference to float32 rounding (about 1e-6 relative), not bit for bit.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

TARGET = "superinfer_cpu_paged_attention"
DENSE_TARGET = "superinfer_cpu_dense"   # pallas_kernels/cpu_dense.py's custom call, built into the same library
# Compiled together into one library: this kernel and the dense projection (cpu_dense.cc).
SOURCES = (Path(__file__).with_name("cpu_paged_attention.cc"), Path(__file__).with_name("cpu_dense.cc"))
HEADERS = (Path(__file__).with_name("cpu_workers.h"),)   # included by both; part of the library's cache key
_HANDLERS = ((TARGET, "SuperinferCpuPagedAttention"), (DENSE_TARGET, "SuperinferCpuDense"))
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


def _compiler() -> list[str] | None:
  """The C++ compiler command (``$CXX`` may carry arguments, e.g. ``ccache g++``), or None if none is found."""
  cxx = shlex.split(os.environ.get("CXX", ""))
  if cxx and shutil.which(cxx[0]):
    return [shutil.which(cxx[0]), *cxx[1:]]
  for name in ("c++", "g++", "clang++"):
    if shutil.which(name):
      return [shutil.which(name)]
  return None


_CPU_KEYS = frozenset(("vendor_id", "model name", "cpu family", "model", "flags",                      # x86
                       "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features"))  # arm


def _cpu_id() -> str:
  """Something that changes with the CPU model and its feature flags (``-march=native`` code is CPU-specific):
  the distinct identity lines of ``/proc/cpuinfo`` (not the clock, which moves)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      lines = sorted({ln.strip() for ln in f if ln.split(":")[0].strip() in _CPU_KEYS})
  except OSError:
    lines = []
  return "\n".join(lines) or f"{platform.machine()} {platform.processor()}"


def _cache_dir() -> Path:
  env = os.environ.get("SUPERINFER_KERNEL_CACHE")
  return Path(env) if env else Path.home() / ".cache" / "superinfer_jax" / "kernels"


def library_path() -> Path:
  """Where the built library lives for this source, compiler, jaxlib and CPU (may not exist yet)."""
  import jaxlib  # pylint: disable=import-outside-toplevel
  h = hashlib.sha256()
  for part in (*(src.read_bytes() for src in (*SOURCES, *HEADERS)), " ".join(FLAGS).encode(),
               str(_compiler()).encode(), jaxlib.__version__.encode(), _cpu_id().encode()):
    h.update(part)
    h.update(b"\0")
  return _cache_dir() / f"libsuperinfer_cpu-{h.hexdigest()[:16]}.so"


def build(force: bool = False) -> Path:
  """Compiles the kernel (if not cached, or ``force``) and returns the library's path. Raises on failure."""
  import jax  # pylint: disable=import-outside-toplevel
  out = library_path()
  if out.exists() and not force:
    return out
  cxx = _compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler found (set $CXX, or install g++) to build the CPU kernels")
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  os.close(fd)
  cmd = [*cxx, *FLAGS, "-isystem", jax.ffi.include_dir(), *map(str, SOURCES), "-o", tmp]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
      raise RuntimeError(f"building the CPU kernels failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out


_registered: list = []  # the loaded library, once its handler is registered with XLA (once per process)


@functools.cache
def _register() -> None:
  """Builds (or finds) the library and registers its handlers for the CPU platform; raises if either fails."""
  import jax  # pylint: disable=import-outside-toplevel
  path = build()
  if not _registered:
    lib = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in _HANDLERS:
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    _registered.append(lib)


@functools.cache
def build_error() -> str | None:
  """None if the kernel builds and registers here, else the reason (cached for the process)."""
  try:
    _register()
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"
  return None


def available() -> bool:
  return build_error() is None


def cpu_paged_attention(q, kv_cache, layer, block_tables, context_lens, query_start_loc, *, scale: float,
                        window=None):
  """``ragged_paged_attention_reference``'s contract (``pallas_kernels/reference.py``), run by the C++ kernel.

  Shapes: q ``[T, Hq, D]``, kv_cache ``[NB, L, 2, BS, Hkv, D]`` (each float32 or bfloat16), layer an int
  or int32 scalar, block_tables ``[S, MB]``, context_lens ``[S]``, query_start_loc ``[S + 1]`` (int32). Returns
  ``[T, Hq, D]`` in q's dtype. CPU only (the custom call is registered for the CPU platform).
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  err = build_error()
  if err is not None:
    raise RuntimeError(f"the cpu_kernel attention backend is unavailable: {err}")
  if jax.default_backend() != "cpu":
    raise RuntimeError(f"the cpu_kernel attention backend runs on XLA:CPU only (default backend: "
                       f"{jax.default_backend()}); use 'pallas' or 'reference'")
  if q.ndim != 3 or kv_cache.ndim != 6:
    raise ValueError(f"expected q [T,Hq,D] and kv_cache [NB,L,2,BS,Hkv,D], got {q.shape} and {kv_cache.shape}")
  if kv_cache.dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"kv_cache must be float32 or bfloat16, got {kv_cache.dtype}")
  if q.shape[1] % kv_cache.shape[4]:
    raise ValueError(f"query heads {q.shape[1]} not a multiple of kv heads {kv_cache.shape[4]}")
  q_in = q if q.dtype in (jnp.float32, jnp.bfloat16) else q.astype(jnp.float32)
  i32 = jnp.int32
  w = jnp.asarray(0 if window is None else window, i32).reshape(())
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_in.shape, q_in.dtype), vmap_method="sequential")
  out = call(q_in, kv_cache, jnp.asarray(layer, i32).reshape(()), block_tables.astype(i32),
             context_lens.astype(i32), query_start_loc.astype(i32), w, scale=np.float32(scale))
  return out.astype(q.dtype)
