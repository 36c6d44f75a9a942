"""Times the prefix-cache index under churn: ``BlockPool.publish_many`` on a pool whose every block is published,
the way a full host tier turns over (its oldest cached blocks evicted for new copies, each published under a new
content hash).

Setup: a ``BlockPool`` of ``--pool_blocks`` blocks (default 262144: about a GH200's host memory of 16-token KV
blocks for an 8B model), every block published; then ``--churn_steps`` steps, each releasing the
``--blocks_per_step`` oldest-taken blocks (to the LRU: they stay published), taking as many (a take evicts the
oldest: their keys leave the index) and publishing those under fresh keys. Only the ``publish_many`` call is
timed. Deleted keys leave their dict slots used until the dict is rebuilt (CPython rebuilds a dict once its
deleted slots use up its table): ``max_ms`` shows that rebuild, O(pool) in one call, ``median_ms`` the steady
cost.

  python scripts/bench_prefix_index.py

prints one JSON line ``{"pool_blocks", "blocks_per_step", "steps", "median_ms", "p99_ms", "max_ms"}``. Run it
on two trees to compare them.
"""
import json
import time

from absl import app, flags

from superinfer_jax.kv.block_pool import BlockPool
from superinfer_jax.kv.pairs import HOST_IDS
from superinfer_jax.kv.prefix_hash import id_block_hashes

flags.DEFINE_integer("pool_blocks", 262144, "blocks in the pool (every one published)")
flags.DEFINE_integer("churn_steps", 2000, "timed steps")
flags.DEFINE_integer("blocks_per_step", 256, "blocks evicted and published again under new keys per step")
F = flags.FLAGS


def main(argv):
  del argv
  n, per, steps = F.pool_blocks, F.blocks_per_step, F.churn_steps
  if n < 1 or not 1 <= per <= n or steps < 1:
    raise app.UsageError(f"need pool_blocks >= 1, 1 <= blocks_per_step <= pool_blocks, churn_steps >= 1 "
                         f"(got {n}, {per}, {steps})")
  pool = BlockPool(0, n, HOST_IDS)
  keys = iter(id_block_hashes(range(n + steps * per)))
  owned = pool.take(n)
  pool.publish_many(owned, [next(keys) for _ in range(n)])
  times = []
  for _ in range(steps):
    pool.release(owned[:per])  # published, nobody else owns them: to the LRU's tail
    del owned[:per]
    fresh = pool.take(per)  # evicts the LRU's oldest
    owned += fresh
    new_keys = [next(keys) for _ in range(per)]
    t0 = time.perf_counter()
    pool.publish_many(fresh, new_keys)
    times.append(time.perf_counter() - t0)
  times.sort()
  print(json.dumps({"pool_blocks": n, "blocks_per_step": per, "steps": steps,
                    "median_ms": round(1e3 * times[len(times) // 2], 4),
                    "p99_ms": round(1e3 * times[min(len(times) - 1, int(0.99 * len(times)))], 4),
                    "max_ms": round(1e3 * times[-1], 4)}))


if __name__ == "__main__":
  app.run(main)
