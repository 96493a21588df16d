"""Figures of the code's own shape: how much training machinery there is, how many names are
defined twice, how far `import k3jax.model` reaches, and how many imports hide in functions.

  python -m experiments.code_figures --json=docs/results/code_figures_after.json

Every figure is read from the source (ast) or from a fresh interpreter, so two checkouts can be
compared by running the same command in each:
- `training_lines`: lines of the modules that hold training machinery (the train and
  post-training packages, and the EAGLE-3 experiment), per file and in total;
- `names_defined_twice`: public top-level functions and classes of `k3jax/` whose name is
  defined by more than one module (each with the modules);
- `model_import`: the k3jax modules a fresh `import k3jax.model` loads, and which of them belong
  to conversion, training, post-training or serving (none should);
- `function_local_imports`: import statements inside function bodies under `k3jax/`, per file.
"""

from __future__ import annotations

import ast
import collections
import json
import pathlib
import subprocess
import sys

from absl import app, flags

from experiments import results

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Training machinery, wherever a checkout keeps it (paths that do not exist count zero).
TRAINING = ("k3jax/train", "k3jax/rl", "k3jax/posttrain", "experiments/eagle.py")
UPWARD = ("k3jax.convert", "k3jax.train", "k3jax.posttrain", "k3jax.serve", "k3jax.serve",
          "k3jax.posttrain.rl")


def _py_files(rel: str) -> list[pathlib.Path]:
  p = ROOT / rel
  if p.is_file():
    return [p]
  return sorted(p.rglob("*.py")) if p.is_dir() else []


def training_lines() -> dict:
  files = {str(f.relative_to(ROOT)): len(f.read_text().splitlines())
           for rel in TRAINING for f in _py_files(rel)}
  return {"total": sum(files.values()), "files": files}


def names_defined_twice() -> dict:
  where = collections.defaultdict(list)
  for f in _py_files("k3jax"):
    tree = ast.parse(f.read_text(), str(f))
    for node in tree.body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (
          not node.name.startswith("_")):
        where[node.name].append(str(f.relative_to(ROOT)))
  twice = {k: v for k, v in sorted(where.items()) if len(v) > 1}
  return {"count": len(twice), "names": twice}


def model_import() -> dict:
  code = ("import sys, json; import k3jax.model; "
          "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'k3jax')))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True,
                       text=True).stdout
  mods = json.loads(out.strip().splitlines()[-1])
  upward = [m for m in mods if any(m == u or m.startswith(u + ".") for u in UPWARD)]
  return {"count": len(mods), "upward": upward, "modules": mods}


def function_local_imports() -> dict:
  """Import statements inside function bodies under k3jax/ (each counted once, however deeply
  nested), split into those of the project's own modules and those of other packages."""
  own, other, per_file = 0, 0, {}
  for f in _py_files("k3jax"):
    tree = ast.parse(f.read_text(), str(f))
    inside = {}
    for fn in ast.walk(tree):
      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        inside.update((id(x), x) for x in ast.walk(fn)
                      if isinstance(x, (ast.Import, ast.ImportFrom)))
    for x in inside.values():
      names = [a.name for a in x.names] if isinstance(x, ast.Import) else [x.module or ""]
      if any(n.split(".")[0] in ("k3jax", "pallas_kernels") for n in names) or (
          isinstance(x, ast.ImportFrom) and x.level):
        own += 1
      else:
        other += 1
    if inside:
      per_file[str(f.relative_to(ROOT))] = len(inside)
  return {"total": own + other, "project_modules": own, "other_packages": other,
          "files": per_file}


def figures() -> dict:
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True).stdout.strip()
  return {"commit": head, "training_lines": training_lines(),
          "names_defined_twice": names_defined_twice(), "model_import": model_import(),
          "function_local_imports": function_local_imports()}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  out = figures()
  print(f"training lines {out['training_lines']['total']}, names defined twice "
        f"{out['names_defined_twice']['count']}, modules of import k3jax.model "
        f"{out['model_import']['count']} ({len(out['model_import']['upward'])} upward), "
        f"function-local imports {out['function_local_imports']['total']} "
        f"({out['function_local_imports']['project_modules']} of k3jax modules)")
  if flags.FLAGS.json:
    results.write_json(flags.FLAGS.json, out, indent=1)


if __name__ == "__main__":
  flags.DEFINE_string("json", None, "Write the figures here.")
  app.run(main)
