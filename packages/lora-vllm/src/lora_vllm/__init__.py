"""lora-kit's vLLM plugin: vLLM's LoRA layers on lora-kit kernels (docs/vllm.md).

``pip install`` it beside vLLM and set ``LORA_KIT_VLLM_BACKEND=torch_native`` (or ``ascend``):
vLLM then runs its LoRA math through :class:`lora_vllm.punica.LoRAKitPunicaWrapper`. Unset,
vLLM is untouched. Importing this package never imports vLLM; ``lora_vllm.punica`` does.
"""

from .mapping import StepMapping, lora_slots, run_lengths
from .plugin import ENV_VAR, WRAPPER_QUALNAME, backend_name, register

__all__ = ["ENV_VAR", "WRAPPER_QUALNAME", "StepMapping", "backend_name", "lora_slots", "register", "run_lengths"]
