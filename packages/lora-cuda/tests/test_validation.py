"""Bad input is rejected at the boundary with an error naming the argument (docs/architecture.md)."""

import pytest
import torch

from lora_core.testing import make_batch_info
from lora_cuda import sgemm_lora_a_embedding_fwd, sgemm_lora_a_fwd, sgemm_lora_b_fwd

INFO = make_batch_info([3, 2], [0, 1], [4, 2], device="cpu")
X = torch.randn(5, 8)
A = torch.randn(2, 8, 8)  # 2 slices of R = 4
B = torch.randn(2, 10, 4)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: sgemm_lora_a_fwd(torch.randn(4, 8), A, INFO, 2), r"x has 4 rows but the batch info was built for 5"),
        (lambda: sgemm_lora_a_fwd(X, A.half(), INFO, 2), "weights has dtype torch.float16 but x has torch.float32"),
        (lambda: sgemm_lora_a_fwd(X, torch.randn(3, 8, 8), INFO, 2), "weights has 3 slots .* batch info has 2"),
        (lambda: sgemm_lora_a_fwd(X, torch.randn(2, 8, 7), INFO, 2), r"weights must have shape \(L, c\*R, 8\)"),
        (lambda: sgemm_lora_a_fwd(X, A, INFO, 3), r"weights dim 1 \(8\) is not num_slices \(3\) times a rank"),
        (lambda: sgemm_lora_a_fwd(X, torch.randn(2, 2, 8), INFO, 2), "slot 0 has rank 4 but the weights hold at most R = 1"),
        (lambda: sgemm_lora_a_fwd(X[0], A, INFO), "x must be 2-D"),
        (lambda: sgemm_lora_a_fwd(X.to("meta"), A.to("meta"), INFO), "the batch info lives on cpu but x is on meta"),
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 8), B, INFO, [0, 6, 9]), "slice_offsets end at 9 but weights have 10"),
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 8), B, INFO, [0, 6, 6, 10]), "increasing ints starting at 0"),
        # tuples take the fast path of normalize_slice_offsets: it must reject what the general path rejects
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 8), B, INFO, (0, 6, 6, 10)), "increasing ints starting at 0"),
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 8), B, INFO, (0, True, 10)), "increasing ints starting at 0"),
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 8), B, INFO, (0, 6.0, 10)), "increasing ints starting at 0"),
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 8), B, INFO, (1, 6, 10)), "increasing ints starting at 0"),
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 4), B, INFO, [0, 6, 10]), r"x must have 2 x R = 8 columns"),
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 8), B, INFO, [0, 6, 10], torch.randn(5, 9)),
         r"base_output must have shape \(5, 10\)"),
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 8), B, INFO, torch.tensor([0.0, 6.0, 10.0])), "CPU integer tensor"),
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 8), torch.randn(3, 10, 4), INFO, [0, 6, 10]),
         "weights has 3 slots .* batch info has 2"),
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 8), B.half(), INFO, [0, 6, 10]),
         "weights has dtype torch.float16 but x has torch.float32"),
        (lambda: sgemm_lora_b_fwd(torch.randn(5, 8), B, INFO, [0, 6, 10], torch.randn(5, 10).half()),
         "base_output has dtype torch.float16 but x has torch.float32"),
        (lambda: sgemm_lora_b_fwd(torch.randn(4, 8), B, INFO, [0, 6, 10]), r"x has 4 rows but the batch info"),
        (lambda: sgemm_lora_a_embedding_fwd(torch.zeros(5), torch.randn(2, 4, 10), INFO, 10), "ids must be an integer"),
        (lambda: sgemm_lora_a_embedding_fwd(torch.zeros(5, dtype=torch.long), torch.randn(2, 4, 10), INFO, 12),
         "weights have 10 vocabulary columns, fewer than vocab_size \\+ added tokens = 12"),
    ],
)
def test_bad_input_names_the_problem(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("backend_name", ["torch_native", "ascend"])
@pytest.mark.parametrize(("args", "error", "match"), [
    ((torch.randn(5, 10), torch.ones(2, 10), [0.0] * 10), TypeError, "bias must be a torch.Tensor, got list"),
    ((torch.randn(5, 10, dtype=torch.float64), torch.ones(2, 10), None), ValueError,
     "output has dtype torch.float64; supported"),
    ((torch.randn(5, 10), torch.ones(2, 10), torch.zeros(10, dtype=torch.int64)), ValueError,
     r"bias must be a floating-point tensor, got \(10,\) torch.int64"),
    ((torch.randn(5, 10), torch.ones(2, 10), torch.zeros(1, 10)), ValueError, "bias must be 1-D"),
    ((torch.randn(5, 10), [[1.0] * 10] * 2, None), TypeError, "factors must be a torch.Tensor, got list"),
    ((torch.randn(5, 10), torch.ones(2, 10, dtype=torch.float64), None), ValueError, "factors must be float32"),
    ((torch.randn(10), torch.ones(2, 10), None), ValueError, "output must be 2-D"),
])
def test_dora_scale_validates_like_every_other_op(backend_name, args, error, match):
    """run_dora_scale goes through lora_core.validation's checks: the dtypes run_packed refuses
    (float64) and arguments of the wrong kind are named, never an AttributeError from inside."""
    from lora_core import get_backend

    backend = get_backend(backend_name)("cpu")
    backend.prepare_batch(INFO)
    with pytest.raises(error, match=match):
        backend.run_dora_scale(*args)


@pytest.mark.parametrize("backend_name", ["torch_native", "ascend"])
def test_dora_scale_takes_a_bias_of_another_float_dtype(backend_name):
    """A bf16 output with the base layer's fp32 bias (autocast) is rescaled: the op computes in float32."""
    from lora_core import get_backend
    from lora_core.dora import reference_dora_scale

    backend = get_backend(backend_name)("cpu")
    backend.prepare_batch(INFO)
    output, factors, bias = torch.randn(5, 10).bfloat16(), torch.rand(2, 10) + 0.5, torch.randn(10)
    want = reference_dora_scale(output, factors, INFO, bias)
    torch.testing.assert_close(backend.run_dora_scale(output.clone(), factors, bias).float(), want,
                               rtol=1e-2, atol=1e-2)


def test_graph_batch_info_rejects_more_rows_than_its_capacity():
    info = make_batch_info([3, 2], [0, 1], [4, 2], device="cpu", use_graph=True)
    with pytest.raises(ValueError, match="holds 5 tokens and 5 rows of capacity"):
        sgemm_lora_a_fwd(torch.randn(6, 8), A, info, 2)


def test_strict_mode_names_the_first_out_of_vocab_positions():
    ids = torch.tensor([1, -3, 2, 10, 9])
    weights = torch.randn(2, 4, 10)
    assert sgemm_lora_a_embedding_fwd(ids, weights, INFO, 10)[[1, 3]].abs().sum() == 0  # default: zero delta
    with pytest.raises(ValueError, match=r"ids\[1\] = -3, ids\[3\] = 10"):
        sgemm_lora_a_embedding_fwd(ids, weights, INFO, 10, strict_token_ids=True)
