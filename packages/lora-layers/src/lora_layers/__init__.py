"""lora-layers: module wrappers, tensor parallelism and the MultiLoRA API.

Not implemented yet (see the lora-layers issue); this package only reserves its
name and dependency set.
"""

__version__ = "0.1.0"
