"""Tensor parallelism on a ``jax.sharding.Mesh`` and multi-host launch through ``jax.distributed``.

Modules (docs/parallel.md is the user's guide):

* ``mesh``: the 1-D ``"tp"`` mesh over ``tensor_parallel_size`` devices; replicated shardings; global puts.
* ``sharding``: Megatron partition specs of the stacked params (heads; MLP columns then rows; embedding
  and LM head by vocab) and KV-head replication when ``num_kv_heads`` is not a multiple of TP.
* ``attention``: ``ShardedAttention``, an attention backend called per shard through ``shard_map`` (the
  Pallas kernel is a custom call SPMD cannot partition), passed as ``forward()``'s ``attention``.
* ``kv``: the head-sharded paged KV cache and the sharding of one rotated block.
* ``tensor_parallel``: ``TensorParallel``, the one object the engine and ``model.api`` talk to.
* ``distributed``: ``jax.distributed.initialize`` from flags / env, the shared script flags, and the
  replicated-scheduling guard (shared clock + plan digest) that keeps every process's plan identical.
* ``events``: ``EventChannel``, process 0's broadcast of each engine iteration's new requests and aborts
  to every process (multi-host serving; ``serving/worker.py`` applies them).

Nothing here changes the TP=1 path: with ``tensor_parallel_size=1`` the engine never builds a mesh.
The package imports nothing itself: ``distributed`` (flags, ``initialize``) imports no JAX at module level,
so scripts define its flags before JAX starts; import the other modules directly.
"""
