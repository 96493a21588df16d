"""experiments/results.py: JSON written whole (folder made, a newline at the end, no temporary
file left), and an object that cannot be written leaves the old file as it was."""

import json

import pytest

from experiments import results


def test_write_json_writes_whole_files(tmp_path):
  path = tmp_path / "new" / "r.json"
  results.write_json(path, {"a": [1, 2], "b": "ü"})
  assert path.read_text() == '{"a": [1, 2], "b": "\\u00fc"}\n'
  results.write_json(str(path), {"b": "ü"}, indent=2, ensure_ascii=False)
  assert path.read_text() == '{\n  "b": "ü"\n}\n'
  assert json.loads(path.read_text()) == {"b": "ü"}
  assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_an_unwritable_object_leaves_the_old_file(tmp_path):
  path = tmp_path / "r.json"
  results.write_json(path, {"ok": 1})
  with pytest.raises(TypeError):
    results.write_json(path, {"bad": object()})
  assert json.loads(path.read_text()) == {"ok": 1}
  assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
