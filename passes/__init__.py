"""picompile's passes, one per file; importing this package registers them all (see picompile.pipeline)."""
from picompile.passes import (  # noqa: F401
    allocate_sparsity,
    canonicalize_ffn,
    capture,
    convert_weights,
    fold_kv_repeat,
    fuse_projections,
    insert_predictors,
    lower_tvm,
    package,
    place_neurons,
    profile_activations,
    sparsify_inputs,
    split_ffn,
    train_predictors,
)
from picompile.passes.registry import PASSES, Pass, register_pass

__all__ = ["PASSES", "Pass", "register_pass"]
