"""User-facing errors: the CLI prints their message and exits non-zero, without a traceback."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator


class PicompileError(Exception):
    """Base class for every error caused by user input (bad path, model, artifact, budget …)."""

    exit_code: int = 2


class ModelLoadError(PicompileError):
    """The model path is missing, not a checkpoint, corrupt, or of an unsupported architecture."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture has no frontend."""


class PatternError(PicompileError):
    """A graph pattern (e.g. an FFN block) did not match; the message says why."""


class PassError(PicompileError):
    """A pass failed; the message names the pass."""


class ArtifactError(PicompileError):
    """An artifact is missing, corrupt, of another format version, or fails its checksums."""


class BudgetError(PicompileError):
    """The memory budget is too small for what must fit."""


class InputError(PicompileError):
    """Bad runtime input: a prompt longer than the context, an empty prompt, an unknown token id."""


@contextlib.contextmanager
def named_step(kind: str, name: str) -> Iterator[None]:
    """Errors raised inside one named step of a pipeline (a build pass, a load step) say which step: a
    PicompileError is reworded "<kind> <name>: …" (a PassError already names it), any other exception gets a note."""
    try:
        yield
    except PassError:
        raise
    except PicompileError as e:
        raise type(e)(f"{kind} {name}: {e}") from None
    except Exception as e:
        e.add_note(f"picompile: raised in {kind} {name!r}")
        raise
