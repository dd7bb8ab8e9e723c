"""CRC-32C of host buffers, used to verify every subgroup read back from a storage tier.

Castagnoli polynomial (as iSCSI, ext4, RocksDB): ``crc32c(b"123456789") == 0xE3069283``.
The C++ core folds with AVX-512 carry-less multiplies (VPCLMULQDQ) where the CPU has them (twice
the speed of the next option here), else uses the SSE4.2 ``crc32`` instruction over three
interleaved streams, else a slicing-by-8 table; all give the same value. The GIL is released
while it runs.
"""
from __future__ import annotations

import numpy as np

from megatron_mlp import _C

__all__ = ["crc32c", "crc32c_combine", "crc32c_impl", "region_crc32c"]


def crc32c_impl() -> str:
    """The implementation ``crc32c`` uses on this CPU for long buffers: "vpclmul", "sse42" or
    "software" (below 256 bytes "vpclmul" hands over to "sse42")."""
    for name in ("vpclmul", "sse42"):
        if _C.crc32c_isa_supported(name):
            return name
    return "software"


def _address_and_size(buffer) -> tuple[int, int, object]:
    """(address, nbytes, keep-alive object) of a contiguous host buffer."""
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "is_contiguous"):  # torch.Tensor
        if buffer.device.type != "cpu":
            raise ValueError(f"crc32c: tensor must be in host memory, got device {buffer.device}")
        if not buffer.is_contiguous():
            raise ValueError(f"crc32c: tensor must be contiguous (stride {tuple(buffer.stride())})")
        return buffer.data_ptr(), buffer.numel() * buffer.element_size(), buffer
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(f"crc32c: expected a torch.Tensor or an object with the buffer protocol "
                        f"(bytes, bytearray, memoryview, numpy array), got {type(buffer).__name__}") from None
    if not view.contiguous:
        raise ValueError("crc32c: buffer must be contiguous")
    if view.nbytes == 0:
        return 0, 0, view
    arr = np.frombuffer(view.cast("B"), dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes, arr


def crc32c(buffer, seed: int = 0, *, impl: str = "auto") -> int:
    """CRC-32C of a contiguous host buffer.

    Args:
        buffer: a CPU torch.Tensor or any object with the buffer protocol, contiguous.
        seed: the CRC of the bytes before this buffer (0 to start), so that
            ``crc32c(b, seed=crc32c(a)) == crc32c(a + b)``.
        impl: "auto", "vpclmul", "sse42" or "software" (tests compare them).

    Returns:
        The checksum as an unsigned 32-bit int.

    Raises:
        TypeError / ValueError: not a buffer, not contiguous, not in host memory, bad seed or impl.
    """
    if not 0 <= int(seed) <= 0xFFFFFFFF:
        raise ValueError(f"crc32c: seed must be an unsigned 32-bit value, got {seed}")
    addr, nbytes, keep = _address_and_size(buffer)
    result = _C.crc32c(addr, nbytes, int(seed), impl)
    del keep
    return result


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32C of the concatenation A + B from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)`` in bytes.

    Lets pieces of one subgroup be checksummed independently (by several threads, or as each I/O
    block completes) and combined in microseconds.

    Raises:
        ValueError: a CRC outside 32 bits or a negative length.
    """
    for name, value in (("crc_a", crc_a), ("crc_b", crc_b)):
        if not 0 <= int(value) <= 0xFFFFFFFF:
            raise ValueError(f"crc32c_combine: {name} must be an unsigned 32-bit value, got {value}")
    if int(len_b) < 0:
        raise ValueError(f"crc32c_combine: len_b must be >= 0, got {len_b}")
    return _C.crc32c_combine(int(crc_a), int(crc_b), int(len_b))


def crc32c_extend(crcs, parts, part_bytes) -> tuple[int, ...]:
    """Each running crc32c of ``crcs`` extended by that of its next part (``parts``, ``part_bytes``
    bytes each): several arrays checksummed piece by piece, one position per array."""
    return tuple(crc32c_combine(a, b, n) for a, b, n in zip(crcs, parts, part_bytes))


def region_crc32c(region, array_bytes, stride_bytes, array_crcs) -> int:
    """CRC-32C of a region ``[a0 | pad | a1 | pad | ...]`` from the CRCs of its arrays.

    ``region`` is a uint8 tensor; the arrays (``array_bytes`` each, one every ``stride_bytes``; or
    one value per array where they differ, as with bf16 moments beside an fp32 param) were
    checksummed already (the fused kernel does it while they are in cache), so only the alignment
    padding after each is read here: the result equals ``crc32c(region)``.

    Raises:
        ValueError: the arrays and their strides do not tile the region exactly.
    """
    n = len(array_crcs)
    sizes = tuple(array_bytes) if isinstance(array_bytes, (tuple, list)) else (array_bytes,) * n
    strides = tuple(stride_bytes) if isinstance(stride_bytes, (tuple, list)) else (stride_bytes,) * n
    if len(sizes) != n or len(strides) != n or sum(strides) != region.numel() \
            or any(a < 0 or a > st for a, st in zip(sizes, strides)):
        raise ValueError(f"region_crc32c: {n} arrays of {array_bytes} bytes, one every "
                         f"{stride_bytes}, do not tile a region of {region.numel()} bytes")
    crc = 0
    start = 0
    for array_crc, size, stride in zip(array_crcs, sizes, strides):
        crc = crc32c_combine(crc, int(array_crc), size)
        if stride > size:
            crc = crc32c(region[start + size:start + stride], seed=crc)
        start += stride
    return crc
