"""Writing output folders atomically: all of it appears at once, or nothing does."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import RecurfitError


def check_output(target: str | Path, replace: bool = False) -> None:
    """Refuse an existing non-empty `target` unless `replace`: commands call it before any work, so that a long
    evaluation never ends on this error."""
    target = Path(target)
    if target.exists() and not replace and (not target.is_dir() or any(target.iterdir())):
        raise RecurfitError(f"{target} already exists; pass --force to replace it, or choose another output folder.")


@contextmanager
def staged_directory(target: Path, replace: bool = False) -> Iterator[Path]:
    """Yield an empty sibling folder to write into; on success it is renamed to `target`.

    An existing non-empty `target` is an error unless `replace`; a failure leaves `target` untouched.
    """
    target = Path(target)
    check_output(target, replace)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield staging
        if target.exists():
            retired = staging.with_name(staging.name.replace(".partial-", ".old-"))
            target.rename(retired)
            staging.rename(target)
            shutil.rmtree(retired)
        else:
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
