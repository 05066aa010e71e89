"""Linux /proc memory figures in bytes: ``meminfo()`` (the machine's), ``status()`` (this process's).

Both read ``Key:  value kB`` lines (``/proc/meminfo``, ``/proc/self/status``) and return ``{key: bytes}`` for the
lines with a number; empty where the file is not there (not Linux) or cannot be read, so callers keep their own
fallbacks.
"""
from __future__ import annotations


def _fields(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        return {}
    return out


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (``MemTotal``, ``MemAvailable``, …)."""
    return _fields("/proc/meminfo")


def status() -> dict[str, int]:
    """This process's /proc/self/status sizes in bytes (``VmRSS``, ``VmHWM``, …; counts such as ``Threads`` as
    they are)."""
    return _fields("/proc/self/status")
