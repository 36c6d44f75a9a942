"""One config tree, one flag per setting: absl flags generated from frozen dataclass fields.

Every setting is declared once, as a dataclass field made with ``knob(default, help, ...)``: its name is the
flag's name, its default the flag's default, its help the flag's help. A field whose type is itself a config
dataclass is a subtree (``EngineConfig.scheduler``, ``.rotation``, ``.model``); flags are flat (no prefix), so
names must be unique across the tree (checked when flags are defined), and ``define_flags`` raises when a
flag name is already defined on the ``FlagValues`` by anything but the same setting.

Metadata a ``knob`` may carry:
  * ``choices``: a tuple, or a callable returning one (so the owning package's registry is read lazily):
    the flag becomes an enum and the config rejects other values.
  * ``none_as``: the flag value that stands for ``None`` (e.g. 0 for "unset"), for ``Optional`` fields.
  * ``flag``: a different flag name (when the field name would clash with a script's own flag).

Pure Python (absl is imported only by the flag functions): the simulator can build configs without JAX.
"""
from __future__ import annotations

import dataclasses
import typing
import weakref
from typing import Any, Callable, Iterable, Iterator


def knob(default: Any, help: str, *, choices: tuple | Callable[[], tuple] | None = None,  # noqa: A002
         none_as: Any = None, flag: str | None = None) -> Any:
  """A config field with the metadata the flag generator reads (see the module docstring)."""
  meta = {"help": help}
  if choices is not None:
    meta["choices"] = choices
  if none_as is not None:
    meta["none_as"] = none_as
  if flag is not None:
    meta["flag"] = flag
  return dataclasses.field(default=default, metadata=meta)


def subtree(cls) -> Any:
  """A nested config field (default: the subtree's defaults)."""
  return dataclasses.field(default_factory=cls, metadata={"subtree": True})


def choices_of(f: dataclasses.Field) -> tuple | None:
  c = f.metadata.get("choices")
  return tuple(c()) if callable(c) else (tuple(c) if c is not None else None)


def check_choices(cfg) -> None:
  """Raises ``ValueError`` naming the field whose value is not one of its ``choices``."""
  for f in dataclasses.fields(cfg):
    c = choices_of(f)
    if c is not None and getattr(cfg, f.name) not in c:
      raise ValueError(f"{type(cfg).__name__}.{f.name}: unknown value {getattr(cfg, f.name)!r}; "
                       f"choose one of {', '.join(map(str, c))}")


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One setting of a config tree: where it lives and how its flag looks."""
  path: tuple[str, ...]      # attribute path from the root, e.g. ("scheduler", "alpha")
  field: dataclasses.Field
  type: Any                  # resolved annotation

  @property
  def flag_name(self) -> str:
    return self.field.metadata.get("flag", self.field.name)


def _is_subtree(f: dataclasses.Field, tp) -> bool:
  return bool(f.metadata.get("subtree")) or (isinstance(tp, type) and dataclasses.is_dataclass(tp))


def leaves(cls, prefix: tuple[str, ...] = ()) -> Iterator[Leaf]:
  """Every setting of the tree rooted at ``cls`` (depth first, in field order)."""
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    tp = hints[f.name]
    if _is_subtree(f, tp):
      yield from leaves(tp, prefix + (f.name,))
    else:
      yield Leaf(prefix + (f.name,), f, tp)


def base_type(tp) -> tuple[type, bool]:
  """(int|float|bool|str, optional?) of an annotation like ``Optional[int]`` or ``int | None``."""
  args = typing.get_args(tp)
  if args and type(None) in args:
    rest = [a for a in args if a is not type(None)]
    return rest[0], True
  return tp, False


def flat_index(cls) -> dict[str, Leaf]:
  """Setting name -> leaf; raises if two settings share a name."""
  out: dict[str, Leaf] = {}
  for leaf in leaves(cls):
    name = leaf.field.name
    if name in out:
      raise ValueError(f"config tree {cls.__name__}: setting {name!r} appears twice "
                       f"({'.'.join(out[name].path)} and {'.'.join(leaf.path)})")
    out[name] = leaf
  return out


def build(cls, flat: dict[str, Any], base=None):
  """A ``cls`` tree from flat ``name=value`` settings (unknown names raise ``TypeError``); unset settings
  come from ``base`` (default: the defaults)."""
  index = flat_index(cls)
  unknown = sorted(set(flat) - set(index))
  if unknown:
    raise TypeError(f"{cls.__name__}: unknown setting(s) {', '.join(unknown)}")
  return _build(cls, flat, base, ())


def _build(cls, flat: dict[str, Any], base, prefix: tuple[str, ...]):
  hints = typing.get_type_hints(cls)
  kwargs = {}
  changed = False
  for f in dataclasses.fields(cls):
    tp = hints[f.name]
    if _is_subtree(f, tp):
      sub_base = getattr(base, f.name) if base is not None else None
      kwargs[f.name] = _build(tp, flat, sub_base, prefix + (f.name,))
      changed = changed or sub_base is None or kwargs[f.name] is not sub_base
    elif f.name in flat:
      kwargs[f.name] = flat[f.name]
      changed = True
    elif base is not None:
      kwargs[f.name] = getattr(base, f.name)
  if base is not None and not changed:
    return base
  return cls(**kwargs)


def as_flat_dict(cfg) -> dict[str, Any]:
  """Every setting of a config tree as ``name -> value`` (for results rows and ``config.json``)."""
  out = {}
  for leaf in leaves(type(cfg)):
    v = cfg
    for p in leaf.path:
      v = getattr(v, p)
    out[leaf.field.name] = v
  return out


# ------------------------------------------------------------------------------------------------ absl
_OWNERS: "weakref.WeakKeyDictionary[Any, dict[str, str]]" = weakref.WeakKeyDictionary()


def owner_of(leaf: Leaf, cls) -> str:
  """The dataclass that declares ``leaf``, as ``module.QualName`` (``cls`` is the tree's root)."""
  owner = cls
  for p in leaf.path[:-1]:
    owner = typing.get_type_hints(owner)[p]
  return f"{owner.__module__}.{owner.__qualname__}"


def define_flags(cls, flag_values=None, only: Iterable[str] | None = None) -> None:
  """Defines one absl flag per setting of the tree rooted at ``cls`` on ``flag_values`` (default ``FLAGS``).

  Each setting has exactly one definition. A flag name that ``flag_values`` already holds raises
  ``flags.DuplicateFlagError`` naming the flag, the dataclass that declares the new setting and the existing
  definition's owner (its dataclass when ``define_flags`` defined it, else the module that did), unless that
  existing flag *is* this same setting (same field of the same dataclass): defining one tree twice on the same
  ``FlagValues``, or two trees that nest the same subtree class, is a no-op for
  the shared settings. ``only`` (flag names) defines just
  those settings of the tree, for a script that reads a few of them (``--model`` of ``SweepSpec``); an unknown
  name raises ``KeyError``. Each flag is registered under its owner (``module.Class``), so ``--helpfull`` lists
  the settings grouped by the dataclass that declares them. Never modifies a flag that is already defined.
  """
  from absl import flags  # pylint: disable=import-outside-toplevel
  fv = flags.FLAGS if flag_values is None else flag_values
  index = flat_index(cls)
  owners = _OWNERS.setdefault(fv, {})
  if only is not None:
    only = set(only)
    unknown = sorted(only - {leaf.flag_name for leaf in index.values()})
    if unknown:
      raise KeyError(f"{cls.__name__}: no setting(s) {', '.join(unknown)}")
  for leaf in index.values():
    name = leaf.flag_name
    if only is not None and name not in only:
      continue
    owner_class = owner_of(leaf, cls)
    owner = f"{owner_class}.{leaf.field.name}"
    if name in fv:
      if owners.get(name) == owner:
        continue
      theirs = owners.get(name) or f"a flag defined in {fv.find_module_defining_flag(name, 'an unknown module')}"
      raise flags.DuplicateFlagError(
          f"flag --{name} is defined twice: by setting {owner} and by {theirs}; each setting has one owner")
    owners[name] = owner
    _define_one(flags, fv, leaf, owner_class)


def _define_one(flags, fv, leaf: Leaf, owner_class: str) -> None:
  """Defines the absl flag of one setting ``leaf`` on ``fv``, registered under ``owner_class``: an enum for a
  field with choices, else a bool / integer / float / string flag by the field's base type, its default the
  field's (``none_as`` for a None default) and its help the field's ``help`` metadata. ``TypeError`` for
  any other type. ``flags`` is the absl ``flags`` module."""
  name = leaf.flag_name
  f = leaf.field
  base, optional = base_type(leaf.type)
  default = f.default
  if default is None:
    default = f.metadata.get("none_as")
  help_text = f.metadata["help"]
  if optional and "none_as" in f.metadata:
    help_text += f" ({f.metadata['none_as']!r}: unset)"
  c = choices_of(f)
  kw = dict(flag_values=fv, module_name=owner_class)
  if c is not None:
    flags.DEFINE_enum(name, default, list(c), help_text, **kw)
  elif base is bool:
    flags.DEFINE_bool(name, default, help_text, **kw)
  elif base is int:
    flags.DEFINE_integer(name, default, help_text, **kw)
  elif base is float:
    flags.DEFINE_float(name, default, help_text, **kw)
  elif base is str:
    flags.DEFINE_string(name, default, help_text, **kw)
  else:
    raise TypeError(f"no flag type for setting {name!r} of type {leaf.type!r}")


def from_flags(cls, flag_values=None):
  """Builds the ``cls`` tree from parsed flags (see ``define_flags``); ``ValueError`` for bad values."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  fv = flags.FLAGS if flag_values is None else flag_values
  flat = {}
  for name, leaf in flat_index(cls).items():
    v = getattr(fv, leaf.flag_name)
    _, optional = base_type(leaf.type)
    if optional and "none_as" in leaf.field.metadata and v == leaf.field.metadata["none_as"]:
      v = None
    flat[name] = v
  return build(cls, flat)
