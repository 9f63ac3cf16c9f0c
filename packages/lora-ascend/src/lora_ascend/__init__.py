"""lora-ascend: fully vectorized multi-LoRA ops and the ``ascend`` backend.

Tuned for Ascend NPUs, where every host-side loop iteration costs a kernel
launch: every op here launches a fixed set of kernels whatever the number of
segments or adapter slots, in eager mode as well as under graph capture. Runs
on any torch device; importing it never requires torch_npu.
"""

from .backend import AscendBackend
from .embedding import vectorized_lora_a_embedding_fwd
from .ops import vectorized_lora_a_fwd, vectorized_lora_b_fwd, vectorized_pair_lora_a_fwd, vectorized_pair_lora_b_fwd

__version__ = "0.1.0"

__all__ = [
    "AscendBackend",
    "vectorized_lora_a_embedding_fwd",
    "vectorized_lora_a_fwd",
    "vectorized_lora_b_fwd",
    "vectorized_pair_lora_a_fwd",
    "vectorized_pair_lora_b_fwd",
]
