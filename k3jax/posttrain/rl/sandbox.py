"""A sandbox for tool code in RL rollouts: Python code run in a separate, limited process.

    result = run_python("print(2**100)", Limits(wall_seconds=5))
    result.ok, result.stdout, result.kind, result.message, result.truncated, result.seconds

Each call runs `sys.executable -I -c BOOTSTRAP` (isolated mode: no PYTHON* variables, no user
site, neither the cwd nor a script directory on sys.path) in a new session (its own process
group), with a fresh temporary directory as its cwd (mode 0700, removed afterwards whatever
happened), a minimal environment (PATH, LANG, HOME = TMPDIR = that directory), no inherited
file descriptors but stdin (empty) / stdout / stderr. The parent reads the output under
`max_output_bytes` and kills the whole process group (SIGKILL) at the wall-clock limit, when
the output overflows, and after every run (strays). The bootstrap, before the tool's code
runs, sets up these layers; `Result.layers` names those in force, since each but the first
is tried and skipped cleanly where the machine refuses it:

1. "rlimits" (always): RLIMIT_CPU (CPU seconds; SIGXCPU ends the process), RLIMIT_AS
   (address space: a large allocation raises MemoryError), RLIMIT_FSIZE (largest file written;
   SIGXFSZ ignored, so the write fails), RLIMIT_NOFILE, RLIMIT_CORE = 0, RLIMIT_NPROC (the
   kernel enforces it only for non-root users: as root the next layers stop forks).
2. "netns": `unshare(CLONE_NEWUSER | CLONE_NEWNET)` through ctypes (allowed where
   unprivileged user namespaces are, or as root), its own uid/gid mapped. The process then
   lives in a network namespace whose only device, loopback, is down: no address — outside
   the machine or the caller's own loopback ports — is reachable, whatever the code does.
3. "landlock" (Linux ≥ 5.13 with Landlock enabled; unprivileged): a filesystem ruleset —
   every access under the temporary directory, read (and execute, for extension modules)
   under the standard library and the system library dirs (/lib, /usr/lib, …), read
   /dev/urandom, read/write /dev/null; every other open, create, remove, rename, link or
   directory listing fails with EACCES. Kernel-enforced, cannot be lifted by the process.
4. "seccomp" (x86-64; unprivileged with no_new_privs): a BPF filter on system calls —
   fork, vfork, clone without CLONE_THREAD, execve, execveat, socket, ptrace, unshare, setns
   and mount fail with EPERM (clone3 with ENOSYS, so threads fall back to clone and still
   work); syscalls of another ABI (x32 numbers) get EPERM, of another architecture kill the
   process. So no new process (a fork bomb stops at its first fork), no program, no socket.
5. "audit": a `sys.addaudithook` hook (it cannot be removed once added) that refuses with
   `PermissionError("sandbox: … refused (why)")`: every `socket.*` event (creation, connect,
   bind, getaddrinfo, …); `open` / `os.open` of a path outside the temporary directory except
   reading the standard library and /dev/null, /dev/urandom; listing, creating, removing,
   renaming, linking or changing files outside it; symlinks; `os.chdir` / `chroot`;
   `os.fork` / `forkpty` / `posix_spawn` / `spawn*` / `exec*` / `system` / `kill` /
   `subprocess.Popen`; importing `ctypes` / `_ctypes` and ctypes' native calls; `mmap`;
   `sys.addaudithook`.

What each layer guarantees. 1–4 are enforced by the kernel and hold against any code,
including code that corrupts the interpreter's memory. 5 is a Python-level guard: it turns
every ordinary way of reaching a file, a socket or a process into a clear error message, but
alone it is not a security boundary (code that escapes the interpreter bypasses it). Where the
kernel layers are in force (this project's machines: all four) the isolation is theirs; where
3 is missing, file isolation rests on 5 alone; where both 2 and 4 are missing, network
isolation does; where 4 is missing and the sandbox runs as root, process limits do. For the
policy's tool calls in RL — code a small model writes, not an adversary — every failure is
reported as a tool error and the caller goes on.

Result kinds: "ok" (exit 0), "error" (an exception in the code; message = its last line),
"refused" (an operation refused: the audit hook, or a PermissionError from a kernel layer), "memory" (MemoryError), "cpu_time"
(RLIMIT_CPU), "timeout" (wall clock; the process group is killed), "output_limit" (stdout +
stderr over `max_output_bytes`; killed, output truncated), "killed" (another signal or
exit status), "sandbox" (the bootstrap itself failed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

KINDS = ("ok", "error", "refused", "memory", "cpu_time", "timeout", "output_limit", "killed",
         "sandbox")
_EXIT_ERROR, _EXIT_REFUSED, _EXIT_MEMORY, _EXIT_SANDBOX = 81, 82, 83, 84


@dataclasses.dataclass(frozen=True)
class Limits:
  """cpu_seconds: RLIMIT_CPU; wall_seconds: killed after this long; memory_bytes: RLIMIT_AS;
  max_output_bytes: stdout + stderr kept (more: killed, truncated); max_file_bytes:
  RLIMIT_FSIZE; max_processes: RLIMIT_NPROC (enforced by the kernel inside the user
  namespace); max_open_files: RLIMIT_NOFILE; network_namespace: try the namespace layer."""
  cpu_seconds: int = 5
  wall_seconds: float = 10.0
  memory_bytes: int = 512 * 2 ** 20
  max_output_bytes: int = 16 * 1024
  max_file_bytes: int = 8 * 2 ** 20
  max_processes: int = 1
  max_open_files: int = 64
  network_namespace: bool = True
  audit_hook: bool = True
  kernel_guards: bool = True

  def __post_init__(self):
    for f in ("cpu_seconds", "memory_bytes", "max_output_bytes", "max_file_bytes",
              "max_processes", "max_open_files"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"Limits.{f}: expected a positive int, found {v!r}")
    if not self.wall_seconds > 0:
      raise ValueError(f"Limits.wall_seconds: expected > 0, found {self.wall_seconds!r}")


@dataclasses.dataclass(frozen=True)
class Result:
  """stdout (decoded, at most the output limit); kind (`KINDS`); message (the error's last
  line, "" when ok); truncated (output cut at the limit); seconds (wall); layers: the layers
  in force ("rlimits", "netns", "landlock", "seccomp", "audit"; module doc)."""
  stdout: str
  kind: str
  message: str
  truncated: bool
  seconds: float
  layers: tuple[str, ...] = ()

  @property
  def ok(self) -> bool:
    return self.kind == "ok"

  def tool_text(self, max_chars: int = 2000) -> str:
    """What the policy reads: the output, then "error (kind): message" on failure."""
    out = self.stdout[:max_chars]
    if self.truncated:
      out += "\n[output truncated]"
    if not self.ok:
      out += ("\n" if out else "") + f"error ({self.kind}): {self.message}"
    return out


# The code that runs in the child before the tool's code. argv: [-c, code_path, limits JSON].
# It must not import anything outside the standard library.
_BOOTSTRAP = r'''
import json, os, resource, signal, sys, traceback
_code_path, _cfg = sys.argv[1], json.loads(sys.argv[2])
_root = os.path.realpath(os.getcwd())
def _set(res, n):
    resource.setrlimit(res, (n, n))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
_set(resource.RLIMIT_CORE, 0)
_cpu = _cfg["cpu_seconds"]
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
_set(resource.RLIMIT_AS, _cfg["memory_bytes"])
_set(resource.RLIMIT_FSIZE, _cfg["max_file_bytes"])
_set(resource.RLIMIT_NOFILE, _cfg["max_open_files"])
_set(resource.RLIMIT_NPROC, _cfg["max_processes"])   # before unshare: the namespace keeps it
_netns = False
if _cfg["network_namespace"]:
    try:
        import ctypes
        _libc = ctypes.CDLL(None, use_errno=True)
        _uid, _gid = os.getuid(), os.getgid()
        if _libc.unshare(0x10000000 | 0x40000000) == 0:   # CLONE_NEWUSER | CLONE_NEWNET
            _netns = True
            for _f, _t in (("/proc/self/setgroups", "deny"),
                           ("/proc/self/uid_map", f"{_uid} {_uid} 1"),
                           ("/proc/self/gid_map", f"{_gid} {_gid} 1")):
                try:
                    with open(_f, "w") as _h:
                        _h.write(_t)
                except OSError:
                    pass
        del ctypes, _libc
    except Exception:
        _netns = False
with open(_code_path) as _h:
    _src = _h.read()
os.unlink(_code_path)
_layers = ["rlimits"] + (["netns"] if _netns else [])

def _landlock(ctypes, libc):
    """Filesystem: read/write under the cwd, read (+ execute) under the read-only dirs."""
    abi = libc.syscall(444, None, 0, 1)               # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return False
    handled = (1 << (13 if abi == 1 else 14 if abi == 2 else 15)) - 1
    attr = ctypes.c_uint64(handled)
    fd = libc.syscall(444, ctypes.byref(attr), 8, 0)
    if fd < 0:
        return False
    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
    read_dir = (1 << 0) | (1 << 2) | (1 << 3)         # EXECUTE | READ_FILE | READ_DIR
    rules = [(_root, handled)] + [(d, read_dir) for d in _cfg["read_only"]] + [
        ("/dev/null", (1 << 1) | (1 << 2)), ("/dev/urandom", 1 << 2)]
    for path, allowed in rules:
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        rule = Beneath(allowed & handled, pfd)
        ok = libc.syscall(445, fd, 1, ctypes.byref(rule), 0) == 0   # PATH_BENEATH
        os.close(pfd)
        if not ok:
            os.close(fd)
            return False
    ok = libc.prctl(38, 1, 0, 0, 0) == 0 and libc.syscall(446, fd, 0) == 0
    os.close(fd)
    return ok

def _seccomp(ctypes, libc):
    """No new process, program or socket: fork / vfork / clone without CLONE_THREAD / execve /
    execveat / socket / ptrace / unshare / setns / mount fail with EPERM (clone3: ENOSYS, so
    threads fall back to clone); another architecture's syscalls kill the process."""
    if os.uname().machine != "x86_64":
        return False
    class F(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]
    class P(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(F))]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, KILL, ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
    deny = [57, 58, 59, 322, 41, 101, 272, 308, 165]
    n_deny = len(deny)
    # layout: 0 ld arch, 1 jeq, 2 kill, 3 ld nr, 4 jge x32, 5 jeq clone3, 6 jeq clone,
    # 7.. deny, A=7+n allow, A+1 ld arg0, A+2 jset, A+3 allow, A+4 eperm, A+5 enosys
    a = 7 + n_deny
    eperm, enosys, clone = a + 4, a + 5, a + 1
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, 0xC000003E), (RET, 0, 0, KILL), (LD, 0, 0, 0),
            (JGE, eperm - 5, 0, 0x40000000), (JEQ, enosys - 6, 0, 435),
            (JEQ, clone - 7, 0, 56)]
    for i, nr in enumerate(deny):
        prog.append((JEQ, eperm - (8 + i), 0, nr))
    prog += [(RET, 0, 0, ALLOW), (LD, 0, 0, 16), (JSET, 0, 1, 0x10000), (RET, 0, 0, ALLOW),
             (RET, 0, 0, ERRNO | 1), (RET, 0, 0, ERRNO | 38)]
    arr = (F * len(prog))(*[F(*x) for x in prog])
    fprog = P(len(prog), arr)
    if libc.prctl(38, 1, 0, 0, 0) != 0:              # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0   # SECCOMP_MODE_FILTER

if _cfg["kernel_guards"]:
    try:
        import ctypes
        _libc = ctypes.CDLL(None, use_errno=True)
        if _landlock(ctypes, _libc):
            _layers.append("landlock")
        if _seccomp(ctypes, _libc):
            _layers.append("seccomp")
        del ctypes, _libc
    except Exception:
        pass
for _m in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
    del sys.modules[_m]
if _cfg["audit_hook"]:
    _layers.append("audit")
sys.stderr.write("\x00layers=%s\n" % ",".join(_layers))
sys.stderr.flush()
import sysconfig as _sc
_read_ok = tuple(sorted({os.path.realpath(p) + os.sep for p in
                         (_sc.get_paths()["stdlib"], _sc.get_paths()["platstdlib"])}))
_read_files = ("/dev/null", "/dev/urandom")
_banned_modules = {"ctypes", "_ctypes"}

class _Refused(PermissionError):
    pass

def _refuse(what, why=""):
    raise _Refused(f"sandbox: {what} refused" + (f" ({why})" if why else ""))

def _inside(p):
    if isinstance(p, int):
        return True
    try:
        p = os.fsdecode(p)
    except TypeError:
        return False
    r = os.path.realpath(p)
    return r == _root or r.startswith(_root + os.sep)

_PATH_EVENTS = {"os.listdir", "os.scandir", "os.mkdir", "os.remove", "os.rmdir", "os.rename",
                "os.truncate", "os.utime", "os.chmod", "os.chown", "os.chflags", "os.lchflags",
                "os.lchmod", "os.link", "os.setxattr", "os.removexattr", "os.listxattr",
                "os.getxattr", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
                "shutil.copytree", "shutil.move", "shutil.rmtree", "shutil.chown",
                "glob.glob", "os.mkfifo", "os.mknod"}
_PROC_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
                "os.kill", "os.killpg", "os.startfile", "subprocess.Popen", "pty.spawn",
                "os.chdir", "os.chroot", "os.symlink", "sys.addaudithook", "ctypes.dlopen",
                "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
                "ctypes.addressof", "ctypes.set_errno", "ctypes.seh_exception",
                "os.add_dll_directory", "mmap.__new__"}

def _hook(event, args):
    if event == "open":
        path, mode = args[0], args[1]
        if _inside(path):
            return
        w = mode if isinstance(mode, str) else ""
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        writing = any(c in w for c in "wax+") or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if not writing:
            r = os.path.realpath(os.fsdecode(path))
            if r in _read_files or r.startswith(_read_ok):
                return
        _refuse(f"open({path!r})", "outside the sandbox directory")
    elif event.startswith("socket."):
        _refuse(event, "no network")
    elif event == "import":
        if args[0] in _banned_modules or args[0].split(".")[0] in _banned_modules:
            _refuse(f"import {args[0]}")
    elif event in _PROC_EVENTS:
        _refuse(event, "no processes, no native code")
    elif event in _PATH_EVENTS:
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                _refuse(f"{event}({a!r})", "outside the sandbox directory")

if _cfg["audit_hook"]:
    sys.addaudithook(_hook)
_g = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(_src, "<tool>", "exec"), _g)
except SystemExit as e:
    raise
except BaseException as e:
    try:
        sys.stdout.flush()
    except Exception:
        pass
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    sys.stderr.write("".join(tb[-6:]))
    sys.stderr.flush()
    code = 81
    if isinstance(e, PermissionError):
        code = 82
    elif isinstance(e, MemoryError):
        code = 83
    os._exit(code)
sys.stdout.flush()
'''


def _read_only_dirs() -> list[str]:
  """What the tool code may read (and map executable) besides its directory: the standard
  library and the system's shared libraries (extension modules load them)."""
  paths = sysconfig.get_paths()
  dirs = {os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"])}
  dirs |= {d for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64") if os.path.isdir(d)}
  return sorted(dirs)


def run_python(code: str, limits: Limits = Limits(), stdin: str = "") -> Result:
  """Run `code` in the sandbox (module doc) and return its `Result`; never raises for
  anything the code does."""
  t0 = time.perf_counter()
  tmp = tempfile.mkdtemp(prefix="k3sbx-")
  try:
    os.chmod(tmp, 0o700)
    code_path = os.path.join(tmp, ".tool_code.py")
    with open(code_path, "w") as f:
      f.write(code)
    cfg = {f.name: getattr(limits, f.name) for f in dataclasses.fields(limits)}
    cfg["read_only"] = _read_only_dirs()
    cfg = json.dumps(cfg)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
    try:
      proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, code_path, cfg],
                              cwd=tmp, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
    except OSError as e:
      return Result("", "sandbox", f"could not start the sandbox: {e}", False,
                    time.perf_counter() - t0)
    return _collect(proc, stdin, limits, t0)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _collect(proc: subprocess.Popen, stdin: str, limits: Limits, t0: float) -> Result:
  """Read stdout/stderr under the output limit until exit or the wall-clock limit."""
  try:
    if stdin:
      proc.stdin.write(stdin.encode())
    proc.stdin.close()
  except BrokenPipeError:
    pass
  bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
  sel = selectors.DefaultSelector()
  for f in bufs:
    sel.register(f, selectors.EVENT_READ)
  deadline = t0 + limits.wall_seconds
  timed_out = over = False
  total = 0
  while sel.get_map():
    left = deadline - time.perf_counter()
    if left <= 0:
      timed_out = True
      break
    for key, _ in sel.select(timeout=min(left, 0.5)):
      chunk = os.read(key.fileobj.fileno(), 65536)
      if not chunk:
        sel.unregister(key.fileobj)
        continue
      bufs[key.fileobj] += chunk
      total += len(chunk)
    if total > limits.max_output_bytes + 4096:   # + room for the bootstrap's own lines
      over = True
      break
  sel.close()
  _kill_group(proc)   # on timeout / overflow, and any stray member of the group after exit
  rc = proc.wait()
  for f in bufs:
    f.close()
  seconds = time.perf_counter() - t0
  err = bytes(bufs[proc.stderr])
  layers: tuple[str, ...] = ()
  if err.startswith(b"\x00layers="):
    line, _, err = err.partition(b"\n")
    layers = tuple(x for x in line[len(b"\x00layers="):].decode().split(",") if x)
  out = bytes(bufs[proc.stdout])
  truncated = len(out) > limits.max_output_bytes
  stdout = out[:limits.max_output_bytes].decode("utf-8", "replace")
  err_text = err.decode("utf-8", "replace").strip()
  last = err_text.splitlines()[-1] if err_text else ""
  if timed_out:
    kind, msg = "timeout", f"wall-clock limit of {limits.wall_seconds:g} s exceeded (killed)"
  elif over:
    kind, msg, truncated = "output_limit", (f"output over {limits.max_output_bytes} bytes "
                                            f"(killed)"), True
  elif rc == 0:
    kind, msg = "ok", ""
  elif rc == _EXIT_REFUSED:
    tail = last.split(": ", 1)[-1]
    kind, msg = "refused", (tail if tail.startswith("sandbox:") else last) or "refused"
  elif rc == _EXIT_MEMORY:
    kind, msg = "memory", f"memory limit of {limits.memory_bytes} bytes exceeded (MemoryError)"
  elif rc == _EXIT_ERROR:
    kind, msg = "error", last or "an exception"
  elif rc in (-signal.SIGXCPU, -signal.SIGKILL) and _cpu_exhausted(seconds, limits, rc):
    kind, msg = "cpu_time", f"CPU-time limit of {limits.cpu_seconds} s exceeded (killed)"
  elif rc < 0:
    kind, msg = "killed", f"killed by signal {signal.Signals(-rc).name}"
  else:
    kind, msg = ("error", last) if last else ("killed", f"exit status {rc}")
  return Result(stdout, kind, msg, truncated, seconds, layers)


def _cpu_exhausted(seconds: float, limits: Limits, rc: int) -> bool:
  """SIGXCPU is the soft CPU limit; SIGKILL before the wall limit is the hard one."""
  return rc == -signal.SIGXCPU or seconds >= limits.cpu_seconds


__all__ = ["KINDS", "Limits", "Result", "run_python"]
