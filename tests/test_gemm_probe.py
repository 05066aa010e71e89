"""tools/gemm_probe.py and bench's note on it: the machine's GEMM rate on a model's prefill shape beside the
rate prefill ran its GEMMs at, a warning line when prefill is far below."""
from __future__ import annotations

import json

import pytest
import torch

from picompile.tools import gemm_probe
from picompile.tools.bench_report import PREFILL_GEMM_WARN, _prefill_gemm_notes

TINYLLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000}


def test_flop_per_token_counts_every_gemm_weight_twice() -> None:
    d, ff, kv = 2048, 5632, 4 * 64
    per_layer = d * (d + 2 * kv) + d * d + 3 * d * ff  # q, k, v, o; up, gate, down
    assert gemm_probe.gemm_flop_per_token(TINYLLAMA) == 2.0 * (22 * per_layer + 32000 * d)  # ~2.07 GFLOP


def test_probe_reports_each_fast_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    rates = gemm_probe.probe_gemm(8, 64, 32, repeats=2)
    assert "float32" in rates and all(v > 0 for v in rates.values())
    assert ("bfloat16" in rates) == bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    out = gemm_probe.prefill_gemm_rate({**TINYLLAMA, "hidden_size": 64, "intermediate_size": 32,
                                        "num_attention_heads": 4, "num_key_value_heads": 4}, 8, 100.0)
    assert out["prefill_gemm_gflops"] > 0 and "float32" in out["gemm_probe_gflops"]
    json.dumps(out)  # goes into bench's --json result


def test_report_warns_only_far_below_the_probe() -> None:
    probe = {"float32": 100.0, "bfloat16": 300.0}
    big = {"gemm_probe_gflops": probe, "gemm_flop_per_token": 2.07e9, "prompt_len": 64}  # the 1B at prompt 64
    slow = _prefill_gemm_notes({**big, "prefill_gemm_gflops": 60.0})
    assert len(slow) == 1 and "warning" in slow[0] and "20% of a bare bfloat16 GEMM" in slow[0]
    fine = _prefill_gemm_notes({**big, "prefill_gemm_gflops": PREFILL_GEMM_WARN * 300 + 1})
    assert len(fine) == 1 and "warning" not in fine[0]
    tiny = _prefill_gemm_notes({**big, "gemm_flop_per_token": 1e6, "prefill_gemm_gflops": 1.0})  # dispatch-bound
    assert len(tiny) == 1 and "warning" not in tiny[0]
    assert _prefill_gemm_notes({"prompt_len": 64}) == []  # no probe (a config the shape reader does not know)
    gated = _prefill_gemm_notes({**big, "prefill_gemm_gflops": 400.0, "sparse_prefill_parts": 22})  # above the probe
    assert len(gated) == 1 and "counted as dense GEMMs' FLOPs, though 22 ReLU FFN parts" in gated[0]
