"""Host values onto the device without a stream synchronisation (a leaf: imports nothing of the
package)."""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the GPU.

    `torch.tensor(values, device=cuda)` is a blocking copy: it synchronises the stream, which
    idles the GPU until the host launches again. From pinned memory the copy is queued on the
    stream instead (torch's host allocator keeps the pinned block until the copy has run)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
