"""Write a calibration token file sampled from a model itself (no held-out text needed).

    python examples/sample_calibration.py ART_OR_HF_DIR OUT.json --tokens 4096 --seed 0 [--batch 16]
    picompile build MODEL --calibration OUT.json …

A build with input sparsity and no ``--calibration`` samples the same way itself (``picompile.sparsity.calibration``,
cached per model under the cache dir); this script writes such a file for other builds or other tools.

Samples documents from BOS at temperature 1, so the text profiled and the text evaluated on stay disjoint: the
stories260K figures in benchmarks/README.md are measured on tinystories_sample.txt with a calibration file made so.
From a Hugging Face checkpoint directory (``config.json`` + safetensors, e.g. SmolLM2's) ``--batch`` documents are
sampled at once with transformers' KV cache (SmolLM2-135M, 4,096 tokens, batch 16: 203 s on a busy 2-core machine,
load average ~6; the same run without OMP_WAIT_POLICY=PASSIVE had not finished in 900 s, and the artifact path
did not finish in the session that measured SmolLM2 first); from an
artifact (a dense build of the model, ``picompile build MODEL --pipeline dense``), one document at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def sample_ids(artifact: Path, n_tokens: int, seed: int, doc_tokens: int) -> list[int]:
    """``n_tokens`` ids: documents of up to ``doc_tokens`` ids, each starting with BOS, sampled at temperature 1."""
    import picompile

    session = picompile.load(artifact)
    bos = session.tokenizer.bos_id if session.tokenizer is not None else None
    if bos is None:
        raise SystemExit(f"{artifact} names no BOS token to start documents from")
    ids: list[int] = []
    doc = 0
    while len(ids) < n_tokens:
        new = session.generate([bos], min(doc_tokens, session.max_seq_len - 1), temperature=1.0, seed=seed + doc)
        ids += [bos, *new]
        doc += 1
    return ids[:n_tokens]


def sample_ids_hf(model_dir: Path, n_tokens: int, seed: int, doc_tokens: int, batch: int) -> list[int]:
    """As :func:`sample_ids` from a transformers checkpoint: ``batch`` documents per ``generate`` call (KV cache,
    sampling at temperature 1 without top-k / top-p); a document ends at EOS or after ``doc_tokens`` ids."""
    import picompile  # noqa: F401  before torch: OMP_WAIT_POLICY=PASSIVE (spinning OpenMP threads made each step
    # 6x slower on a shared machine)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bos = model.config.bos_token_id
    if bos is None and (model_dir / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        bos = AutoTokenizer.from_pretrained(model_dir).bos_token_id
    if bos is None:
        raise SystemExit(f"{model_dir} names no BOS token to start documents from")
    if model.config.bos_token_id is None:
        model.config.bos_token_id = bos
    from picompile.sparsity.calibration import sample_documents

    return sample_documents(model, n_tokens, seed, doc_tokens, batch)  # what a build samples by default, too


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path, help="an artifact, or a Hugging Face checkpoint directory (config.json)")
    p.add_argument("output", type=Path, help="a .json list of token ids (picompile build --calibration takes it)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--doc-tokens", type=int, default=255, help="tokens per sampled document (default 255)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16, help="documents per generate call (checkpoint directory only)")
    args = p.parse_args(argv)
    if (args.artifact / "config.json").is_file() and not (args.artifact / "manifest.json").is_file():
        ids = sample_ids_hf(args.artifact, args.tokens, args.seed, args.doc_tokens, max(1, args.batch))
    else:
        ids = sample_ids(args.artifact, args.tokens, args.seed, args.doc_tokens)
    tmp = args.output.with_name(args.output.name + ".partial")
    tmp.write_text(json.dumps(ids))
    os.replace(tmp, args.output)
    print(f"wrote {len(ids)} sampled token ids to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
