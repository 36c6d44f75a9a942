"""configtree.define_flags: one definition per flag name on a FlagValues."""
import dataclasses

import pytest
from absl import flags

from superinfer_jax import configtree
from superinfer_jax.configtree import knob, subtree


@dataclasses.dataclass(frozen=True)
class Inner:
  alpha: float = knob(0.5, "weight")


@dataclasses.dataclass(frozen=True)
class TreeA:
  seed: int = knob(0, "seed of A")
  inner: Inner = subtree(Inner)


@dataclasses.dataclass(frozen=True)
class TreeB:
  seed: int = knob(7, "seed of B")


@dataclasses.dataclass(frozen=True)
class TreeC:
  inner: Inner = subtree(Inner)
  beta: int = knob(3, "beta")


def test_second_definition_of_a_name_raises_naming_both_owners():
  fv = flags.FlagValues()
  configtree.define_flags(TreeA, fv)
  with pytest.raises(flags.DuplicateFlagError) as e:
    configtree.define_flags(TreeB, fv)
  msg = str(e.value)
  assert "--seed" in msg and "TreeA.seed" in msg and "TreeB.seed" in msg
  assert fv["seed"].default == 0   # the first definition is untouched


def test_name_taken_by_a_plain_flag_raises():
  fv = flags.FlagValues()
  flags.DEFINE_integer("seed", 1, "a script's own seed", flag_values=fv)
  with pytest.raises(flags.DuplicateFlagError, match="TreeB.seed"):
    configtree.define_flags(TreeB, fv)


def test_same_tree_twice_and_shared_subtree_class_are_no_ops():
  fv = flags.FlagValues()
  configtree.define_flags(TreeA, fv)
  configtree.define_flags(TreeA, fv)
  configtree.define_flags(TreeC, fv)   # Inner.alpha is the same setting: defined once
  fv(["prog", "--alpha=0.25", "--beta=4"])
  assert configtree.from_flags(TreeA, fv).inner.alpha == 0.25
  assert configtree.from_flags(TreeC, fv) == TreeC(Inner(0.25), 4)


def test_only_defines_a_subset_registered_under_its_owner():
  fv = flags.FlagValues()
  with pytest.raises(KeyError, match="nope"):
    configtree.define_flags(TreeA, fv, only={"nope"})
  configtree.define_flags(TreeA, fv, only={"alpha"})
  assert "alpha" in fv and "seed" not in fv
  assert fv.find_module_defining_flag("alpha") == f"{__name__}.Inner"
  configtree.define_flags(TreeA, fv)   # the rest of the tree joins; alpha is the same setting
  assert fv.find_module_defining_flag("seed") == f"{__name__}.TreeA"
