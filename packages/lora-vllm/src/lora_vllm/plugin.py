"""The vLLM plugin: one environment variable turns lora-kit on for vLLM's LoRA layers.

vLLM runs every ``vllm.general_plugins`` entry point in each of its processes (API
server, engine core, workers) before it builds a model. :func:`register` is lora-kit's:
with ``LORA_KIT_VLLM_BACKEND`` unset or empty it does nothing, so installing the package
changes nothing; set to a lora-kit backend name (``torch_native``, ``ascend``) it makes the
current platform's ``get_punica_wrapper()`` name :class:`lora_vllm.punica.LoRAKitPunicaWrapper`,
the class through which vLLM runs all LoRA math. vLLM's own options keep their meaning.
"""

from __future__ import annotations

import os

__all__ = ["ENV_VAR", "WRAPPER_QUALNAME", "backend_name", "register"]

ENV_VAR = "LORA_KIT_VLLM_BACKEND"
WRAPPER_QUALNAME = "lora_vllm.punica.LoRAKitPunicaWrapper"


def backend_name() -> str | None:
    """The lora-kit backend ``LORA_KIT_VLLM_BACKEND`` names, or ``None`` when it is unset or empty.

    Raises ``ValueError`` naming the variable and the installed backends for any other name."""
    from lora_core import available_backends

    name = os.environ.get(ENV_VAR, "").strip()
    if not name:
        return None
    installed = available_backends()
    if name not in installed:
        raise ValueError(f"{ENV_VAR}={name!r} is not an installed lora-kit backend; "
                         f"expected one of {', '.join(installed) or '(none installed)'}, or unset to use vLLM's own")
    return name


def register() -> None:
    """vLLM's plugin hook (entry point ``vllm.general_plugins: lora_kit``); safe to call again."""
    name = backend_name()
    if name is None:
        return
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if getattr(platform, "_lora_kit_wrapped", False):
        return
    platform.get_punica_wrapper = classmethod(lambda cls: WRAPPER_QUALNAME)
    platform._lora_kit_wrapped = True  # the wrapper logs the backend once, where it is built
