"""Writing output folders atomically: all of it appears at once, or nothing does.

While a folder is written, its lock (`lock.owned`) is held, so a second job aimed at the same folder stops
with the first one's PID instead of racing it, and staging folders of jobs that died are removed.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import RecurfitError
from .lock import owned


def check_output(target: str | Path, replace: bool = False) -> None:
    """Refuse an existing non-empty `target` unless `replace`: commands call it before any work, so that a long
    evaluation never ends on this error."""
    target = Path(target)
    if target.exists() and not replace and (not target.is_dir() or any(target.iterdir())):
        raise RecurfitError(f"{target} already exists; pass --force to replace it, or choose another output folder.")


@contextmanager
def staged_directory(target: Path, replace: bool = False, wait: bool = False) -> Iterator[Path]:
    """Yield an empty sibling folder to write into; on success its files are synced to disk and it is renamed
    to `target`.

    An existing non-empty `target` is an error unless `replace`; a failure leaves `target` untouched. The
    folder gets the permissions the umask gives (not a temporary folder's 0700). `wait`: if another process
    is writing `target`, wait for it instead of stopping."""
    target = Path(target)
    with owned(target, wait=wait):
        check_output(target, replace)
        staging = _new_staging_folder(target)
        try:
            yield staging
            publish_directory(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def staged_file(target: Path, replace: bool = False) -> Iterator[Path]:
    """Yield a path beside `target`, with its suffix (writers that pick a format by it), to write one file into; on
    success it is synced to disk and renamed to `target`. An existing `target` is an error unless `replace`; a
    failure leaves `target` untouched."""
    target = Path(target)
    with owned(target):
        check_output(target, replace)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.partial-{secrets.token_hex(4)}{target.suffix}")
        try:
            yield staging
            _finish_file(staging)
            os.replace(staging, target)
        finally:
            staging.unlink(missing_ok=True)


def publish_directory(staging: Path, target: Path) -> None:
    """Sync `staging`'s files and rename it to `target`, replacing a `target` that exists (hold its lock)."""
    _finish_files(staging)
    if target.exists():
        retired = target.parent / f".{target.name}.old-{secrets.token_hex(4)}"
        target.rename(retired)
        staging.rename(target)
        shutil.rmtree(retired)
    else:
        staging.rename(target)


def _new_staging_folder(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        staging = target.parent / f".{target.name}.partial-{secrets.token_hex(4)}"
        try:
            staging.mkdir(mode=0o777)  # the umask applies, as for any folder the user creates
            return staging
        except FileExistsError:
            continue


def _finish_files(folder: Path) -> None:
    """Give every file the permissions the umask allows (some writers, safetensors among them, create files
    0600), and flush it to disk before the rename publishes it: after a power loss, a folder that has its
    final name holds whole files."""
    for path in folder.rglob("*"):
        if path.is_file():
            _finish_file(path)


def _finish_file(path: Path) -> None:
    os.chmod(path, path.stat().st_mode | 0o666 & ~umask())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """The process's umask, read without changing it where Linux allows (os.umask can only set it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current
