"""Staging directories of a build: named and marked with the builder's pid, swept once that pid is dead.

A build writes into ``.NAME.PID.XXXX.partial`` beside its output (and moves a replaced artifact to
``.NAME.PID.XXXX.old`` for the instant of the swap). Each holds a marker file recording the pid of the
build. A later build removes such directories whose marker names a process that no longer exists on
this machine — never one of a live build, never a directory without the marker (it is not picompile's).
SIGTERM and SIGHUP are turned into KeyboardInterrupt during a build so the cleanup that follows
Ctrl-C (removing the staging dir) also follows ``kill`` and ``timeout``.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

STAGING_MARKER: str = ".picompile-partial"
_STAGING_NAME = re.compile(r"^\..+\.(\d+)\.[A-Za-z0-9_]+\.(partial|old)$")


class BuildTerminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived during a build (handled like Ctrl-C: nothing is left behind)."""


def staging_name(output: Path, kind: str) -> Path:
    """A fresh name ``.NAME.PID.XXXXXXXX.KIND`` beside ``output`` (nothing is created: see ``create_staging``)."""
    import secrets

    return output.parent / f".{output.name}.{os.getpid()}.{secrets.token_hex(4)}.{kind}"


def create_staging(path: Path) -> Path:
    """Create the private dir ``path`` (a ``staging_name``) and mark it with this process's pid. The caller holds
    the name before this runs, so a signal arriving between the directory and the marker still finds it to remove."""
    os.mkdir(path, 0o700)
    (path / STAGING_MARKER).write_text(f"{os.getpid()}\n")
    return path


def make_staging(output: Path, kind: str) -> Path:
    """A new private dir ``.NAME.PID.XXXXXXXX.KIND`` beside ``output``, marked with this process's pid."""
    return create_staging(staging_name(output, kind))


def remove_marker(staging: Path) -> None:
    (staging / STAGING_MARKER).unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid we could have written: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists, owned by someone else
    return True


def stale_pid(path: Path) -> int | None:
    """The dead builder pid a staging dir records, or None if it is not a stale picompile staging dir."""
    m = _STAGING_NAME.match(path.name)
    if m is None or path.is_symlink() or not path.is_dir():
        return None
    try:
        recorded = int((path / STAGING_MARKER).read_text().strip())
    except (OSError, ValueError):
        return None
    if recorded != int(m.group(1)) or pid_alive(recorded):
        return None
    return recorded


def sweep_stale(parent: Path) -> list[Path]:
    """Remove the staging dirs of dead builds in ``parent``; return what was removed."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for path in entries:
        if path.name.startswith(".") and stale_pid(path) is not None:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _raise_terminated(signum: int, frame: Any) -> None:
    raise BuildTerminated(f"signal {signal.Signals(signum).name}")


@contextmanager
def termination_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise BuildTerminated (main thread only; else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]
    previous = {}
    for sig in wanted:
        if signal.getsignal(sig) is signal.SIG_IGN:
            continue  # e.g. nohup: the user asked for this signal to be ignored
        previous[sig] = signal.signal(sig, _raise_terminated)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
