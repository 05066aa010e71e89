"""The shared quantized layout (picompile.kernels.qformat): round trip, packing order, llama.cpp's rounding."""
import pytest
import torch

from picompile.kernels.qformat import QFormat, dequantize, format_of, pack_int4, quantize, unpack_int4


@pytest.mark.parametrize("name,tol", [("int8", 0.01), ("int4", 0.12)])
@pytest.mark.parametrize("block", [32, 64])
def test_round_trip_error_is_small(name: str, tol: float, block: int) -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    q, s = quantize(w, QFormat(name, block))
    assert format_of(q, s) == QFormat(name, block)
    assert s.shape == (48, 256 // block) and s.dtype == torch.float16
    err = (dequantize(q, s) - w).norm() / w.norm()
    assert 0 < err < tol


def test_int4_packing_order_is_llama_cpp_q4_0() -> None:
    nib = torch.arange(32, dtype=torch.uint8).remainder(16).reshape(1, 32)  # element j = j mod 16
    q = pack_int4(nib, 32)
    assert q.shape == (1, 16)
    assert q[0, 3].item() == (3 | (3 << 4))  # element 3 low, element 3 + 16 high
    assert torch.equal(unpack_int4(q, 32), nib)


def test_matches_gguf_reference_quantizers() -> None:
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    for name, t in (("int8", gguf.GGMLQuantizationType.Q8_0), ("int4", gguf.GGMLQuantizationType.Q4_0)):
        q, s = quantize(w, QFormat(name, 32))
        ref = quants.dequantize(quants.quantize(w.numpy(), t), t)
        assert torch.equal(dequantize(q, s), torch.from_numpy(ref).float()), name


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="whole number"):
        quantize(torch.randn(4, 40), QFormat("int8", 32))
    with pytest.raises(ValueError, match="block"):
        QFormat("int4", 48)
    with pytest.raises(ValueError, match="not a quantized weight"):
        format_of(torch.zeros(4, 32), torch.zeros(4, 1, dtype=torch.float16))


def test_int8_ties_round_away_from_zero_as_roundf() -> None:
    # a block whose max is 127 · 0.5 makes d = 0.5 exactly: 0.25 / 0.5 = 0.5 and -1.25 / 0.5 = -2.5 are ties
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 63.5, 0.25, -1.25
    q, s = quantize(w, QFormat("int8", 32))
    assert s[0, 0].item() == 0.5
    assert q[0, :3].tolist() == [127, 1, -3]  # torch.round (ties to even) would give 0 and -2
