"""experiments/bench_decode.py --hybrid_prefill: a chunked prefill of the tiny hybrid through
the serving path, end to end as a script; --prefill_overrides reaches the model (the cache
the run reports shrinks with the MLA's latent width) and a malformed one names its flag."""

import json
import subprocess
import sys

from cli_env import ROOT, cli_env


def _run(tmp_path, name, *extra):
  out = tmp_path / f"{name}.json"
  r = subprocess.run(
      [sys.executable, "-m", "experiments.bench_decode", "--hybrid_prefill=96",
       "--long_chunk=32", "--prefill_key_block=16", f"--json_out={out}", *extra],
      cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
  return r, out


def test_hybrid_prefill_with_overrides(tmp_path):
  r, out = _run(tmp_path, "narrow", "--prefill_overrides=num_heads=1,kv_lora_rank=8,"
                "qk_rope_head_dim=4,num_mtp_layers=0")
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())
  assert res["overrides"] == {"num_heads": 1, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
                              "num_mtp_layers": 0}
  assert (res["chunk"], res["mla_key_block"]) == (32, 16)
  [row] = res["rows"]
  assert row["tokens"] == 96 and row["seconds"] > 0
  # One MLA layer, bf16 latents: (kv_lora_rank + rope) numbers a slot. The run's cache is
  # the default's less what the narrower latent and the dropped MTP layer's cache held.
  r0, out0 = _run(tmp_path, "default")
  assert r0.returncode == 0, r0.stderr[-3000:]
  [row0] = json.loads(out0.read_text())["rows"]
  slots = 96
  assert row0["cache_bytes"] - row["cache_bytes"] >= slots * 2 * ((32 + 8) - (8 + 4))


def test_malformed_overrides_name_the_flag(tmp_path):
  r, out = _run(tmp_path, "bad", "--prefill_overrides=num_heads")
  assert r.returncode != 0 and not out.exists()
  assert "--prefill_overrides: expected field=value pairs, found 'num_heads'" in r.stderr
