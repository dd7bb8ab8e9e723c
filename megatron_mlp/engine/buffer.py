"""Engine-allocated host buffers: 4096-aligned, mlock'ed when permitted, zero-copy numpy/torch views."""
from __future__ import annotations

import logging

import numpy as np

from megatron_mlp.errors import EngineUnavailable

logger = logging.getLogger("megatron_mlp.engine")


class HostBuffer:
    """Page-aligned host memory owned by the C++ core.

    Views from :meth:`numpy` and :meth:`torch` share the memory and keep it alive on their own,
    so the HostBuffer object itself may be dropped while views are in use.
    """

    __slots__ = ("_raw", "_pinned")

    def __init__(self, raw):
        self._raw = raw
        self._pinned = False

    @property
    def nbytes(self) -> int:
        return self._raw.nbytes

    @property
    def address(self) -> int:
        return self._raw.address

    @property
    def locked(self) -> bool:
        """Whether mlock succeeded (the memory cannot be swapped out)."""
        return self._raw.locked

    @property
    def pinned(self) -> bool:
        """Whether the buffer is registered with CUDA as pinned memory (see :meth:`pin`)."""
        return self._pinned

    def memoryview(self) -> memoryview:
        return memoryview(self._raw)

    def _count(self, itemsize: int) -> int:
        if self.nbytes % itemsize:
            raise ValueError(f"HostBuffer of {self.nbytes} bytes is not a whole number of "
                             f"{itemsize}-byte elements")
        return self.nbytes // itemsize

    def numpy(self, dtype=np.uint8) -> np.ndarray:
        """A 1-D numpy array over the whole buffer (no copy)."""
        dtype = np.dtype(dtype)
        return np.frombuffer(self._raw, dtype=dtype, count=self._count(dtype.itemsize))

    def torch(self, dtype=None):
        """A 1-D CPU torch tensor over the whole buffer (no copy)."""
        import torch

        dtype = torch.uint8 if dtype is None else dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer(self._raw, dtype=dtype, count=self._count(itemsize))

    def pin(self) -> bool:
        """Register the buffer with CUDA (cudaHostRegister) so H2D/D2H copies run at full speed.

        Returns False (and changes nothing) when CUDA is not available. The registration is
        undone when the memory is freed, i.e. after the last view is gone.

        Raises:
            EngineUnavailable: CUDA is present but refused the registration.
        """
        if self._pinned:
            return True
        try:
            import torch
        except ImportError:
            return False
        if not torch.cuda.is_available():
            return False
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(self.address, self._raw.mapped_bytes, 0)
        if int(getattr(rc, "value", rc)) != 0:
            raise EngineUnavailable(
                f"cudaHostRegister of a {self.nbytes}-byte host buffer failed with CUDA error {rc}")
        address = self.address
        self._raw._set_release_hook(lambda: cudart.cudaHostUnregister(address))
        self._pinned = True
        return True

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return (f"HostBuffer(nbytes={self.nbytes}, address=0x{self.address:x}, locked={self.locked}, "
                f"pinned={self.pinned})")
