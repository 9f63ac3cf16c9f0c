"""Boundary checks for LoRA op inputs, shared by every backend.

All checks read metadata only (shapes, dtypes, devices, host-side batch data):
none of them synchronises the device, so backends run them on every call.
The one exception is :func:`check_token_ids`, which inspects id values and
therefore reads them back: backends call it only when their
``strict_token_ids`` option is on, and it is skipped while a graph is captured.

While ``torch.compile`` traces (:func:`tracing_for_compile`), a graph-mode batch is
checked like a capture (exactly its capacity's rows) and nothing that a refill or
``set_adapters`` changes is read (the real token count, the slot ranks, the ids):
read there, they would become guards of the compiled code, which would recompile
for every batch (docs/compile.md). The eager warm-up call before a compile, and
every eager call, still checks them.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch

from .batch_info import BatchInfo
from .checks import SUPPORTED_FLOAT_DTYPES, are_plain_ints, check_float_dtype, check_int, is_int
from .graphs import is_capturing
from .layout import slice_offsets_from_widths

__all__ = [
    "tracing_for_compile", "check_num_tokens", "check_token_ids", "normalize_slice_offsets", "check_offsets_readable",
    "check_lora_a_inputs", "check_lora_b_inputs", "check_embedding_inputs", "check_added_token_inputs",
    "check_experts_lora_inputs", "check_experts_lora_a_inputs", "check_experts_lora_b_inputs", "check_dora_scale_inputs",
]


def tracing_for_compile() -> bool:
    """True while ``torch.compile`` (dynamo) traces the calling code."""
    return torch.compiler.is_compiling()


def check_token_ids(ids: torch.Tensor, num_valid: int, *, max_report: int = 8) -> None:
    """Raise ``ValueError`` naming the first positions whose id is outside ``[0, num_valid)``
    (reads ids back: call it only in strict mode; a no-op while capturing or compiling)."""
    if is_capturing() or tracing_for_compile():
        return
    bad = ((ids < 0) | (ids >= num_valid)).nonzero().flatten()[:max_report].tolist()
    if bad:
        shown = ", ".join(f"ids[{p}] = {int(ids[p])}" for p in bad)
        raise ValueError(f"token ids outside the vocabulary [0, {num_valid}): {shown}")


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def _check_tensor(name: str, t: object, dim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got {_describe(t)}")
    return t


_ID_DTYPES = (torch.int32, torch.int64)


def _check_integer_ids(ids: torch.Tensor) -> None:
    """Token ids are int32 or int64, as ``torch.nn.functional.embedding`` takes them: narrower
    integer dtypes (int8, uint8, int16, ...) cannot hold a vocabulary and are rejected, not converted."""
    if ids.dtype not in _ID_DTYPES:
        kind = "an integer tensor" if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool \
            else "an int32 or int64 tensor"
        raise ValueError(f"ids must be {kind} (int32 or int64), got {ids.dtype}")


def _check_same(name: str, t: torch.Tensor, ref_name: str, dtype: torch.dtype, device: torch.device) -> None:
    """``t`` has ``ref_name``'s ``dtype`` and ``device`` (read once by the caller: each read
    builds a Python object, and the ops check every call)."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {device}")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {dtype}")


def check_num_tokens(batch_info: BatchInfo, num_rows: int, name: str = "x") -> None:
    """Rows given to an op must match the batch (or fit the graph-mode capacity; exactly the
    capacity while a graph is captured or compiled, since later batches may fill it)."""
    if batch_info.use_graph:
        compiling = tracing_for_compile()
        if (compiling or is_capturing()) and num_rows != batch_info.capacity:
            raise ValueError(
                f"{name} has {num_rows} rows while a graph is captured; a graph-mode batch is captured with "
                f"exactly its capacity ({batch_info.capacity} rows), which later batches may fill"
            )
        if compiling:  # the real token count changes with every refill: never a guard
            return
        if not batch_info.num_real_tokens <= num_rows <= batch_info.capacity:
            raise ValueError(
                f"{name} has {num_rows} rows; the graph batch info holds {batch_info.num_real_tokens} "
                f"tokens and {batch_info.capacity} rows of capacity"
            )
    elif num_rows != batch_info.num_tokens:
        raise ValueError(
            f"{name} has {num_rows} rows but the batch info was built for {batch_info.num_tokens} tokens "
            f"(seq_lens = {list(batch_info.seq_lens)})"
        )


def _check_batch_device(batch_info: BatchInfo, device: torch.device, name: str) -> None:
    if batch_info.device != device:
        raise ValueError(f"the batch info lives on {batch_info.device} but {name} is on {device}")


def _check_slots(batch_info: BatchInfo, weights: torch.Tensor, name: str) -> None:
    if weights.shape[0] != batch_info.num_slots:
        raise ValueError(
            f"{name} has {weights.shape[0]} slots (dim 0) but the batch info has {batch_info.num_slots}"
        )


def _check_x_and_weights(
    x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo
) -> tuple[torch.dtype, torch.device]:
    """A shrink's or expand's ``x (T, *)`` and ``weights (L, *, *)``: tensors of one supported
    float dtype on the batch's device, one weight slot per batch slot. Returns ``x``'s dtype and
    device. The checks that raise run only once a cheap test fails: this runs on every call."""
    _check_tensor("x", x, 2)
    _check_tensor("weights", weights, 3)
    dtype, device = x.dtype, x.device
    if dtype not in SUPPORTED_FLOAT_DTYPES:
        check_float_dtype("x", dtype)
    if weights.device != device or weights.dtype != dtype:
        _check_same("weights", weights, "x", dtype, device)
    if batch_info.device != device:
        _check_batch_device(batch_info, device, "x")
    if weights.shape[0] != batch_info.num_slots:
        _check_slots(batch_info, weights, "weights")
    return dtype, device


def check_lora_a_inputs(x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_slices: int) -> int:
    """``x (T, in)``, ``weights (L, c*R, in)``; returns ``R``."""
    _check_x_and_weights(x, weights, batch_info)
    if type(num_slices) is not int or num_slices < 1:
        num_slices = check_int("num_slices", num_slices, minimum=1)
    (num_rows, in_features), (_, cR, w_in) = x.shape, weights.shape
    if cR % num_slices:
        raise ValueError(f"weights dim 1 ({cR}) is not num_slices ({num_slices}) times a rank")
    if w_in != in_features:
        raise ValueError(
            f"weights must have shape (L, c*R, {in_features}) for x {_describe(x)}, got {_describe(weights)}")
    R = cR // num_slices
    _check_ranks(batch_info, R)
    if batch_info.use_graph or num_rows != batch_info.num_tokens:  # an eager batch that matches passes
        check_num_tokens(batch_info, num_rows)
    return R


def _check_ranks(batch_info: BatchInfo, max_rank: int) -> None:
    if tracing_for_compile():  # ranks change with set_adapters: checked by eager calls, never a guard
        return
    ranks = batch_info.lora_ranks_host
    if max(ranks, default=0) <= max_rank:
        return
    slot = next(s for s, r in enumerate(ranks) if r > max_rank)
    raise ValueError(f"slot {slot} has rank {ranks[slot]} but the weights hold at most R = {max_rank}")


def check_offsets_readable(slice_offsets: Sequence[int] | torch.Tensor) -> None:
    """Refuse a tensor of ``slice_offsets`` under ``torch.compile``, which cannot guard on its
    values. (A CUDA graph capture may read it: it is a CPU tensor, host data whose values
    become constants of the graph, like ints; the CPU simulator needs it declared
    ``host_resident``, as for any host metadata.)"""
    if isinstance(slice_offsets, torch.Tensor) and tracing_for_compile():
        raise ValueError("slice_offsets is a tensor inside torch.compile, which cannot guard on its values; "
                         "pass Python ints, e.g. (0, 6, 10)")


def normalize_slice_offsets(slice_offsets: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    """Slice offsets as a tuple of Python ints ``(0, o1, ..., out_total)``, validated."""
    if (type(slice_offsets) is tuple and len(slice_offsets) > 1 and slice_offsets[0] == 0  # every layer call:
            and are_plain_ints(slice_offsets)  # C-level loops only, no generator frames
            and all(map(operator.lt, slice_offsets, slice_offsets[1:]))):
        return slice_offsets  # what the general path below returns for it; anything else is checked there
    if isinstance(slice_offsets, torch.Tensor):
        if slice_offsets.device.type != "cpu" or slice_offsets.dtype.is_floating_point or slice_offsets.dim() != 1:
            raise ValueError(
                f"slice_offsets must be Python ints or a 1-D CPU integer tensor, got {_describe(slice_offsets)}"
            )
        check_offsets_readable(slice_offsets)
        values = slice_offsets.tolist()
    else:
        try:
            values = list(slice_offsets)
        except TypeError:
            values = None
    if not values or len(values) < 2 or values[0] != 0 or not all(is_int(v) for v in values):  # >= 1 slice
        raise ValueError(f"slice_offsets must be increasing ints starting at 0, like [0, o1, ..., out], "
                         f"got {slice_offsets!r}")
    try:
        return slice_offsets_from_widths([int(b) - int(a) for a, b in zip(values, values[1:])], name="slice_offsets")
    except ValueError:
        raise ValueError(f"slice_offsets must be increasing ints starting at 0, like [0, o1, ..., out], "
                         f"got {values}") from None


def check_lora_b_inputs(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    slice_offsets: Sequence[int] | torch.Tensor,
    base_output: torch.Tensor | None,
    base_batch: BatchInfo | None = None,
) -> tuple[int, ...]:
    """``x (T, c*R)``, ``weights (L, out_total, R)``, ``base_output (T, out_total)``, or with a row per token
    of ``base_batch`` when given (a batch's pair rows add into its tokens); returns the slice offsets as ints."""
    offsets = normalize_slice_offsets(slice_offsets)
    dtype, device = _check_x_and_weights(x, weights, batch_info)
    num_slices, out_total = len(offsets) - 1, offsets[-1]
    (num_rows, cR), (_, w_out, R) = x.shape, weights.shape
    if out_total != w_out:
        raise ValueError(
            f"slice_offsets end at {out_total} but weights have {w_out} output rows: {_describe(weights)}"
        )
    if cR != num_slices * R:
        raise ValueError(
            f"x must have {num_slices} x R = {num_slices * R} columns for {num_slices} slice(s), got {_describe(x)}"
        )
    _check_ranks(batch_info, R)
    if batch_info.use_graph or num_rows != batch_info.num_tokens:
        check_num_tokens(batch_info, num_rows)
    if base_output is not None:
        _check_tensor("base_output", base_output, 2)
        _check_same("base_output", base_output, "x", dtype, device)
        if base_batch is not None:
            check_num_tokens(base_batch, base_output.shape[0], "base_output")
        if base_output.shape != (want := (num_rows if base_batch is None else base_output.shape[0], out_total)):
            raise ValueError(f"base_output must have shape {want}, got {_describe(base_output)}")
    return offsets


def check_embedding_inputs(
    ids: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    vocab_size: int,
    extra_embeddings: torch.Tensor | None,
) -> int:
    """``ids (T,)`` integer, ``weights (L, R, V_total)``, ``extra_embeddings (L, added, D)``;
    returns the number of valid ids ``vocab_size + added``."""
    _check_tensor("ids", ids, 1)
    _check_tensor("weights", weights, 3)
    _check_integer_ids(ids)
    check_float_dtype("weights", weights.dtype)
    if ids.device != weights.device:
        raise ValueError(f"ids is on {ids.device} but weights is on {weights.device}")
    _check_batch_device(batch_info, ids.device, "ids")
    _check_slots(batch_info, weights, "weights")
    vocab_size = check_int("vocab_size", vocab_size, minimum=1)
    added = 0
    if extra_embeddings is not None:
        _check_tensor("extra_embeddings", extra_embeddings, 3)
        if extra_embeddings.device != weights.device:
            raise ValueError(f"extra_embeddings is on {extra_embeddings.device} but weights is on {weights.device}")
        _check_slots(batch_info, extra_embeddings, "extra_embeddings")
        added = extra_embeddings.shape[1]
    if weights.shape[2] < vocab_size + added:
        raise ValueError(
            f"weights have {weights.shape[2]} vocabulary columns, fewer than vocab_size + added tokens "
            f"= {vocab_size + added}: {_describe(weights)}"
        )
    _check_ranks(batch_info, weights.shape[1])
    check_num_tokens(batch_info, ids.shape[0], "ids")
    return vocab_size + added


def check_added_token_inputs(
    ids: torch.Tensor,
    extra_embeddings: torch.Tensor,
    batch_info: BatchInfo,
    vocab_size: int,
    base_output: torch.Tensor,
) -> None:
    """``ids (T,)`` integer, ``extra_embeddings (L, added, D)``, ``base_output (T, D)``."""
    _check_tensor("ids", ids, 1)
    _check_integer_ids(ids)
    _check_tensor("extra_embeddings", extra_embeddings, 3)
    _check_tensor("base_output", base_output, 2)
    check_float_dtype("base_output", base_output.dtype)
    _check_same("extra_embeddings", extra_embeddings, "base_output", base_output.dtype, base_output.device)
    _check_batch_device(batch_info, ids.device, "ids")
    _check_batch_device(batch_info, base_output.device, "base_output")
    _check_slots(batch_info, extra_embeddings, "extra_embeddings")
    check_int("vocab_size", vocab_size, minimum=1)
    if tuple(base_output.shape) != (ids.shape[0], extra_embeddings.shape[2]):
        raise ValueError(f"base_output must have shape {(ids.shape[0], extra_embeddings.shape[2])}, "
                         f"got {_describe(base_output)}")
    check_num_tokens(batch_info, ids.shape[0], "ids")


def _check_expert_pairs(x: torch.Tensor, expert_ids: torch.Tensor, name: str, weights: torch.Tensor,
                        batch_info: BatchInfo) -> None:
    """What every experts op checks first: ``x (T, K, n)`` of a supported float dtype on the batch's
    device, ``expert_ids (T, K)`` int32/int64 beside it, ``weights`` 4-D of ``x``'s dtype and device."""
    _check_tensor("x", x, 3)
    _check_tensor("expert_ids", expert_ids, 2)
    _check_tensor(name, weights, 4)
    check_float_dtype("x", x.dtype)
    _check_same(name, weights, "x", x.dtype, x.device)
    if expert_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"expert_ids must be an int32 or int64 tensor, got {expert_ids.dtype}")
    if expert_ids.device != x.device:
        raise ValueError(f"expert_ids is on {expert_ids.device} but x is on {x.device}")
    _check_batch_device(batch_info, x.device, "x")
    if expert_ids.shape != x.shape[:2]:
        raise ValueError(f"expert_ids must have shape {tuple(x.shape[:2])} for x {_describe(x)}, "
                         f"got {_describe(expert_ids)}")


def check_experts_lora_a_inputs(x: torch.Tensor, expert_ids: torch.Tensor, a_weights: torch.Tensor,
                                batch_info: BatchInfo) -> None:
    """The experts shrink's inputs: ``x (T, K, in)``, ``expert_ids (T, K)`` int32/int64,
    ``a_weights (L, E, R, in)``; one float dtype, the batch's device, one weight slot per
    batch slot, ``T`` rows of the batch."""
    _check_expert_pairs(x, expert_ids, "a_weights", a_weights, batch_info)
    if a_weights.shape[3] != x.shape[2]:
        raise ValueError(f"a_weights must have shape (L, E, R, {x.shape[2]}) for x {_describe(x)}, "
                         f"got {_describe(a_weights)}")
    _check_slots(batch_info, a_weights, "a_weights")
    _check_ranks(batch_info, a_weights.shape[2])
    check_num_tokens(batch_info, x.shape[0])


def check_experts_lora_b_inputs(x: torch.Tensor, expert_ids: torch.Tensor, b_weights: torch.Tensor,
                                batch_info: BatchInfo, base_output: torch.Tensor | None) -> None:
    """The experts expand's inputs: ``x (T, K, R)`` (a shrink's output), ``expert_ids (T, K)``
    int32/int64, ``b_weights (L, E, out, R)``, ``base_output (T, K, out)`` or ``None``; one float
    dtype, the batch's device, one weight slot per batch slot, ``T`` rows of the batch."""
    _check_expert_pairs(x, expert_ids, "b_weights", b_weights, batch_info)
    if b_weights.shape[3] != x.shape[2]:
        raise ValueError(f"b_weights must have shape (L, E, out, {x.shape[2]}) for x {_describe(x)} (a shrink's "
                         f"(T, K, R)), got {_describe(b_weights)}")
    _check_experts_output(base_output, x, b_weights.shape[2])
    _check_slots(batch_info, b_weights, "b_weights")
    _check_ranks(batch_info, b_weights.shape[3])
    check_num_tokens(batch_info, x.shape[0])


def check_experts_lora_inputs(x: torch.Tensor, expert_ids: torch.Tensor, a_weights: torch.Tensor,
                              b_weights: torch.Tensor, batch_info: BatchInfo,
                              base_output: torch.Tensor | None) -> None:
    """The fused experts op's inputs: the shrink's (:func:`check_experts_lora_a_inputs`), and
    ``b_weights (L, E, out, R)`` of ``a_weights``' ``L``, ``E`` and ``R``, ``base_output (T, K, out)``
    or ``None``, of ``x``'s dtype and device."""
    check_experts_lora_a_inputs(x, expert_ids, a_weights, batch_info)
    _check_tensor("b_weights", b_weights, 4)
    _check_same("b_weights", b_weights, "x", x.dtype, x.device)
    L, E, R, _ = a_weights.shape
    if b_weights.shape[:2] != (L, E) or b_weights.shape[3] != R:
        raise ValueError(f"b_weights must have shape ({L}, {E}, out, {R}) for a_weights {_describe(a_weights)}, "
                         f"got {_describe(b_weights)}")
    _check_experts_output(base_output, x, b_weights.shape[2])


def _check_experts_output(base_output: torch.Tensor | None, x: torch.Tensor, out_features: int) -> None:
    if base_output is not None:
        _check_tensor("base_output", base_output, 3)
        _check_same("base_output", base_output, "x", x.dtype, x.device)
        if base_output.shape != (*x.shape[:2], out_features):
            raise ValueError(f"base_output must have shape {(*x.shape[:2], out_features)}, got {_describe(base_output)}")


def check_dora_scale_inputs(output: torch.Tensor, factors: torch.Tensor, batch_info: BatchInfo,
                            bias: torch.Tensor | None) -> None:
    """``run_dora_scale``'s inputs, checked like every other op's (no device read): ``output
    (T, out)`` of a supported float dtype on the batch's device, ``factors (L, out)`` float32,
    ``bias (out,)`` a floating-point tensor on ``output``'s device, or ``None``."""
    _check_tensor("output", output, 2)
    check_float_dtype("output", output.dtype)
    _check_tensor("factors", factors, 2)
    if bias is not None:
        _check_tensor("bias", bias, 1)
    _check_batch_device(batch_info, output.device, "output")
    rows, out_features = output.shape
    if rows != batch_info.num_tokens:
        raise ValueError(f"output has {rows} rows but the batch info was built for {batch_info.num_tokens} tokens")
    num_slots = batch_info.num_slots
    if factors.shape != (num_slots, out_features) or factors.dtype != torch.float32:
        raise ValueError(f"factors must be float32 of shape ({num_slots}, {out_features}) (slots, out), got "
                         f"{_describe(factors)}")
    if factors.device != output.device:
        raise ValueError(f"factors is on {factors.device} but output is on {output.device}")
    if bias is not None:
        if not bias.is_floating_point():  # any float dtype: the rescale computes in float32
            raise ValueError(f"bias must be a floating-point tensor, got {_describe(bias)}")
        if bias.device != output.device:
            raise ValueError(f"bias is on {bias.device} but output is on {output.device}")
        if bias.shape != (out_features,):
            raise ValueError(f"bias must have shape ({out_features},), got {_describe(bias)}")

