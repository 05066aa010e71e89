"""runtime/native_glue.py alone on tiny exported graphs: RMSNorm, rotary and grouped attention become one
picompile_native op each, computing the aten ops' floats (rotary bit for bit; RMSNorm's and attention's one-token
loops sum in another order: within 1e-6 relative); other patterns stay as they are."""
from __future__ import annotations

import pytest
import torch

from picompile.runtime import native
from picompile.runtime.decode_attention import grouped_attention
from picompile.runtime.native_glue import drop_whole_slices, fuse_glue, share_repeats

aten = torch.ops.aten


@pytest.fixture(scope="module", autouse=True)
def library() -> None:
    if native.load_library():
        pytest.skip(f"picompile_native could not be built here: {native.load_library()}")


class Block(torch.nn.Module):
    """A Llama attention's input, as HF writes it: RMSNorm, q / k heads, rotate-half rotary."""

    def __init__(self, d: int = 64, head: int = 16, kv_heads: int = 2) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d))
        self.head, self.kv_heads = head, kv_heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        n = self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))  # [1, 1, d]
        q = n.view(1, 1, -1, self.head).transpose(1, 2)  # [1, hq, 1, head]
        half = self.head // 2
        q = q * cos.unsqueeze(1) + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin.unsqueeze(1)
        k = k * cos.unsqueeze(1) + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin.unsqueeze(1)
        return q @ k.transpose(-1, -2)  # [1, hq, 1, 1]


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, 64, generator=g)
    cos, sin = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)
    return x, cos, sin, torch.randn(1, 4, 1, 16, generator=g)


def _calls(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_fuse_glue_makes_one_op_per_pattern_and_the_same_floats() -> None:
    gm = torch.export.export(Block(), _inputs()).module()
    with torch.inference_mode():
        want = gm(*_inputs(1))
    before = len(_calls(gm))
    counts = fuse_glue(gm)
    calls = _calls(gm)
    assert (counts.rms_norms, counts.rotaries) == (1, 2)
    assert calls.count("picompile_native.rms_norm.default") == 1 and calls.count("picompile_native.rotary.default") == 2
    assert not any(t.startswith(("aten.rsqrt", "aten.neg", "aten.pow")) for t in calls)  # the patterns' ops are gone
    assert len(calls) < before - 10
    with torch.inference_mode():
        got = gm(*_inputs(1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float(got.abs().max()) > 0


def test_rotary_loop_is_the_aten_floats_bit_for_bit() -> None:
    """At one position (the decode step's shapes) rotary runs as one loop; its floats are the aten ops', each
    product and sum rounded as aten rounds it; at several positions the aten ops run."""
    g = torch.Generator().manual_seed(3)
    for x, cos, sin in [
        (torch.randn(1, 1, 8, 64, generator=g).transpose(1, 2), torch.randn(1, 1, 1, 64, generator=g),
         torch.randn(1, 1, 1, 64, generator=g)),  # q after view + transpose, one position
        (torch.randn(1, 8, 5, 32, generator=g), torch.randn(1, 1, 5, 32, generator=g), torch.randn(1, 1, 5, 32, generator=g)),
    ]:
        half = x.shape[-1] // 2
        want = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
        got = torch.ops.picompile_native.rotary(x, cos, sin, half)
        assert got.shape == want.shape and torch.equal(got, want)


def test_rms_norm_loop_is_close_to_the_aten_ops() -> None:
    g = torch.Generator().manual_seed(4)
    for shape in [(1, 1, 2048), (1, 3, 96), (7,)]:
        x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
        want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        got = torch.ops.picompile_native.rms_norm(x, w, 1e-6)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("length", [5, 70])
@pytest.mark.parametrize("mask", ["bool", "float", "per-head", None])
def test_attention_op_is_the_python_one(mask: str | None, length: int) -> None:
    """One query position (the one-token loop; k / v views of a longer arena, as the KV cache hands them) and
    several (the aten ops), each mask form: the Python op's result within 1e-5."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 8, 1, 16, generator=g)
    k = torch.randn(1, 2, 128, 16, generator=g)[:, :, :length]
    v = torch.randn(1, 2, 128, 16, generator=g)[:, :, :length]
    m = {"bool": torch.rand(1, 1, 1, length, generator=g) < 0.7, "float": torch.randn(1, 1, 1, length, generator=g),
         "per-head": torch.rand(1, 8, 1, length, generator=g) < 0.5, None: None}[mask]
    if m is not None and m.dtype == torch.bool:
        m[..., 0] = True
    graph = torch.fx.Graph()
    nodes = [graph.placeholder(n) for n in ("q", "k", "v", "m")]
    graph.output(graph.call_function(grouped_attention, (*nodes, None if mask == "float" else 0.3)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    want = gm(q, k, v, m)
    assert fuse_glue(gm).attentions == 1 and _calls(gm) == ["picompile_native.grouped_attention.default"]
    got = gm(q, k, v, m)
    assert got.shape == want.shape == (1, 8, 1, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    several = torch.randn(1, 8, 3, 16, generator=g)  # three query positions: the aten ops, bit for bit
    m3 = None if m is None else m.expand(1, m.shape[1], 3, length)
    assert torch.equal(gm(several, k, v, m3), grouped_attention(several, k, v, m3, None if mask == "float" else 0.3))


@pytest.mark.parametrize("batch,kv_heads,length", [(1, 4, 96), (2, 3, 200), (1, 2, 40)])
def test_attention_on_the_kernel_pool_is_the_one_thread_loop(batch: int, kv_heads: int, length: int) -> None:
    """The one-token attention runs its (batch, KV head) groups on TVM's thread pool where it is registered
    (``set_parallel_launch``; the kernels' pool, idle between their calls): each group computed by the same code,
    so the result is the one-thread loop's bit for bit, for group counts that do and do not divide the threads."""
    from picompile.kernels import num_threads, set_num_threads

    launch = native._tvm_parallel_launch()
    if launch is None:
        pytest.skip("no libtvm_runtime with TVMBackendParallelLaunch in this process")
    g = torch.Generator().manual_seed(length)
    q = torch.randn(batch, kv_heads * 8, 1, 64, generator=g)
    k = torch.randn(batch, kv_heads, length, 64, generator=g)
    v = torch.randn(batch, kv_heads, length, 64, generator=g)
    m = torch.rand(batch, 1, 1, length, generator=g) < 0.8
    m[..., 0] = True
    op = torch.ops.picompile_native.grouped_attention
    threads = num_threads()
    try:
        set_num_threads(2)
        torch.ops.picompile_native.set_parallel_launch(0)
        alone = op(q, k, v, m, None)
        torch.ops.picompile_native.set_parallel_launch(launch)
        pooled = op(q, k, v, m, None)
    finally:
        torch.ops.picompile_native.set_parallel_launch(launch)
        set_num_threads(threads)
    assert torch.equal(pooled, alone)
    torch.testing.assert_close(pooled, grouped_attention(q, k, v, m, None), rtol=1e-5, atol=1e-6)


class Other(torch.nn.Module):
    """Near misses: a norm over the first dimension, a rotation by a third of the head."""

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n = w * (x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-5))
        return n * w + torch.cat((-n[..., 4:], n[..., :4]), dim=-1) * w


def test_fuse_glue_leaves_other_patterns() -> None:
    x, w = torch.randn(3, 12), torch.randn(12)
    gm = torch.export.export(Other(), (x, w)).module()
    before = _calls(gm)
    assert fuse_glue(gm).total() == 0 and _calls(gm) == before


def test_share_repeats_keeps_the_first() -> None:
    class Twice(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.unsqueeze(1) + x.unsqueeze(1) * 2

    gm = torch.export.export(Twice(), (torch.randn(4),)).module()
    x = torch.randn(4)
    want = gm(x)
    assert share_repeats(gm) == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert _calls(gm).count("aten.unsqueeze.default") == 1 and torch.equal(gm(x), want)



class CachedBlock(torch.nn.Module):
    """One Llama attention after its fused q/k/v GEMV, as HF writes it: heads split from the stacked output,
    rotate-half rotary on q and k, the past concatenated, grouped-query sdpa, heads merged back."""

    def forward(self, qkv: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def rot(x: torch.Tensor) -> torch.Tensor:
            return x * cos.unsqueeze(1) + torch.cat((-x[..., 4:], x[..., :4]), dim=-1) * sin.unsqueeze(1)

        s = qkv.shape[1]
        q = rot(qkv[..., :32].view(1, s, -1, 8).transpose(1, 2))  # [1, 4, s, 8]
        k = rot(qkv[..., 32:48].view(1, s, -1, 8).transpose(1, 2))  # [1, 2, s, 8]
        v = qkv[..., 48:64].view(1, s, -1, 8).transpose(1, 2)
        k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, scale=0.3, enable_gqa=True)
        return o.reshape(1, -1, s, 8).transpose(1, 2).reshape(1, s, -1), k, v


def test_fuse_glue_fuses_heads_and_the_cached_attention_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The q/k/v heads (slice, view, transpose, rotary) and, in the in-place cache form (kv_cache.arena_step),
    the KV writes, the attention and the head merge become 3 ``heads`` and 1 ``cached_attention``: the output
    and the cache contents of the glue without these two rewrites (native rotary and attention), bit for bit,
    step after step; the aten graph's within 1e-6."""
    from picompile.runtime import native_glue

    from torch.export import Dim

    from picompile.ir.graph import flatten_codegen
    from picompile.runtime.decode_attention import rewrite_attention
    from picompile.runtime.kv_cache import arena_step

    g = torch.Generator().manual_seed(3)
    past = torch.randn(1, 2, 5, 8, generator=g)
    inputs = (torch.randn(1, 1, 64, generator=g), past, past.clone(), torch.randn(1, 1, 8, generator=g),
              torch.randn(1, 1, 8, generator=g), torch.ones(1, 1, 1, 6, dtype=torch.bool))
    length = Dim("length", min=1, max=30)
    shapes = (None, {2: length}, {2: length}, None, None, {3: length + 1})
    gm = flatten_codegen(torch.export.export(CachedBlock(), inputs, dynamic_shapes=shapes).module())
    assert rewrite_attention(gm) == 1
    aten_form = arena_step(gm, 2, 16, [torch.zeros(1, 2, 16, 8) for _ in range(2)])
    plain = arena_step(gm, 2, 16, [torch.zeros(1, 2, 16, 8) for _ in range(2)])
    fused = arena_step(gm, 2, 16, [torch.zeros(1, 2, 16, 8) for _ in range(2)])
    with monkeypatch.context() as m:
        m.setattr(native_glue, "fuse_heads", lambda gm: 0)
        m.setattr(native_glue, "fuse_cached_attention", lambda gm: 0)
        assert fuse_glue(plain.graph).attentions == 1
    counts = fuse_glue(fused.graph)
    assert (counts.heads, counts.cached_attentions, counts.rotaries) == (3, 1, 2)
    calls = _calls(fused.graph)
    assert calls.count("picompile_native.heads.default") == 3
    assert calls.count("picompile_native.cached_attention.default") == 1
    assert not any(t.startswith(("aten.copy_", "aten.transpose", "aten.view", "picompile_native.grouped_attention"))
                   for t in calls)
    for n in range(5, 12):
        step = torch.randn(1, 1, 64, generator=g)
        cos, sin = torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 8, generator=g)
        mask = torch.rand(1, 1, 1, n + 1, generator=g) < 0.8
        mask[..., -1] = True
        with torch.inference_mode():
            (ref,) = aten_form.graph(step, *aten_form.views(n), cos, sin, mask)
            (want,) = plain.graph(step, *plain.views(n), cos, sin, mask)
            (got,) = fused.graph(step, *fused.views(n), cos, sin, mask)
        assert got.shape == (1, 1, 32)
        assert torch.equal(got, want)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(fused.arenas, plain.arenas))
        assert not torch.equal(fused.arenas[0][:, :, n], torch.zeros(1, 2, 8))  # this step's key was written


def test_drop_whole_slices_keeps_written_ones() -> None:
    """``x[..., 0:]`` (all of x) reads as x; a slice some op writes through stays."""
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    x.meta["val"] = y.meta["val"] = torch.empty(2, 6)
    whole = graph.call_function(aten.slice.Tensor, (x, -1, 0))
    part = graph.call_function(aten.slice.Tensor, (x, 0, 1))  # [1, 6]: not all of x
    written = graph.call_function(aten.slice.Tensor, (y, 0, 0, 9))
    graph.call_function(aten.copy_.default, (written, whole))
    graph.output(graph.call_function(aten.add.Tensor, (whole, part)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    a, b = torch.randn(2, 6), torch.zeros(2, 6)
    want = gm(a, b.clone())
    assert drop_whole_slices(gm) == 1
    gm.recompile()
    assert _calls(gm).count("aten.slice.Tensor") == 2
    got = gm(a, b)
    assert torch.equal(got, want) and torch.equal(b, a)


def test_heads_and_cached_attention_equal_their_aten_ops() -> None:
    """The two ops alone, beyond the one-token case the glue makes: two sequences, several positions, x's rows
    strided. ``heads`` equals slice / view / transpose (and the aten rotate-half) bit for bit; ``cached_attention``
    writes the new rows at ``start`` and equals ``grouped_attention`` over the cache's first ``start + s`` rows."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 40, generator=g)[..., :36]  # [b, s, 36], rows 40 apart
    cos, sin = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)
    h = x[..., 4:20].view(2, 3, 2, 8).transpose(1, 2)
    want = h * cos + torch.cat((-h[..., 4:], h[..., :4]), dim=-1) * sin
    heads = torch.ops.picompile_native.heads
    got = heads(x, 4, 2, 8, cos, sin, 4)
    assert got.shape == (2, 2, 3, 8) and got.is_contiguous() and torch.equal(got, want)
    plain = heads(x, 20, 2, 8, None, None, 0)
    assert plain.is_contiguous() and torch.equal(plain, x[..., 20:36].view(2, 3, 2, 8).transpose(1, 2))
    with pytest.raises(RuntimeError, match="do not fit"):
        heads(x, 30, 2, 8, None, None, 0)

    q, k, v = (torch.randn(2, hh, 2, 8, generator=g) for hh in (4, 2, 2))
    kc, vc = torch.randn(2, 2, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    want_k, want_v = kc.clone(), vc.clone()
    want_k[:, :, 3:5], want_v[:, :, 3:5] = k, v
    want = grouped_attention(q, want_k[:, :, :5], want_v[:, :, :5], None, 0.3).transpose(1, 2).reshape(2, 2, 32)
    got = torch.ops.picompile_native.cached_attention(q, k, v, kc, vc, 3, 3, None, 0.3)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert got.shape == (2, 2, 32) and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="past the cache"):
        torch.ops.picompile_native.cached_attention(q, k, v, kc, vc, 9, 9, None, 0.3)


def test_fuse_heads_leaves_heads_written_through_a_view() -> None:
    """A head view some op writes through (here a slice of it, ``copy_``'d into) stays a view: a copy would take
    the write away from the projection it views."""
    from picompile.runtime.native_glue import fuse_heads

    graph = torch.fx.Graph()
    qkv, new = graph.placeholder("qkv"), graph.placeholder("new")
    qkv.meta["val"], new.meta["val"] = torch.empty(1, 1, 32), torch.empty(1, 2, 1, 8)
    sl = graph.call_function(aten.slice.Tensor, (qkv, -1, 16, 32))
    sl.meta["val"] = torch.empty(1, 1, 16)
    view = graph.call_function(aten.view.default, (sl, [1, 1, -1, 8]))
    view.meta["val"] = torch.empty(1, 1, 2, 8)
    t = graph.call_function(aten.transpose.int, (view, 1, 2))
    t.meta["val"] = torch.empty(1, 2, 1, 8)
    part = graph.call_function(aten.slice.Tensor, (t, 1, 0, 1))
    graph.call_function(aten.copy_.default, (part, graph.call_function(aten.slice.Tensor, (new, 1, 0, 1))))
    graph.output(graph.call_function(aten.mul.Tensor, (qkv, 2.0)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x, n = torch.randn(1, 1, 32), torch.randn(1, 2, 1, 8)
    want = gm(x.clone(), n)
    assert fuse_heads(gm) == 0
    gm.recompile()
    assert torch.equal(gm(x.clone(), n), want) and not torch.equal(want, x * 2.0)  # the write reached qkv
