"""runtime/decode_attention.py: sdpa → grouped matmuls, alone on tensors and as a graph rewrite."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from picompile.runtime.decode_attention import SDPA, grouped_attention, rewrite_attention


def _qkv(hq: int, hkv: int, s: int, length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(hq * 100 + s)
    return (torch.randn(1, hq, s, 16, generator=g), torch.randn(1, hkv, length, 16, generator=g),
            torch.randn(1, hkv, length, 16, generator=g))


@pytest.mark.parametrize("hq,hkv,s,mask_kind", [(8, 2, 1, "bool"), (8, 2, 5, "bool"), (4, 4, 3, "float"),
                                                (6, 3, 1, "none"), (8, 1, 4, "bool")])
def test_grouped_attention_equals_sdpa(hq: int, hkv: int, s: int, mask_kind: str) -> None:
    length = 9
    q, k, v = _qkv(hq, hkv, s, length)
    causal = torch.arange(length)[None, :] <= torch.arange(length - s, length)[:, None]  # [s, L]
    mask = {"bool": causal[None, None], "none": None,
            "float": torch.where(causal, 0.0, float("-inf"))[None, None]}[mask_kind]
    want = F.scaled_dot_product_attention(q, k, v, mask, scale=0.3, enable_gqa=True)
    got = grouped_attention(q, k, v, mask, 0.3)
    assert got.shape == want.shape == (1, hq, s, 16)
    assert (got - want).abs().max().item() < 1e-5
    assert (grouped_attention(q, k, v, mask, None) - F.scaled_dot_product_attention(
        q, k, v, mask, enable_gqa=True)).abs().max().item() < 1e-5  # default scale 1/sqrt(e)


class _Block(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        a = F.scaled_dot_product_attention(q, k, v, m, scale=0.25, enable_gqa=True)
        return F.scaled_dot_product_attention(a, k, v, m, dropout_p=0.0, is_causal=False, scale=0.25, enable_gqa=True) + a


def test_rewrite_attention_graph() -> None:
    q, k, v = _qkv(8, 2, 1, 7)
    m = torch.ones(1, 1, 1, 7, dtype=torch.bool)
    gm = torch.export.export(_Block(), (q, k, v, m)).module()
    before = gm(q, k, v, m)
    assert sum(n.target is SDPA for n in gm.graph.nodes) == 2
    assert rewrite_attention(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert SDPA not in targets and targets.count(grouped_attention) == 2
    assert (gm(q, k, v, m) - before).abs().max().item() < 1e-5


def test_rewrite_leaves_causal_sdpa() -> None:
    graph = fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    for node in (q, k, v):
        node.meta["val"] = torch.empty(1, 2, 3, 4)
    out = graph.call_function(SDPA, (q, k, v), {"is_causal": True})
    graph.output(out)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert rewrite_attention(gm) == 0 and any(n.target is SDPA for n in gm.graph.nodes)
