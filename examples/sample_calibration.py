"""Write a calibration token file sampled from a model itself (no held-out text needed).

    python examples/sample_calibration.py ART OUT.json --tokens 4096 --seed 0
    picompile build MODEL --calibration OUT.json …

Samples documents from BOS at temperature 1 with a dense build of the model (``picompile build MODEL
--pipeline dense``), so the text profiled and the text evaluated on stay disjoint: the stories260K
figures in benchmarks/README.md are measured on tinystories_sample.txt with a calibration file made so.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("output", type=Path, help="a .json list of token ids (picompile build --calibration takes it)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--doc-tokens", type=int, default=255, help="tokens per sampled document (default 255)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    ids = sample_ids(args.artifact, args.tokens, args.seed, args.doc_tokens)
    tmp = args.output.with_name(args.output.name + ".partial")
    tmp.write_text(json.dumps(ids))
    os.replace(tmp, args.output)
    print(f"wrote {len(ids)} sampled token ids to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
