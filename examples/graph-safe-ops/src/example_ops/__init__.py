"""Two segmented-sum ops: one graph-safe, one that reads the batch on the host."""

from .ops import segment_sums, segment_sums_host

__all__ = ["segment_sums", "segment_sums_host"]
