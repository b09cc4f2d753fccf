"""Host-to-device copies that never wait for the device.

A copy from pageable host memory to CUDA synchronises the stream: the host waits for every
kernel queued before it, and cannot run ahead of the GPU (a `torch.tensor(values,
device="cuda")` is one such copy). These stage host values in pinned memory and copy them
without waiting; on the CPU they are the host tensor itself.
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
