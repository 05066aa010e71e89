"""``runtime/batch_glue.py``: which aten nodes run once on the B sequences' tokens stacked along dim 0."""
from __future__ import annotations

import torch

from picompile.runtime.batch_glue import batched_kwargs


class _Glue(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 1, 8))  # dim 0 of size 4: broadcasting it would mix sequences
        self.v = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # x [1, 1, 8]
        a = x * self.v  # pointwise with a shared [8]: stacked
        b = a + self.w  # [4, 1, 8]: the batch dimension meets the weight's 4
        c = a.sum(0, keepdim=True)  # a reduction over dim 0
        d = a.transpose(1, 2)  # not dim 0: stacked
        e = a.view(1, 8)  # size [1, 8] → [B, 8]
        f = a.mean(-1, keepdim=True)  # stacked
        return b, c, d, e, f


def test_batched_kwargs_only_for_dim0_pointwise_ops() -> None:
    ep = torch.export.export(_Glue(), (torch.randn(1, 1, 8),))
    gm = ep.module()
    x = next(n for n in gm.graph.nodes if n.op == "placeholder" and "x" in n.name)
    stacked = {x}
    batched: dict[str, dict[str, object]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        kw = batched_kwargs(node, 3, stacked, set())
        if kw is not None:
            stacked.add(node)
            batched[str(node.target)] = kw
    names = set(batched)
    assert "aten.mul.Tensor" in names and "aten.transpose.int" in names and "aten.mean.dim" in names
    assert "aten.add.Tensor" not in names  # against [4, 1, 8]
    assert "aten.sum.dim_IntList" not in names  # over dim 0
    view = batched["aten.view.default"]
    assert list(view["size"]) == [3, 8]  # type: ignore[call-overload]
