"""The tool sandbox (k3jax/posttrain/rl/sandbox.py): runaway, hostile and normal code."""

import os
import socket
import time

import pytest

from k3jax.posttrain.rl.sandbox import Limits, run_python

FAST = Limits(cpu_seconds=1, wall_seconds=4, memory_bytes=256 * 2 ** 20,
              max_output_bytes=4096)
KERNEL_ONLY = Limits(cpu_seconds=1, wall_seconds=4, audit_hook=False, network_namespace=False)


def _kernel_layers() -> tuple[str, ...]:
  """The kernel layers this machine grants (a kernel or container may refuse Landlock, seccomp
  or namespaces; the sandbox then runs without them and says so in `Result.layers`). The checks
  of one layer alone run where it is granted; the outcome with every layer on is checked
  everywhere."""
  both = run_python("pass", Limits(cpu_seconds=1, wall_seconds=4, audit_hook=False)).layers
  return tuple(layer for layer in ("netns", "landlock", "seccomp") if layer in both)


KERNEL = _kernel_layers()


@pytest.fixture
def secret(tmp_path):
  path = tmp_path / "secret.txt"
  path.write_text("the caller's data")
  return str(path)


@pytest.fixture
def listener():
  srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  srv.bind(("127.0.0.1", 0))
  srv.listen(1)
  srv.settimeout(0.2)
  yield srv
  srv.close()


def _accepted(srv) -> bool:
  try:
    conn, _ = srv.accept()
  except (socket.timeout, BlockingIOError):
    return False
  conn.close()
  return True


def test_normal_code_returns_its_output_and_files_stay_inside():
  code = ("import json, math\nopen('note.txt', 'w').write(str(2 ** 100))\n"
          "print(open('note.txt').read(), math.factorial(20), json.dumps({'a': [1]}))\n"
          "import os; print(os.listdir('.'))")
  r = run_python(code, FAST)
  assert r.ok and r.kind == "ok" and r.message == "" and not r.truncated
  assert r.stdout == f"{2 ** 100} 2432902008176640000 {{\"a\": [1]}}\n['note.txt']\n"
  assert r.tool_text() == r.stdout
  assert "rlimits" in r.layers and "audit" in r.layers
  assert r.seconds < 3


def test_infinite_loop_stops_at_the_cpu_limit():
  t0 = time.perf_counter()
  r = run_python("while True:\n  pass", FAST)
  assert r.kind == "cpu_time" and "CPU-time limit of 1 s" in r.message
  assert time.perf_counter() - t0 < 3.5
  assert r.tool_text().startswith("error (cpu_time)")


def test_sleeping_code_is_killed_at_the_wall_clock_limit():
  r = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)",
                 Limits(wall_seconds=1.0))
  assert r.kind == "timeout" and "wall-clock limit of 1 s" in r.message
  assert r.stdout == "started\n" and 1.0 <= r.seconds < 2.5


def test_ten_gigabytes_is_refused_by_the_memory_limit():
  r = run_python("b = bytearray(10 * 10 ** 9)\nprint('allocated')", FAST)
  assert r.kind == "memory" and r.stdout == "" and "MemoryError" in r.message
  assert r.seconds < 3


def test_fork_bomb_stops_at_once():
  bomb = "import os\nwhile True:\n  os.fork()"
  r = run_python(bomb, FAST)
  assert r.kind == "refused" and "os.fork refused" in r.message and r.seconds < 3
  # The kernel layers alone (no audit hook): seccomp makes the first fork fail.
  r = run_python(bomb, KERNEL_ONLY)
  assert ("seccomp" in r.layers) == ("seccomp" in KERNEL), r.layers
  if "seccomp" in KERNEL:
    assert r.kind == "refused" and "Operation not permitted" in r.message and r.seconds < 3
  r = run_python("import subprocess\nsubprocess.run(['/bin/true'])", FAST)
  assert r.kind == "refused" and "subprocess.Popen" in r.message


def test_files_outside_the_directory_are_refused(secret):
  for path in (secret, "/etc/passwd"):
    r = run_python(f"print(open({path!r}).read())", FAST)
    assert r.kind == "refused" and f"open({path!r})" in r.message and r.stdout == ""
    r = run_python(f"print(open({path!r}).read())", KERNEL_ONLY)
    assert ("landlock" in r.layers) == ("landlock" in KERNEL), r.layers
    if "landlock" in KERNEL:
      assert r.kind == "refused" and "Permission denied" in r.message and r.stdout == ""
  r = run_python(f"import os\nos.listdir({os.path.dirname(secret)!r})", FAST)
  assert r.kind == "refused"
  r = run_python(f"import os\nos.symlink({secret!r}, 'link')\nprint(open('link').read())",
                 FAST)
  assert r.kind == "refused" and "os.symlink" in r.message
  with open(secret) as f:
    assert f.read() == "the caller's data"


def test_loopback_connection_is_refused(listener):
  port = listener.getsockname()[1]
  code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
          "s.sendall(b'hi')\nprint('connected')")
  r = run_python(code, FAST)
  assert r.kind == "refused" and "(no network)" in r.message and r.stdout == ""
  assert not _accepted(listener)
  # The network namespace alone makes 127.0.0.1 unreachable; seccomp alone refuses the socket.
  r = run_python(code, Limits(cpu_seconds=1, wall_seconds=4, audit_hook=False,
                              kernel_guards=False))
  if "netns" in KERNEL:
    assert r.layers == ("rlimits", "netns"), r.layers
    assert r.kind == "error" and "Network is unreachable" in r.message and r.stdout == ""
  if "seccomp" in KERNEL:
    r = run_python(code, KERNEL_ONLY)
    assert r.kind == "refused" and "Operation not permitted" in r.message
  assert not _accepted(listener)


def test_output_limit_truncates_and_errors_are_reported():
  r = run_python("while True:\n  print('x' * 100)", FAST)
  assert r.kind == "output_limit" and r.truncated and len(r.stdout) == 4096
  assert r.stdout == "x" * 100 + "\n" + r.stdout[101:]
  assert "[output truncated]" in r.tool_text()
  r = run_python("print('before')\n{}['missing']", FAST)
  assert r.kind == "error" and r.message == "KeyError: 'missing'" and r.stdout == "before\n"
  assert r.tool_text() == "before\n\nerror (error): KeyError: 'missing'"
  r = run_python("import ctypes", FAST)
  assert r.kind == "refused" and "import ctypes" in r.message


def test_limits_are_checked():
  with pytest.raises(ValueError, match="Limits.cpu_seconds"):
    Limits(cpu_seconds=0)
  with pytest.raises(ValueError, match="Limits.wall_seconds"):
    Limits(wall_seconds=0)
