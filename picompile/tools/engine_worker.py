"""A bench engine in a process of its own (``picompile.tools.engines.WorkerEngine``): llama.cpp or PyTorch eager.

The bench process runs with ``OMP_WAIT_POLICY=PASSIVE``, which picompile sets for its own runtime (torch
ops and TVM kernels take turns on the same cores). The peers are measured without it: under PASSIVE the
OpenMP barriers of PyTorch's eager ops and of this llama-cpp-python build (one per graph node) sleep
and wake instead of spinning. Measured on the 1B synthetic model, 2 threads: llama.cpp f16 decode 6.35
tok/s under PASSIVE against 7.81-8.57 without; PyTorch fp32 eager 3.60-3.72 against 3.92-4.17. This
script is started by path with the user's environment (``python -P engine_worker.py KIND ...``):

* ``llama.cpp GGUF N_CTX THREADS KV_TYPE`` never imports ``picompile`` (whose import sets the policy);
* ``pytorch SOURCE THREADS`` imports torch first (its OpenMP reads the environment when torch loads),
  then picompile's model loader and :func:`picompile.tools.engines.pytorch_engine`.

Protocol: one JSON object per line. The worker answers its start with ``{"label", "info"}`` or
``{"error"}``; then each request ``{"ids": [...], "reset": bool}`` (reset: a new prompt) with ``{"tok"}``,
the argmax of the last position's logits, or ``{"error"}``. End of input ends it.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable

Step = Callable[[list[int], bool], int]  # (ids, reset) -> next token


def _llama(gguf: str, n_ctx: str, threads: str, kv_type: str) -> tuple[Step, dict[str, Any]]:
    import llama_cpp
    import numpy as np

    kv = llama_cpp.GGML_TYPE_F32 if kv_type == "f32" else llama_cpp.GGML_TYPE_F16
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=int(n_ctx), n_threads=int(threads), n_threads_batch=int(threads),
                          n_batch=max(int(n_ctx), 8), type_k=kv, type_v=kv, logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()

    def step(ids: list[int], reset: bool) -> int:
        if reset:
            llm.reset()
        llm.eval(ids)
        # the last position's logits (llm.scores stays empty without logits_all in llama-cpp-python 0.3)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    return step, {"file_type": str(llm.metadata.get("general.file_type", ""))}


def _pytorch(source: str, threads: str) -> tuple[Step, dict[str, Any]]:
    import torch  # first: its OpenMP runtime takes the policy from this (the user's) environment

    torch.set_num_threads(int(threads))
    from picompile.tools.engines import pytorch_engine
    from picompile.frontend import load_model

    model, _info = load_model(source)
    eng = pytorch_engine(model.eval())
    state: list[Any] = [None]

    def step(ids: list[int], reset: bool) -> int:
        if reset:
            tok, state[0] = eng.prefill(ids)
        else:
            (only,) = ids
            tok, state[0] = eng.decode(only, state[0])
        return tok

    return step, {}


def main(argv: list[str]) -> int:
    out = sys.stdout
    kind, args = argv[0], argv[1:]
    try:
        step, info = {"llama.cpp": _llama, "pytorch": _pytorch}[kind](*args)
    except Exception as e:
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"info": info}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out.write(json.dumps({"tok": step([int(i) for i in req["ids"]], bool(req.get("reset")))}) + "\n")
        except Exception as e:
            out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
