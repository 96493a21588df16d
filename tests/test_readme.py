"""Every ```python block of README.md runs as written: each in a fresh namespace, in this
process (CPU, as conftest.py sets it up), one test per block."""

import os
import re

import pytest

from cli_env import ROOT

README = os.path.join(ROOT, "README.md")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
  with open(README, encoding="utf-8") as f:
    text = f.read()
  out = []
  for m in BLOCK.finditer(text):
    line = text.count("\n", 0, m.start()) + 2          # 1-based line of the block's first line
    out.append(pytest.param(m.group(1), line, id=f"README.md:{line}"))
  return out


BLOCKS = _blocks()


def test_readme_has_python_blocks():
  assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code,line", BLOCKS)
def test_readme_block_runs(code, line, monkeypatch):
  monkeypatch.chdir(ROOT)
  namespace = {"__name__": f"readme_block_{line}"}
  # padded so that a traceback's line numbers are README.md's
  exec(compile("\n" * (line - 1) + code, README, "exec"), namespace)   # noqa: S102
