"""experiments/generate.py from its flags: greedy generation and MTP speculative decoding on a
random `tiny` model (byte tokenizer) write the same tokens; bad flags are refused."""

import json

import pytest
from absl import flags

from experiments import generate as cli

FLAGS = flags.FLAGS


def _run(tmp_path, name, *extra):
  out = tmp_path / f"{name}.json"
  FLAGS.unparse_flags()
  FLAGS(["generate", "--preset=tiny", "--prompt=K3 says", "--max_new_tokens=5",
         "--temperature=0", "--stop_token=-1", f"--output_json={out}", *extra])
  try:
    cli.main([])
  finally:
    FLAGS.unparse_flags()
  return json.loads(out.read_text())


def test_greedy_and_speculative_write_the_same_tokens(tmp_path, capsys):
  plain = _run(tmp_path, "plain")
  spec = _run(tmp_path, "spec", "--speculative")
  assert plain["prompt_tokens"] == list(b"K3 says")
  assert len(plain["tokens"]) == 5 and all(0 <= t < 272 for t in plain["tokens"])
  assert spec["tokens"] == plain["tokens"]          # speculative greedy is plain greedy
  assert "acceptance rate" in capsys.readouterr().err


def test_bad_flags(tmp_path):
  FLAGS.unparse_flags()
  FLAGS(["generate", "--preset=tiny"])
  try:
    with pytest.raises(ValueError, match="--prompt"):
      cli.main([])
  finally:
    FLAGS.unparse_flags()
