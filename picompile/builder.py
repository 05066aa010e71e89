"""``picompile.build``: the Python form of ``picompile build``."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from picompile.formats.artifact import staged_output
from picompile.config import BuildConfig
from picompile.context import BuildContext
from picompile.errors import PicompileError
from picompile.pipeline import check_print_after, pass_names, run_pipeline
from picompile.targets import get_target


def default_model() -> str:
    """The model ``picompile build`` compiles when none is named: the one shipped in the package."""
    path = Path(__file__).parent / "data" / "default_model"
    if not (path / "config.json").is_file():
        raise PicompileError(f"no model named and the embedded default model is missing ({path})")
    return str(path)


def build(
    model: str | Path | None = None,
    target: str = "cpu",
    output: str | Path = "out.pic",
    *,
    emit: Callable[[str], None] = print,
    on_pass: Optional[Callable[[str, int, int], None]] = None,
    **options: Any,
) -> Path:
    """Compile ``model`` for ``target`` into the artifact directory ``output``; return its path.

    ``options`` are the other fields of :class:`picompile.config.BuildConfig`
    (vram_budget_gib, pipeline, predictor, max_seq_len, print_after, dump_ir, …).
    An existing artifact at ``output`` is replaced only once the new one is complete.
    """
    fields = {f.name for f in dataclasses.fields(BuildConfig)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(f"unknown build option(s): {', '.join(unknown)}")
    config = BuildConfig(model=str(model) if model is not None else default_model(), output=Path(output),
                         target=target, **options)
    return build_from_config(config, emit=emit, on_pass=on_pass)


def build_from_config(
    config: BuildConfig,
    emit: Callable[[str], None] = print,
    on_pass: Optional[Callable[[str, int, int], None]] = None,
    track: Optional[Callable[[Iterable[Any], str], Iterator[Any]]] = None,
) -> Path:
    # Check everything cheap before loading weights or touching the output.
    config.validate()
    tgt = get_target(config.target, config.vram_budget_gib)
    names = pass_names(config.pipeline)
    check_print_after(names, config.print_after)
    from picompile.frontend import load_model

    model, info = load_model(config.model)
    if config.max_seq_len is not None and config.max_seq_len > info.max_seq_len:
        raise PicompileError(f"--max-seq-len {config.max_seq_len} exceeds the model's {info.max_seq_len} positions")
    tokenizer = None
    if info.tokenizer is not None:
        from picompile.formats.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(info.tokenizer["kind"], Path(info.tokenizer["path"]))
    torch.manual_seed(config.seed)
    with staged_output(config.output) as staging:
        ctx = BuildContext(config=config, target=tgt, model=model, info=info, staging_dir=staging, pipeline=names,
                           tokenizer=tokenizer)
        if track is not None:
            ctx.track = track
        run_pipeline(ctx, names, emit=emit, on_pass=on_pass)
    return Path(config.output)
