"""The first process of every command a `local` sandbox runs: `python -m slime.agent.sandbox_init SPEC -- CMD...`.

It starts as root (the rollout's user) in its own process group and, before running CMD, builds what the
sandbox promises (docs/agent.md, "Sandboxes"):

1. a private mount namespace where every world-writable directory (/tmp, /var/tmp, /dev/shm, /run/lock) is a
   fresh tmpfs, with the sandbox directory bound back in at its own path: an unprivileged user then has no
   place outside its sandbox directory to write to, and the tmpfs mounts vanish with the namespace;
2. a private network namespace holding only loopback. When the episode needs the gateway, this process
   listens on 127.0.0.1:PORT inside the namespace and relays each connection to a Unix socket that the
   rollout process serves in front of the gateway: the only way out of the namespace;
3. CMD runs in a forked child with CPU-time, address-space, process-count and file-size limits, as the
   sandbox's own unprivileged uid (one uid per live sandbox, so "every process of this episode" is "every
   process of this uid"), and dies when this process dies.

Stdlib only, and nothing of slime is imported: it runs once per command and must start fast.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import signal
import socket
import struct
import sys
import threading
import warnings  # noqa: F401 - os.execvpe imports it lazily, after the uid change may hide the stdlib

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
HIDDEN_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [s.encode() if s is not None else None for s in (src, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {target}")


def enter_namespaces(root: str, net: bool, keep: list[str] | None = None) -> None:
    """New mount (and network) namespace; tmpfs over the world-writable dirs; `root` bound back in, and each
    directory of `keep` that a tmpfs would hide (the command's own install dir, e.g. a checkout under /tmp)."""
    _check(_libc.unshare(CLONE_NEWNS | (CLONE_NEWNET if net else 0)), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount leaks back to the host
    hidden = [d for d in HIDDEN_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    back = [root] + [k for k in keep or () if os.path.isdir(k) and any(k.startswith(d + "/") for d in hidden)]
    fds = {path: os.open(path, os.O_PATH) for path in sorted(set(back), key=len)}  # outer dirs first
    for d in hidden:
        _mount("tmpfs", d, "tmpfs", 0, "mode=1777,size=256m")
    for path, fd in fds.items():
        os.makedirs(path, exist_ok=True)  # inside the fresh tmpfs when it lived under a hidden dir
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    if net:
        _loopback_up()


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve_relay(listener: socket.socket, unix_path: str) -> None:
    # AF_UNIX paths stop at 107 bytes; a deep sandbox dir is reached through a directory fd instead
    if len(unix_path.encode()) > 100:
        dir_fd = os.open(os.path.dirname(unix_path), os.O_PATH | os.O_DIRECTORY)
        unix_path = f"/proc/self/fd/{dir_fd}/{os.path.basename(unix_path)}"
    while True:
        conn, _ = listener.accept()
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(unix_path)
        except OSError:
            conn.close()
            up.close()
            continue
        threading.Thread(target=_pipe, args=(conn, up), daemon=True).start()
        threading.Thread(target=_pipe, args=(up, conn), daemon=True).start()


def _limit(kind: int, value: int | None) -> None:
    if value:
        resource.setrlimit(kind, (value, value))


def _become(spec: dict) -> None:
    """In the child: limits, then the sandbox's uid (limits first: lowering a hard limit needs no privilege,
    but the uid change must come last), then die with the parent (a uid change clears PDEATHSIG)."""
    _limit(resource.RLIMIT_CPU, spec.get("cpu_seconds"))
    _limit(resource.RLIMIT_AS, spec.get("memory_bytes"))
    _limit(resource.RLIMIT_FSIZE, spec.get("file_bytes"))
    uid, gid = spec.get("uid"), spec.get("gid")
    if uid is not None and os.geteuid() == 0:
        _limit(resource.RLIMIT_NPROC, spec.get("nproc"))  # per uid: only meaningful for our own uid
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.umask(0o022)
    os.chdir(spec["cwd"])


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"]:  # can this host give us the namespaces? (exit 0 = yes)
        enter_namespaces(argv[1], net=True)
        return 0
    spec = json.loads(argv[0])
    cmd = argv[2:] if argv[1:2] == ["--"] else argv[1:]
    listener = None
    if spec.get("isolate"):
        enter_namespaces(spec["root"], net=True, keep=spec.get("keep"))
    relay = spec.get("relay")  # also without `isolate`: a container brings its own loopback-only namespace
    if relay:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", int(relay["port"])))
        listener.listen(64)
    pid = os.fork()
    if pid == 0:
        try:
            if listener is not None:
                listener.close()
            _become(spec)
            os.execvpe(cmd[0], cmd, os.environ)
        except BaseException as e:  # noqa: BLE001 - report, then leave the forked child without cleanup
            os.write(2, f"sandbox: cannot run {cmd[0]!r}: {e}\n".encode())
        os._exit(127)
    if listener is not None:
        threading.Thread(target=_serve_relay, args=(listener, spec["relay"]["socket"]), daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # pass a stop on to the command
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
