"""One owner per output folder: an OS lock that dies with the process holding it.

The lock of `runs/x` is the file `runs/.x.lock` beside it, held with `fcntl.flock`. The kernel releases it
when its process ends, however it ends (a SIGKILL included), so a killed job never leaves a stale lock, and a
staging folder `runs/.x.partial-*` whose lock nobody holds belongs to a dead process: the next owner removes it.
The lock file records its owner's PID and host, so a second process can say who holds the folder.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import RecurfitError

try:
    import fcntl
except ImportError:  # not POSIX: no locking
    fcntl = None

_held: dict[Path, list[int]] = {}  # lock file -> [fd, holders]: a process may re-enter its own lock


def lock_path(target: str | Path) -> Path:
    target = Path(target).absolute()
    return target.parent / f".{target.name}.lock"


@contextmanager
def owned(target: str | Path, wait: bool = False) -> Iterator[None]:
    """Hold the lock of `target` for the block (re-entrant within a process), then remove the stale staging
    folders (`.NAME.partial-*`, `.NAME.old-*`) that dead owners left beside it.

    Another process holding it is an error naming its PID, unless `wait`, which blocks until it is free."""
    path = lock_path(target)
    entry = _held.get(path)
    first = entry is None
    if first:
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = _held[path] = [_acquire(path, target, wait), 0]
    entry[1] += 1
    try:
        if first:
            remove_stale_staging(Path(target))
        yield
    finally:
        entry[1] -= 1
        if entry[1] == 0:  # the last holder in this process, whichever order the holders end in
            _held.pop(path, None)
            _release(path, entry[0])


def remove_stale_staging(target: Path) -> None:
    """Staging folders of `target` left by a process that died (call only while holding its lock)."""
    target = Path(target).absolute()
    for pattern in (f".{target.name}.partial-*", f".{target.name}.old-*"):
        for leftover in target.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _acquire(path: Path, target, wait: bool) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        if fcntl is None:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            owner = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RecurfitError(
                f"{target} is in use by {owner}; wait for it to finish or stop it, then run this again "
                f"(or choose another output folder)."
            ) from None
        # The owner before us may have removed the file after we opened it: lock the file that is there now.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:120] if sys.argv and sys.argv[0] else "python"
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()} (`{command}`)\n".encode())
    except OSError:  # a full disk: the record is only for the error message of a second process
        pass
    return fd


def _release(path: Path, fd: int) -> None:
    try:
        path.unlink()  # while still locked, so that nobody locks a file that is about to disappear
    except FileNotFoundError:
        pass
    os.close(fd)  # releases the flock
