"""vLLM's punica wrapper on lora-kit kernels: the class vLLM's LoRA layers call.

vLLM builds one wrapper per model (``get_punica_wrapper``, by the qualified name that
:func:`lora_vllm.plugin.register` gives the platform) and calls :meth:`update_metadata`
when a step's mapping or slot layout changes; every LoRA layer then calls the ``add_*``
methods. This wrapper turns the mapping into two lora-kit batches once per step (the
tokens, and the sampled rows the LM head and classifier heads see) and runs each layer's
shrink and expand as lora-kit ops on vLLM's own stacked buffers, viewed, never copied:

* ``lora_a_stacked[i] (L, 1, R, in)`` viewed as ``(L, R, in)``, ``lora_b_stacked[i]
  (L, 1, out_i, R)`` as ``(L, out_i, R)``: the lora-kit layout of one slice
  (docs/layout.md), with scaling 1 (vLLM folds each adapter's scaling into ``B``);
* each slot at its live rank in that buffer pair (:mod:`lora_vllm.slot_ranks`), and the
  buffers read by the ops up to the largest live rank of the step's slots: vLLM zero-pads
  every adapter to ``R`` and zero-fills the modules an adapter does not target, and the ops
  neither read nor multiply that padding (a pair with no live rank in the step runs no op;
  finding the live ranks reads a buffer once after each write to it). The experts' buffers
  and a classifier head's full matrices are read whole;
* tokens of slot ``-1`` get no delta. (vLLM's CPU ops index the weights with ``-1``, which
  is the last slot: a base-model request batched beside an adapter in the last slot gets
  that adapter's delta there. Here it gets none.)

The vLLM tensors other layers read (``_embeddings_indices`` for the embedding's ``lora_a``
gather, ``sampler_indices`` and the rest) are filled as vLLM's ``convert_mapping`` fills
them, computed with NumPy instead of its loop over tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from lora_core import LoRABackend, get_backend
from vllm.config import CompilationMode, CUDAGraphMode, get_current_vllm_config_or_none
from vllm.logger import logger
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase

from .batches import RankedBatches, StepBatch
from .mapping import StepMapping
from .plugin import ENV_VAR, backend_name
from .slot_ranks import SlotRanks, stacked_view

__all__ = ["LoRAKitPunicaWrapper", "check_eager_engine"]


def _buffers(stacked: tuple[torch.Tensor, ...] | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """vLLM's per-slice stacked buffers ``(L, 1, rows, cols)`` as a tuple (one tensor: one slice), as given:
    the persistent tensors whose live ranks :class:`~lora_vllm.slot_ranks.SlotRanks` keeps."""
    return (stacked,) if isinstance(stacked, torch.Tensor) else tuple(stacked)


def check_eager_engine() -> None:
    """Refuse an engine that compiles its model or captures graphs: this wrapper builds eager
    lora-kit batches every step (vLLM's CPU build never compiles a model with LoRA)."""
    config = get_current_vllm_config_or_none()
    if config is None:
        return
    compilation = config.compilation_config
    if compilation.mode != CompilationMode.NONE or compilation.cudagraph_mode != CUDAGraphMode.NONE:
        raise ValueError(
            f"{ENV_VAR}: lora-kit's vLLM wrapper runs eager batches, but this engine compiles its model "
            f"(compilation mode {compilation.mode.name}, CUDA graphs {compilation.cudagraph_mode.name}); "
            f"start vLLM with --enforce-eager (LLM(enforce_eager=True)), or unset {ENV_VAR}")


def _check_slice_counts(num_a: int, num_b: int, output_slices: tuple[int, ...]) -> None:
    if not num_a == num_b == len(output_slices):
        raise ValueError(f"{num_a} lora_a slices (or shrunk inputs), {num_b} lora_b slices and "
                         f"{len(output_slices)} output_slices: they must be as many")


def _rows(batches: RankedBatches, t: torch.Tensor, name: str) -> int:
    """The step's row count; ``t`` may hold more rows (padding), never fewer."""
    n = batches.num_rows
    if t.shape[0] < n:
        raise ValueError(f"{name} has {t.shape[0]} rows but the step maps {n}")
    return n


def _check_experts_call(expert_map: torch.Tensor | None, fully_sharded: bool,
                        token_lora_mapping: torch.Tensor | None) -> None:
    """The experts' LoRA here covers every expert on one process, with whole (not sharded) buffers."""
    unsupported = [name for name, used in (("expert_map (expert parallelism)", expert_map is not None),
                                            ("fully_sharded_loras", fully_sharded),
                                            ("token_lora_mapping (expert-parallel dispatch)",
                                             token_lora_mapping is not None)) if used]
    if unsupported:
        raise NotImplementedError(f"lora-kit's vLLM wrapper runs experts' LoRA without {', '.join(unsupported)}; "
                                  f"unset {ENV_VAR} to use vLLM's own wrapper for this engine")


def _expand_into(backend: LoRABackend, y: torch.Tensor, x: torch.Tensor, b: torch.Tensor,
                 add_inputs: bool) -> None:
    """``y (T, out) (+)= x (T, R) @ b[slot_t] (L, out, R)``; ``y`` may be a strided view."""
    x = x.to(b.dtype)
    offsets = (0, b.shape[1])
    if add_inputs and y.dtype == b.dtype:
        backend.run_lora_b(x, b, offsets, base_output=y)
        return
    delta = backend.run_lora_b(x, b, offsets)
    if add_inputs:
        y.add_(delta)
    else:
        y.copy_(delta)


class LoRAKitPunicaWrapper(PunicaWrapperBase):
    """A ``PunicaWrapperBase`` whose LoRA math runs on a lora-kit backend.

    The backend is named by the ``LORA_KIT_VLLM_BACKEND`` environment variable
    (:func:`lora_vllm.plugin.backend_name`; ``torch_native`` or ``ascend``). Arguments are
    vLLM's (``get_punica_wrapper(max_num_batched_tokens, max_batches, device, lora_config=...)``).
    """

    def __init__(self, max_num_batched_tokens: int, max_batches: int, device: torch.device | str,
                 **kwargs: Any) -> None:
        check_eager_engine()
        super().__init__(max_num_batched_tokens, max_batches, device)
        self.backend_name = backend_name()
        backend_cls = get_backend(self.backend_name)
        self._device = torch.device(device)
        self._tokens = RankedBatches(lambda: backend_cls(self._device), self._device)
        self._sampled = RankedBatches(lambda: backend_cls(self._device), self._device)
        self._slot_ranks = SlotRanks()
        logger.info_once("lora-kit: vLLM's LoRA layers run on lora-kit backend %r (%s)", self.backend_name,
                         backend_cls.__qualname__)

    # ----------------------------------------------------------------- metadata
    def update_metadata(self, mapping: Any, lora_index_to_id: list[int | None], max_loras: int, vocab_size: int,
                        **kwargs: Any) -> None:
        """Fill vLLM's index tensors and build this step's lora-kit batches (tokens, sampled rows)."""
        step = StepMapping.from_vllm(mapping.index_mapping, mapping.prompt_mapping, lora_index_to_id, max_loras,
                                     vocab_size)
        num_tokens, num_sampled = step.token_slots.size, step.row_slots.size
        for buffer, values in ((self._token_lora_indices, step.token_slots),
                               (self._sampler_indices, step.row_slots),
                               (self._sampler_indices_padded, step.row_offsets_padded),
                               (self._embeddings_indices, step.embedding_offsets)):
            buffer[: values.size].copy_(torch.from_numpy(values), non_blocking=True)
        self.indices_len[:] = [num_tokens, num_sampled, num_sampled, num_tokens]
        self.is_prefill = bool(mapping.is_prefill)
        self.no_lora = not bool((step.token_slots >= 0).any())

        self._tokens.reset(step.token_slots, len(lora_index_to_id))
        self._sampled.reset(step.row_slots, len(lora_index_to_id))

    def _token_batch(self, a: torch.Tensor | None, b: torch.Tensor | None) -> StepBatch | None:
        """The step's token batch for vLLM's buffer pair ``a (L, 1, R, in)``, ``b (L, 1, out, R)`` (either
        may be ``None``), at its slots' live ranks; ``None`` when it has nothing to add."""
        return self._tokens.for_ranks(self._slot_ranks.of(a, b))

    # ---------------------------------------------------------------- LoRA math
    def add_shrink(self, y: tuple[torch.Tensor, ...] | torch.Tensor, x: torch.Tensor,
                   lora_a_stacked: tuple[torch.Tensor, ...], scale: float, **kwargs: Any) -> Any:
        """``y[i] += scale * x @ lora_a[slot_t, i].T`` for every slice ``i`` (``y[i] (T, R)``)."""
        x = x.view(-1, x.shape[-1])
        if not self._tokens.any_adapter:
            return y
        n = _rows(self._tokens, x, "x")
        a_buffers = _buffers(lora_a_stacked)
        x = x[:n].to(a_buffers[0].dtype)
        for i, a in enumerate(a_buffers):
            batch = self._token_batch(a, None)
            if batch is None:
                continue
            shrunk = batch.backend.run_lora_a(x, stacked_view(a)[:, : batch.rank])
            out = y[i].view(-1, y[i].shape[-1])[:n, : batch.rank]  # the columns beyond are zero products
            out.add_(shrunk if scale == 1.0 else shrunk * scale)
        return y

    def add_expand(self, y: torch.Tensor, x: tuple[torch.Tensor, ...] | torch.Tensor,
                   lora_b_stacked: tuple[torch.Tensor, ...], output_slices: tuple[int, ...], offset_start: int = 0,
                   add_inputs: bool = True, **kwargs: Any) -> Any:
        """``y[:, o_i : o_i + out_i] += x[i] @ lora_b[slot_t, i].T``, ``o_0 = offset_start``."""
        y2 = y.view(-1, y.shape[-1])
        b_buffers = _buffers(lora_b_stacked)
        _check_slice_counts(len(x), len(b_buffers), output_slices)
        if not self._tokens.any_adapter:
            if not add_inputs:
                y2[:, offset_start: offset_start + sum(output_slices)].zero_()
            return y
        n = _rows(self._tokens, y2, "y")
        offset = offset_start
        for i, (b, size) in enumerate(zip(b_buffers, output_slices)):
            self._expand_pair(self._token_batch(None, b), y2[:n, offset: offset + size], x[i][:n], stacked_view(b),
                              add_inputs)
            offset += size
        return y

    @staticmethod
    def _expand_pair(batch: StepBatch | None, y: torch.Tensor, x: torch.Tensor, b: torch.Tensor,
                     add_inputs: bool) -> None:
        """``y (T, out) (+)= x (T, R) @ b[slot_t].T`` (``b (L, out, R)``) at ``batch``'s ranks, reading
        ``x[:, :r]`` and ``b[:, :, :r]``; with no batch the delta is zero."""
        if batch is None:
            if not add_inputs:
                y.zero_()
            return
        _expand_into(batch.backend, y, x[:, : batch.rank], b[:, :, : batch.rank], add_inputs)

    def add_lora_embedding(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor,
                           add_inputs: bool = True, **kwargs: Any) -> Any:
        """The embedding's expand: ``y += x @ lora_b[slot_t].T`` (its shrink is vLLM's gather)."""
        if not self._tokens.any_adapter:
            if not add_inputs:
                y.zero_()
            return y
        (b,) = _buffers(lora_b_stacked)
        n = _rows(self._tokens, y, "y")
        self._expand_pair(self._token_batch(None, b), y[:n], x[:n], stacked_view(b), add_inputs)
        return y

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                        lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...], *,
                        buffer: tuple[torch.Tensor, ...] | None = None, **kwargs: Any) -> Any:
        """``y[:, o_i : o_i + out_i] += scale * x @ lora_a[slot_t, i].T @ lora_b[slot_t, i].T`` per slice."""
        add_inputs = kwargs.get("add_inputs", True)
        a_buffers, b_buffers = _buffers(lora_a_stacked), _buffers(lora_b_stacked)
        _check_slice_counts(len(a_buffers), len(b_buffers), output_slices)
        if not self._tokens.any_adapter:
            if not add_inputs:
                y[:, : sum(output_slices)].zero_()
            return y
        n = _rows(self._tokens, x, "x")
        x = x[:n].to(a_buffers[0].dtype)  # the LoRA math runs in vLLM's lora_dtype (by default the model's)
        offset = 0
        for a, b, size in zip(a_buffers, b_buffers, output_slices):
            batch = self._token_batch(a, b)
            shrunk = None if batch is None else batch.backend.run_lora_a(x, stacked_view(a)[:, : batch.rank])
            if shrunk is not None and scale != 1.0:
                shrunk = shrunk * scale
            self._expand_pair(batch, y[:n, offset: offset + size], shrunk, stacked_view(b), add_inputs)
            offset += size
        return y

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                        lora_b_stacked: torch.Tensor, scale: float, *, buffer: torch.Tensor | None = None,
                        **kwargs: Any) -> Any:
        """LM head over the sampled rows: ``y[:, :V] += scale * x @ lora_a[slot_r].T @ lora_b[slot_r].T``."""
        if not self._sampled.any_adapter:
            return y
        (a_buffer,), (b_buffer,) = _buffers(lora_a_stacked), _buffers(lora_b_stacked)
        y2, x2 = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
        n = x2.shape[0]
        batch = self._sampled.for_ranks(self._slot_ranks.of(a_buffer, b_buffer), num_rows=n)
        if batch is None:
            return y
        a, b = stacked_view(a_buffer), stacked_view(b_buffer)
        shrunk = batch.backend.run_lora_a(x2.to(a.dtype), a[:, : batch.rank])
        if scale != 1.0:
            shrunk = shrunk * scale
        width = min(b.shape[1], y2.shape[1])  # the model's logits may be padded past the adapter's vocabulary
        self._expand_pair(batch, y2[:n, :width], shrunk, b[:, :width], True)
        return y

    def apply_lora_full_linear(self, y: torch.Tensor, x: torch.Tensor, weight_stacked: torch.Tensor,
                               bias_stacked: torch.Tensor, module_enabled: torch.Tensor) -> Any:
        """A classifier head's full per-adapter weights on the sampled rows:
        ``y[r] = x[r] @ weight[slot_r].T + bias[slot_r]`` where ``slot_r >= 0`` has one, else ``y[r]``."""
        w = stacked_view(weight_stacked)
        n = _rows(self._sampled, x, "x")
        whole = self._sampled.for_ranks((w.shape[1],) * w.shape[0])  # whole matrices, not low-rank: every row
        if whole is None:
            return y
        adapter_y = whole.backend.run_lora_a(x[:n].to(w.dtype), w)
        y[:n].copy_(self._select_full_linear_output(y[:n], adapter_y, bias_stacked, module_enabled))
        return y

    # ------------------------------------------------------------ MoE experts
    def _experts_batch(self, a: torch.Tensor) -> StepBatch:
        """The step's token batch for experts' buffers ``a (L, E, R, H)``: every slot the step uses at
        rank ``R`` (their live ranks are not read). Called only when the step has an adapter row."""
        return self._tokens.for_ranks((a.shape[2],) * a.shape[0])

    def add_lora_w13(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                     lora_b_stacked: tuple[torch.Tensor, ...], topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     expert_map: torch.Tensor | None, w1: torch.Tensor, w2: torch.Tensor, num_tokens: int,
                     top_k_num: int, max_loras: int, adapter_enabled: torch.Tensor, local_num_experts: int,
                     top_k: int, num_slices: int, fully_sharded: bool, use_tuned_config: bool,
                     add_inputs: bool = True, token_lora_mapping: torch.Tensor | None = None,
                     ) -> tuple[None, torch.Tensor, None, None]:
        """The experts' gate/up LoRA, before the activation: for token ``t``'s ``k``-th choice
        ``e = topk_ids[t, k]`` and slice ``i`` (``lora_a[i] (L, E, R, H)``, ``lora_b[i] (L, E, I_i, R)``)::

            y[t, k, o_i : o_i + I_i] (+)= lora_b[i][slot_t, e] @ lora_a[i][slot_t, e] @ x[t]

        with ``y (T, K, sum I_i)`` and ``x (T, H)``. Returns what vLLM passes on to
        :meth:`add_lora_w2`: ``(None, expert_ids, None, None)``, the expert of each ``(t, k)``
        flattened (vLLM's "naive block assignment" form)."""
        _check_experts_call(expert_map, fully_sharded, token_lora_mapping)
        y3 = y.view(num_tokens, top_k_num, -1)
        ids = topk_ids.view(num_tokens, top_k_num)
        if not add_inputs:
            y3.zero_()
        if self._tokens.any_adapter:
            n = _rows(self._tokens, x, "x")
            offset = 0
            for a, b in zip(lora_a_stacked, lora_b_stacked):
                xk = x[:n].to(a.dtype).unsqueeze(1).expand(n, top_k_num, x.shape[-1])  # a view per choice
                delta = self._experts_batch(a).backend.run_experts_lora(xk, ids[:n], a, b)
                y3[:n, :, offset: offset + b.shape[2]] += delta
                offset += b.shape[2]
        return None, ids.reshape(-1), None, None

    def add_lora_w2(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                    lora_b_stacked: tuple[torch.Tensor, ...], topk_weights: torch.Tensor,
                    sorted_token_ids_lora: torch.Tensor | None, expert_ids_lora: torch.Tensor | None,
                    num_tokens_post_padded_lora: torch.Tensor | None, token_lora_mapping: torch.Tensor | None,
                    num_tokens: int, w1: torch.Tensor, w2: torch.Tensor, top_k_num: int, max_loras: int,
                    adapter_enabled: torch.Tensor, top_k: int, fully_sharded: bool, tp_rank: int,
                    use_tuned_config: bool, add_inputs: bool = True) -> None:
        """The experts' down LoRA, before the sum over the choices, weighted by the router::

            y[t, k] (+)= topk_weights[t, k] * lora_b[slot_t, e] @ lora_a[slot_t, e] @ x[t * K + k]

        with ``e = expert_ids_lora[t * K + k]`` (from :meth:`add_lora_w13`), ``y (T, K, H)``,
        ``x (T * K, I)``, ``lora_a[0] (L, E, R, I)``, ``lora_b[0] (L, E, H, R)``."""
        _check_experts_call(None, fully_sharded, token_lora_mapping)
        y3 = y.view(num_tokens, top_k_num, -1)
        if not add_inputs:
            y3.zero_()
        if not self._tokens.any_adapter:
            return
        (a,), (b,) = lora_a_stacked, lora_b_stacked
        n = _rows(self._tokens, y3, "y")
        xk = x.view(num_tokens, top_k_num, -1)[:n].to(a.dtype)
        ids = expert_ids_lora.view(num_tokens, top_k_num)[:n]
        delta = self._experts_batch(a).backend.run_experts_lora(xk, ids, a, b)
        y3[:n] += delta * topk_weights.view(num_tokens, top_k_num, 1)[:n].to(delta.dtype)

