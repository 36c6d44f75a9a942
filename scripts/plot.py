"""Figures (PNG) from any results directory: results.jsonl + requests-<policy>-<rps>.jsonl.

  python scripts/plot.py --results_dir=OUTPUT_DIR [--out_dir=OUTPUT_DIR/plots]

With two or more loads: SLO attainment and P99 TTFT/TBT vs RPS (means over repeats, min-max bars). At a
single load: attainment, latency and rotation bars per policy and repeat (perturbed runs hatched). Always:
TTFT/TBT CDFs per RPS (repeats pooled) and per-request timelines with rotations. The full list is in
superinfer_jax/metrics/plots.py. Prints the comparison table and the paths.
"""
import os

from absl import app, flags

from superinfer_jax.metrics import plots
from superinfer_jax.metrics.results import format_comparison_table, read_results

flags.DEFINE_string("results_dir", None, "directory with results.jsonl and requests-*.jsonl")
flags.DEFINE_string("out_dir", None, "where PNGs go (default: <results_dir>/plots)")
flags.DEFINE_integer("max_timeline_requests", 40, "requests shown per timeline figure")
flags.mark_flag_as_required("results_dir")


def main(argv):
  del argv
  f = flags.FLAGS
  out_dir = f.out_dir or os.path.join(f.results_dir, "plots")
  res = os.path.join(f.results_dir, "results.jsonl")
  if os.path.isfile(res):
    print(format_comparison_table(read_results(res)))
  paths = plots.plot_results_dir(f.results_dir, out_dir, max_timeline_requests=f.max_timeline_requests)
  print(f"wrote {len(paths)} figures to {out_dir}:")
  for p in paths:
    print("  " + p)


if __name__ == "__main__":
  app.run(main)
