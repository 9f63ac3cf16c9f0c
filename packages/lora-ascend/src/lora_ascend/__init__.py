"""lora-ascend: vectorized multi-LoRA ops tuned for Ascend NPUs.

Importing this package never requires torch_npu. The ``ascend`` backend is not
implemented yet (see the lora-ascend issue); until then this package only
reserves its name and dependency set.
"""

__version__ = "0.1.0"
