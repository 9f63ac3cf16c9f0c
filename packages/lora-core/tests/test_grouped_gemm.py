"""lora_core.grouped_gemm: when torch._grouped_mm takes a weight stack as it is."""

import pytest
import torch

from lora_core.grouped_gemm import grouped_gemm_fits

NEEDS_GROUPED_MM = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm (torch >= 2.9)")


@NEEDS_GROUPED_MM
def test_contiguous_aligned_stacks_with_16_byte_strides_fit():
    a, b = torch.zeros(4, 8, 32), torch.zeros(4, 32, 8)
    assert grouped_gemm_fits((a, b), 8, 32)
    assert grouped_gemm_fits((a.bfloat16(),), 8, 32)  # 8 bf16 = 16 bytes


@NEEDS_GROUPED_MM
@pytest.mark.parametrize("case", ["unaligned size", "bf16 size", "transposed", "offset data"])
def test_what_the_grouped_gemm_rejects_does_not_fit(case):
    w = torch.zeros(4, 8, 32)
    stacks, sizes = {
        "unaligned size": ((w,), (8, 3)),  # 3 fp32 = 12 bytes
        "bf16 size": ((w.bfloat16(),), (4,)),  # 4 bf16 = 8 bytes
        "transposed": ((w.transpose(1, 2),), (8, 32)),  # not contiguous
        "offset data": ((torch.zeros(4 * 8 * 32 + 1)[1:].view(4, 8, 32),), (8, 32)),  # data 4 bytes off
    }[case]
    assert not grouped_gemm_fits(stacks, *sizes)


def test_nothing_fits_without_the_grouped_gemm(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert not grouped_gemm_fits((torch.zeros(4, 8, 32),), 8, 32)


def test_stacks_of_mixed_dtypes_or_none_are_refused():
    with pytest.raises(ValueError, match="one dtype"):
        grouped_gemm_fits((torch.zeros(2, 8, 8), torch.zeros(2, 8, 8).bfloat16()), 8)
    with pytest.raises(ValueError, match="one or more"):
        grouped_gemm_fits((), 8)
