"""The import graph of `k3jax/` and `pallas_kernels/` (DESIGN.md, "which way imports go"),
read from the source with `ast`: every import statement counts, top-level or inside a function
(a lazy import hides a dependency from Python, not from the reader)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("k3jax", "pallas_kernels")


def _modules() -> dict[str, pathlib.Path]:
  """{dotted name: path} of every module of PACKAGES (a package is its __init__.py)."""
  out = {}
  for pkg in PACKAGES:
    for path in sorted((ROOT / pkg).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


def _imported_names(name: str, path: pathlib.Path, modules) -> set[str]:
  """Dotted names a module imports: `import a.b` → a.b; `from a import b` → a.b when that is
  a module, else a (b is an attribute of a); relative imports resolved against the package."""
  package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package[:len(package) - node.level + 1] + ([node.module] if node.module else [])
        src = ".".join(base)
      else:
        src = node.module
      for a in node.names:
        sub = f"{src}.{a.name}"
        out.add(sub if sub in modules else src)
  return out


def _graph() -> dict[str, set[str]]:
  """{module: modules of PACKAGES it imports} (names outside PACKAGES dropped; a name below a
  module, e.g. a class path, is cut back to the module)."""
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    edges = set()
    for target in _imported_names(name, path, modules):
      while target not in modules and "." in target:
        target = target.rsplit(".", 1)[0]
      if target in modules and target != name:
        edges.add(target)
    graph[name] = edges
  return graph


GRAPH = _graph()


def _find_cycle(graph) -> list[str] | None:
  """One import cycle as [m0, m1, …, m0], or None (iterative depth-first search)."""
  state = {}   # absent: unvisited; 1: on the current path; 2: done
  for start in graph:
    if start in state:
      continue
    path, stack = [start], [iter(sorted(graph[start]))]
    state[start] = 1
    while stack:
      nxt = next(stack[-1], None)
      if nxt is None:
        state[path.pop()] = 2
        stack.pop()
      elif state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      elif nxt not in state:
        state[nxt] = 1
        path.append(nxt)
        stack.append(iter(sorted(graph[nxt])))
  return None


def test_graph_is_read():
  # The parser sees the edges it should (guards the test against reading nothing).
  assert "k3jax.ops.moe" in GRAPH["pallas_kernels.moe_gmm"]
  assert "k3jax.config" in GRAPH["k3jax.hf_config"]
  assert "k3jax.layers.backend" in GRAPH["k3jax.layers.moe"]
  # The layer that chooses a kernel imports it (the ops never do).
  assert {"pallas_kernels.moe_gmm", "pallas_kernels.kda_chunk"} <= GRAPH["k3jax.layers.backend"]


def test_find_cycle_finds_one():
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) in (
      ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"])
  assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
  assert _find_cycle(GRAPH) is None, " → ".join(_find_cycle(GRAPH))


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("k3jax.ops")))
def test_ops_never_import_kernels(module):
  # An op that can run a kernel takes it as an argument (k3jax/layers/backend.py chooses).
  assert not {m for m in GRAPH[module] if m.split(".")[0] == "pallas_kernels"}


def test_sharding_imports_nothing_above_it():
  # The mesh and the logical-axis table sit below everything that shards.
  assert {m for m in GRAPH["k3jax.sharding"] if m.split(".")[0] == "k3jax"} <= {
      "k3jax.tree_paths"}


# The rooms of the library, lowest first (DESIGN.md): a module may import its own room and the
# rooms listed before it, never one after it — except that serving sits beside training (both
# on the model) and post-training on both.
MODEL_ROOMS = ("k3jax.config", "k3jax.hf_config", "k3jax.tree_paths", "k3jax.sharding",
               "k3jax.runtime", "k3jax.ops", "k3jax.quant", "k3jax.parallel", "k3jax.layers",
               "k3jax.vision", "k3jax.cache", "k3jax.model")
UPPER = {  # room → the rooms above the model it may import
    "k3jax.data": set(),
    "k3jax.convert": set(),
    "k3jax.train": {"k3jax.data", "k3jax.convert"},
    "k3jax.serve": {"k3jax.data", "k3jax.convert"},
    "k3jax.posttrain": {"k3jax.data", "k3jax.convert", "k3jax.train", "k3jax.serve"},
}


def _room(module: str) -> str:
  for room in MODEL_ROOMS + tuple(UPPER):
    if module == room or module.startswith(room + "."):
      return room
  return module


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("k3jax.")))
def test_imports_go_downward(module):
  room = _room(module)
  allowed = set(MODEL_ROOMS) | {room} | UPPER.get(room, set())
  upward = sorted(m for m in GRAPH[module]
                  if m.startswith("k3jax.") and m != "k3jax" and _room(m) not in allowed)
  assert not upward, f"{module} ({room}) imports {upward}"


def test_importing_the_model_loads_nothing_above_it():
  import subprocess
  import sys
  code = ("import sys, k3jax.model; print(sorted(m for m in sys.modules "
          "if m.split('.')[0] == 'k3jax'))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       check=True, env={"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
  loaded = eval(out.stdout.strip().splitlines()[-1])   # noqa: S307 - our own printed list
  assert "k3jax.model" in loaded
  above = [m for m in loaded if _room(m) in UPPER]
  assert not above, f"import k3jax.model loads {above}"
