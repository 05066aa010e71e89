"""picompile's passes, one per file; importing this package registers them all (see picompile.pipeline)."""
from picompile.passes import canonicalize_ffn, capture, package  # noqa: F401
from picompile.passes.registry import PASSES, Pass, register_pass

__all__ = ["PASSES", "Pass", "register_pass"]
