"""lora_cuda's LoRA ops as ``torch.library`` custom ops: what ``torch.compile`` traces.

Under ``torch.compile`` (``torch.compiler.is_compiling()``) the public ops of
:mod:`lora_cuda.ops` and the graph-safe ops of :mod:`lora_cuda.graph_ops` each
trace as one call of an op below; both import this module, so the ops are
registered before anything can call them. The ops run the kernels of
:mod:`lora_cuda.graph_kernels` and import nothing that imports this module.
Each op is opaque to the compiler: its fake implementation gives the output's
shape and dtype (and declares that ``expand_`` updates ``base_output`` in
place), and its implementation, run when the compiled code runs, on real
tensors, is the eager code:

* the boundary checks of ``lora_core.validation`` against the batch as it is
  now (so a refilled batch is checked like an eager call);
* the graph-safe kernel, chosen on real tensors (``graph_kernel``: the grouped
  GEMM where it applies, with its own eager kernel, never a meta/fake rule);
* the plans' per-layer column tables and workspaces, created on first use in
  Python dicts that the compiled code never reads.

The batch reaches an op as an int and a list of tensors
(:func:`lora_cuda.graph_plans.batch_args`): a graph-mode batch as its
:func:`~lora_cuda.graph_plans.batch_key` (the same after every refill, so the
compiled code is reused as is), an eager batch as its host mirrors, from which
the op plans the batch when it runs (the graph-safe kernels, whatever the
batch: the control-flow ops' host loop would specialize the compiled code to
one batch's segments). docs/compile.md has the rules.

The ops are defined with ``torch.library.Library`` (their schemas below) and
one ``CompositeExplicitAutograd`` kernel each, not with ``torch.library.custom_op``:
that decorator wraps every call in Python (an autograd kernel, and for ``expand_``
an ``ADInplaceOrView`` kernel that rebuilds the arguments to bump version
counters), which made a compiled decode step slower than the eager one. These
ops have no backward (:func:`~lora_cuda.graph_plans.batch_args` refuses inputs
that require grad) and run under ``no_grad``/``inference_mode``, so neither
wrapper did anything they need. docs/compile.md has the figures.

Ops (namespace ``lora_cuda``): ``shrink``, ``expand_``, ``embedding_shrink`` and ``dora_scale_``, with the
schemas of ``_SCHEMAS`` (docs/compile.md lists them).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import torch

from lora_core import BatchInfo, build_batch_info
from lora_core.validation import (check_dora_scale_inputs, check_embedding_inputs, check_lora_a_inputs,
                                  check_lora_b_inputs, check_token_ids)

from .graph_kernels import check_graph_kernel, graph_dora_scale, graph_embedding_shrink, graph_expand, graph_shrink
from .graph_plans import batch_args, batch_of_key

__all__ = ["OPS", "compiled_embedding_shrink", "dora_scale_", "embedding_shrink", "expand_", "shrink"]

_LIB = torch.library.Library("lora_cuda", "DEF")
_SCHEMAS = {
    "shrink": "(Tensor x, Tensor weights, SymInt batch_key, Tensor[] batch_host, SymInt num_slices, str kernel)"
              " -> Tensor",
    "expand_": "(Tensor x, Tensor weights, SymInt batch_key, Tensor[] batch_host, SymInt[] slice_offsets,"
               " Tensor(a!) base_output, str kernel) -> ()",
    "embedding_shrink": "(Tensor ids, Tensor weights, SymInt batch_key, Tensor[] batch_host, SymInt vocab_size,"
                        " Tensor? extra_embeddings, bool strict_token_ids) -> Tensor",
    "dora_scale_": "(Tensor(a!) output, Tensor factors, Tensor? bias, SymInt batch_key, Tensor[] batch_host) -> ()",
}
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema)
OPS = tuple(f"lora_cuda::{name}" for name in _SCHEMAS)
"""The qualified names of the custom ops."""


def _register(name: str, fake: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """Register the decorated function as op ``name``'s kernel for every backend and ``fake`` as
    its fake implementation; the decorated name becomes the op (``torch.ops.lora_cuda.<name>``)."""
    def register(kernel: Callable[..., Any]) -> Any:
        _LIB.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"lora_cuda::{name}", fake, lib=_LIB)
        return getattr(torch.ops.lora_cuda, name).default
    return register


_rebuilt = threading.local()  # the last eager batch planned from host mirrors, per thread


def _eager_batch(host: list[torch.Tensor], device: torch.device) -> BatchInfo:
    """An eager batch info with the slot of every token, the ranks and the scalings of ``host``
    (an eager batch's host mirrors ``token_slots``, ``lora_ranks``, ``scalings``), rebuilt once
    per batch: every layer of a step reuses it."""
    if len(host) != 3:
        raise ValueError(f"lora_cuda ops take a batch key or the 3 host tensors of an eager batch, got "
                         f"key 0 and {len(host)} tensors")
    token_slots, ranks, scalings = (t.numpy() for t in host)
    signature = (device, token_slots.tobytes(), ranks.tobytes(), scalings.tobytes())
    last = getattr(_rebuilt, "last", None)
    if last is not None and last[0] == signature:
        return last[1]
    starts = np.flatnonzero(np.diff(token_slots, prepend=np.int32(-2)))  # runs of one slot: the segments
    seg_lens = np.diff(np.append(starts, token_slots.size))
    info = build_batch_info(seg_lens.tolist(), token_slots[starts].tolist(), ranks.tolist(), scalings.tolist(),
                            device=device)
    _rebuilt.last = (signature, info)
    return info


def _batch(batch_key: int, batch_host: list[torch.Tensor], device: torch.device) -> BatchInfo:
    return batch_of_key(batch_key) if batch_key else _eager_batch(batch_host, device)


def _static(*tensors: torch.Tensor) -> bool:
    """Every size is a plain int (the fake implementations check only static shapes:
    comparing symbolic ones would add guards)."""
    return all(isinstance(s, int) for t in tensors for s in t.shape)


def _shrink_fake(x, weights, batch_key, batch_host, num_slices, kernel):
    if batch_key and _static(x, weights):  # shape errors at compile time, as an eager call raises them
        check_lora_a_inputs(x, weights, batch_of_key(batch_key), num_slices)
    return x.new_empty(x.shape[0], weights.shape[1])


@_register("shrink", _shrink_fake)
def shrink(x: torch.Tensor, weights: torch.Tensor, batch_key: int, batch_host: list[torch.Tensor],
           num_slices: int, kernel: str) -> torch.Tensor:
    """``lora_cuda.sgemm_lora_a_fwd`` (graph-safe kernels) for the batch ``batch_key`` / ``batch_host``."""
    info = _batch(batch_key, batch_host, x.device)
    check_lora_a_inputs(x, weights, info, num_slices)
    return graph_shrink(x, weights, info, num_slices, check_graph_kernel(kernel))


def _expand_fake(x, weights, batch_key, batch_host, slice_offsets, base_output, kernel):
    if batch_key and _static(x, weights, base_output) and all(isinstance(o, int) for o in slice_offsets):
        check_lora_b_inputs(x, weights, batch_of_key(batch_key), slice_offsets, base_output)


@_register("expand_", _expand_fake)
def expand_(x: torch.Tensor, weights: torch.Tensor, batch_key: int, batch_host: list[torch.Tensor],
            slice_offsets: list[int], base_output: torch.Tensor, kernel: str) -> None:
    """``lora_cuda.sgemm_lora_b_fwd`` (graph-safe kernels) accumulating into ``base_output`` in place."""
    info = _batch(batch_key, batch_host, x.device)
    offsets = check_lora_b_inputs(x, weights, info, slice_offsets, base_output)
    graph_expand(x, weights, info, offsets, base_output, check_graph_kernel(kernel))


def _embedding_shrink_fake(ids, weights, batch_key, batch_host, vocab_size, extra_embeddings, strict_token_ids):
    extra = () if extra_embeddings is None else (extra_embeddings,)
    if batch_key and _static(ids, weights, *extra) and isinstance(vocab_size, int):
        check_embedding_inputs(ids, weights, batch_of_key(batch_key), vocab_size, extra_embeddings)
    return weights.new_empty(ids.shape[0], weights.shape[1])


@_register("embedding_shrink", _embedding_shrink_fake)
def embedding_shrink(ids: torch.Tensor, weights: torch.Tensor, batch_key: int, batch_host: list[torch.Tensor],
                     vocab_size: int, extra_embeddings: torch.Tensor | None, strict_token_ids: bool) -> torch.Tensor:
    """``lora_cuda.sgemm_lora_a_embedding_fwd`` (graph-safe kernel); ``strict_token_ids`` reads the
    ids back when the op runs (skipped while a CUDA/NPU graph is captured, as in eager calls)."""
    info = _batch(batch_key, batch_host, ids.device)
    num_valid = check_embedding_inputs(ids, weights, info, vocab_size, extra_embeddings)
    if strict_token_ids:
        check_token_ids(ids, num_valid)
    if weights.numel() == 0:
        return weights.new_zeros(ids.shape[0], weights.shape[1])
    return graph_embedding_shrink(ids, weights, info, num_valid)


def compiled_embedding_shrink(ids: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, vocab_size: int,
                              extra_embeddings: torch.Tensor | None, strict_token_ids: bool) -> torch.Tensor:
    """The embedding shrink as compiled code calls it: one ``lora_cuda::embedding_shrink``."""
    key, host = batch_args(batch_info, ids, weights, *([] if extra_embeddings is None else [extra_embeddings]))
    return torch.ops.lora_cuda.embedding_shrink(ids, weights, key, host, vocab_size, extra_embeddings,
                                                strict_token_ids)


def _dora_scale_fake(output, factors, bias, batch_key, batch_host):
    if batch_key and _static(output, factors):
        check_dora_scale_inputs(output, factors, batch_of_key(batch_key), bias)


@_register("dora_scale_", _dora_scale_fake)
def dora_scale_(output: torch.Tensor, factors: torch.Tensor, bias: torch.Tensor | None, batch_key: int,
                batch_host: list[torch.Tensor]) -> None:
    """``lora_cuda.dora_scale_fwd``: each row of ``output`` rescaled in place by its slot's DoRA factors."""
    info = _batch(batch_key, batch_host, output.device)
    check_dora_scale_inputs(output, factors, info, bias)
    graph_dora_scale(output, factors, info, bias)
