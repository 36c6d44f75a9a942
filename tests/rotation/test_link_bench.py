"""rotation/link_bench.py: the Table 1 report's arithmetic on hand-worked timings, and the script's --table1
report on CPU at tiny sizes (every mode, the paper's columns, numbers consistent with the bytes moved)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from superinfer_jax.rotation import MODES
from superinfer_jax.rotation.link_bench import format_table1, table1_rows

ROOT = pathlib.Path(__file__).resolve().parents[2]
GB = 1e9


def test_rows_by_hand():
  b = 8 * GB   # bytes each way
  times = {"merged": {"d2h": 0.1, "h2d": 0.05, "both": 0.15},
           "duplex": {"d2h": 0.04, "h2d": 0.04, "both": 0.05},
           "torch": {"d2h": 0.05, "h2d": 0.05, "both": 0.04}}
  rows = {r.mode: r for r in table1_rows(times, int(b), {"merged": 4}, n=8)}
  assert list(rows) == ["merged", "duplex", "torch", "ideal"]
  m, d, t, ideal = rows["merged"], rows["duplex"], rows["torch"], rows["ideal"]
  assert (m.d2h_gbps, m.h2d_gbps, m.total_ms) == pytest.approx((80, 160, 150))   # serialized: each alone
  assert (d.d2h_gbps, d.h2d_gbps, d.total_ms) == pytest.approx((160, 160, 50))   # duplex: while both busy
  assert (ideal.d2h_gbps, ideal.total_ms) == pytest.approx((200, 40))             # torch's both-ways run
  assert m.pct_of_ideal == pytest.approx(100 * 40 / 150) and t.pct_of_ideal == pytest.approx(100)
  assert "scaled to 8" in m.note and d.note == ""
  text = format_table1(list(rows.values()), "T")
  assert text.splitlines()[2] == "| mode | D2H GB/s | H2D GB/s | total ms | % of ideal | note |"
  assert "| duplex | 160.00 | 160.00 | 50.00 | 80.0 |  |" in text


@pytest.mark.slow
def test_table1_report_on_cpu(tmp_path):
  out = tmp_path / "t1"
  cmd = [sys.executable, str(ROOT / "scripts" / "bench_transfer.py"), "--table1", "--table1_model=smollm2-135m",
         "--table1_tokens=64", "--reps=1", "--warmup=1", "--naive_max_blocks=2", f"--table1_out={out}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "| mode | D2H GB/s | H2D GB/s | total ms | % of ideal | note |" in proc.stdout
  assert "torch: n/a" in proc.stdout
  rep = json.loads((tmp_path / "t1.json").read_text())
  assert (tmp_path / "t1.table.md").read_text().startswith("Table 1 on ")
  block_bytes = 2 * 30 * 16 * 3 * 64 * 2
  assert rep["blocks"] == 4 and rep["block_bytes"] == block_bytes
  rows = {r["mode"]: r for r in rep["rows"]}
  assert list(rows) == list(MODES) + ["ideal"]
  for r in rows.values():
    assert r["d2h_gbps"] > 0 and r["h2d_gbps"] > 0 and r["total_ms"] > 0
    assert 0 < r["pct_of_ideal"] <= 100 + 1e-9
  assert rows["ideal"]["total_ms"] == pytest.approx(min(r["total_ms"] for m, r in rows.items() if m != "ideal"))
  bytes_each_way = 4 * block_bytes
  assert rows["duplex"]["d2h_gbps"] == pytest.approx(bytes_each_way / (rows["duplex"]["total_ms"] / 1e3) / 1e9,
                                                     rel=1e-6)
  assert rows["naive"]["blocks_measured"] == 2 and "scaled to 4" in rows["naive"]["note"]
