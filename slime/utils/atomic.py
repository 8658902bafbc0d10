"""Files that are either wholly written or not there: a crash mid-write must never leave a torn checkpoint,
dump or state file that a resumed run would read."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import IO


def fsync_dir(path: str) -> None:
    """Persist a directory's entries (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w") -> Iterator[IO]:
    """Write to `path.tmp.<pid>`, fsync, then rename over `path`; on an error the temporary file is removed."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', got {mode!r}")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move a fully written directory `tmp` to `final`, replacing any old one: a reader sees the old directory
    or the new one, never a mix (between the two renames `final` is briefly absent)."""
    tmp, final = os.fspath(tmp), os.fspath(final)
    if os.path.exists(final):
        old = f"{final}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
