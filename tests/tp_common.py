"""What the tensor-parallel workers share (tp_worker.py, tp_fully_sharded_worker.py, tp_moe_worker.py): the
slots' ranks and scalings, random unsharded adapters and base layers, the rows of a column shard, and a
fused experts module."""

import torch
import torch.nn.functional as F
from torch import nn

from lora_layers.parallel import shard_range

RANKS, SCALINGS, R = [4, 2, 0], [0.5, 2.0, 1.0], 4
"""Per slot: slot 2 stays empty (rank 0)."""


def random_adapters(gen, in_features, widths):
    """Per slot: a list of (A, B) per slice of the unsharded layer, ranks from RANKS (None for rank 0)."""
    return [[(torch.randn(r, in_features, generator=gen), torch.randn(w, r, generator=gen)) for w in widths]
            if r else None for r in RANKS]


def load_adapters(wrapper, adapters):
    for slot, slices in enumerate(adapters):
        if slices is not None:
            wrapper.set_lora(slot, slices)


def random_linear(gen, in_features, out_features):
    """An unsharded ``nn.Linear`` with random weight and bias from ``gen``."""
    full = nn.Linear(in_features, out_features)
    with torch.no_grad():
        full.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        full.bias.copy_(torch.randn(out_features, generator=gen))
    return full


def column_shard_rows(widths, row_ranges):
    """The full layer's output rows a column-parallel shard holds: ``row_ranges[i]`` of each slice ``i``."""
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    return torch.cat([torch.arange(offsets[i] + s, offsets[i] + e) for i, (s, e) in enumerate(row_ranges)])


class Experts(nn.Module):
    """A transformers-style fused experts module: ``gate_up_proj (E, 2I, H)`` (gate rows, then up rows),
    ``down_proj (E, H, I)``, SiLU."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = nn.Parameter(gate_up), nn.Parameter(down), F.silu


def experts_shard(gate_up, down, rank, world):
    """This process's ``Experts`` of the intermediate dimension: its gate and up rows, its down columns."""
    intermediate = down.shape[2]
    start, stop = shard_range(intermediate, rank, world)
    return Experts(torch.cat([gate_up[:, start:stop], gate_up[:, intermediate + start : intermediate + stop]],
                             dim=1).clone(), down[:, :, start:stop].clone())
