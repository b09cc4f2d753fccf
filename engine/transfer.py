"""Host-to-device copies that never wait for the device.

A copy from pageable host memory to CUDA synchronises the stream: the host waits for every
kernel queued before it, and cannot run ahead of the GPU (a `torch.tensor(values,
device="cuda")` is one such copy). These stage host values in pinned memory and copy them
without waiting; on the CPU they are the host tensor itself. `DeviceIndices` keeps such a copy
for indices that come back unchanged (a pass's GDN state slots, the same at every layer).
"""

from __future__ import annotations

import numpy as np
import torch


def staged(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor ready to copy to `device` without waiting for it: pinned on
    CUDA (a copy from pageable memory synchronises the stream)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    return host.pin_memory() if device.type == "cuda" else host


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` in one copy that does not wait for the device."""
    return staged(array, device).to(device, non_blocking=True)


def on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: a host tensor through `to_device`, a device one as it is."""
    if tensor.device == device:
        return tensor
    return to_device(tensor.numpy(), device) if tensor.device.type == "cpu" else tensor.to(device)


class DeviceIndices:
    """Index tensors on `device` for tuples of host ints, each copied once and reused while it
    comes back: a batched pass's GDN layers each gather and commit the same state slots, one
    copy (and on CUDA a pinned staging) a layer before. Keeps the last `keep` tuples."""

    def __init__(self, device: torch.device | str, keep: int = 64) -> None:
        self.device, self.keep = torch.device(device), keep
        self._made: dict[tuple[int, ...], torch.Tensor] = {}

    def of(self, values: tuple[int, ...]) -> torch.Tensor:
        index = self._made.get(values)
        if index is None:
            if len(self._made) >= self.keep:
                self._made.pop(next(iter(self._made)))  # the oldest
            index = self._made[values] = to_device(np.array(values, np.int64), self.device)
        return index
