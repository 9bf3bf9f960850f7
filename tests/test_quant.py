"""zerolab.book.quant: blockwise int8/int4 quantization (chapter 9's measurements of ZeRO++)."""
import pytest
import torch

from zerolab.book import quant


def test_int8_values_exact_when_representable():
    # block of 4: scale = 127/127 = 1, so integers in [-127, 127] survive exactly
    x = torch.tensor([127.0, -3.0, 0.0, 5.0, -127.0, 1.0, 2.0, 3.0])
    qt = quant.quantize(x, bits=8, block=4)
    assert qt.data.dtype == torch.int8 and qt.scales.tolist() == [1.0, 1.0]
    assert torch.equal(quant.dequantize(qt), x)


def test_int4_packing_and_known_values():
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, -2.0])        # odd length: padding nibble
    qt = quant.quantize(x, bits=4, block=8)
    assert qt.data.dtype == torch.uint8 and qt.data.numel() == 3
    # nibbles offset by 8: 15, 1, 9, 8, 6, (pad 8)
    assert qt.data.tolist() == [15 | (1 << 4), 9 | (8 << 4), 6 | (8 << 4)]
    assert quant.dequantize(qt).tolist() == x.tolist()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [1, 7, 64, 1000])
def test_error_at_most_half_a_step(bits, block):
    torch.manual_seed(bits * 1000 + block)
    x = torch.randn(999) * torch.linspace(0.01, 3, 999)
    qt = quant.quantize(x, bits, block)
    back = quant.dequantize(qt, torch.float32)
    n_blocks = -(-999 // block)
    assert qt.scales.numel() == n_blocks
    step = qt.scales.repeat_interleave(block)[:999]
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-12)
    # scales are per block absmax / qmax
    pad = torch.zeros(n_blocks * block)
    pad[:999] = x
    assert torch.allclose(qt.scales, pad.view(n_blocks, block).abs().amax(1) / quant.QMAX[bits])


def test_bytes():
    x = torch.randn(10_000, dtype=torch.bfloat16)
    r8 = quant.error_report(x, 8, 2048)
    r4 = quant.error_report(x, 4, 2048)
    assert r8["bytes_original"] == 20_000
    assert r8["bytes_quantized"] == 10_000 + 5 * 4          # 5 blocks of 2048, fp32 scales
    assert r4["bytes_quantized"] == 5_000 + 5 * 4
    assert r8["max_abs_error"] <= r8["max_half_step"] * (1 + 1e-5)
    assert r4["relative_error"] > r8["relative_error"] > 0


def test_zero_block_and_dtype_kept():
    x = torch.zeros(10, dtype=torch.float16)
    back = quant.roundtrip(x, 4, 4)
    assert back.dtype == torch.float16 and back.shape == x.shape and not back.any()


def test_reduce_quantized_exact_and_ring_worse():
    # each contribution alone is exact in int8 (scale 1); the ring's partial sum [254, 3] has
    # scale 2, so its 3 becomes round(1.5) * 2 = 4 on the second hop
    ints = [torch.tensor([127.0, 1.0]), torch.tensor([127.0, 2.0]), torch.tensor([0.0, 0.0])]
    assert quant.reduce_quantized(ints, 8, 2, "all_to_all").tolist() == [254.0, 3.0]
    assert quant.reduce_quantized(ints, 8, 2, "ring").tolist() == [254.0, 4.0]
    torch.manual_seed(0)
    grads = [torch.randn(4096) for _ in range(8)]
    exact = torch.stack(grads).sum(0)
    err = {s: float((quant.reduce_quantized(grads, 4, 256, s) - exact).norm() / exact.norm())
           for s in ("ring", "all_to_all")}
    assert err["ring"] > 1.5 * err["all_to_all"] > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        quant.quantize(torch.ones(3), bits=2)
    with pytest.raises(ValueError, match="block"):
        quant.quantize(torch.ones(3), block=0)
    with pytest.raises(ValueError, match="floating"):
        quant.quantize(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="scheme"):
        quant.reduce_quantized([torch.ones(2)], scheme="tree")
