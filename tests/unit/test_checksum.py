"""crc32c: the standard Castagnoli CRC, identical across implementations, on any host buffer."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_mlp import _C
from megatron_mlp.optim.checksum import crc32c, crc32c_combine, crc32c_impl

IMPLS = ["software", "sse42", "vpclmul", "auto"]


@pytest.fixture(params=IMPLS)
def impl(request):
    if request.param in ("sse42", "vpclmul") and not _C.crc32c_isa_supported(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} crc32c")
    return request.param


@pytest.mark.parametrize("data, expected", [
    (b"123456789", 0xE3069283),
    (b"", 0x00000000),
    (b"a", 0xC1D04330),
    (bytes(32), 0x8A9136AA),                 # RFC 3720 B.4
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
])
def test_crc32c_matches_published_vectors_when_given_known_inputs(impl, data, expected):
    assert crc32c(data, impl=impl) == expected


@pytest.mark.parametrize("n", [1, 7, 8, 255, 256 * 3, 256 * 3 + 5, 8192 * 3, 8192 * 3 * 2 + 256 * 3 + 13])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_hardware_and_software_agree_when_lengths_cross_interleave_blocks(n, offset):
    if not _C.crc32c_isa_supported("sse42"):
        pytest.skip("this CPU has no SSE4.2 crc32 instruction")
    data = np.random.default_rng(n).integers(0, 256, n + offset, dtype=np.uint8)[offset:]
    assert crc32c(data, impl="sse42") == crc32c(data, impl="software")


@pytest.mark.parametrize("n", [*range(240, 560, 7), 256, 272, 512, 4096, 4096 + 15, 100_000, 1 << 20])
@pytest.mark.parametrize("offset", [0, 3, 64])
@pytest.mark.parametrize("seed", [0, 0xDEADBEEF])
def test_folding_and_software_agree_for_any_length_alignment_and_seed(n, offset, seed):
    # Below 256 bytes the folding path hands over to the crc32 instruction; above it folds 256,
    # then 16 bytes at a time and finishes the last 0-15 bytes with the instruction.
    if not _C.crc32c_isa_supported("vpclmul"):
        pytest.skip("this CPU has no AVX-512 VPCLMULQDQ")
    data = np.random.default_rng(n).integers(0, 256, n + offset, dtype=np.uint8)[offset:]
    assert crc32c(data, seed=seed, impl="vpclmul") == crc32c(data, seed=seed, impl="software")


def test_folding_detects_a_flipped_bit_anywhere_in_a_long_buffer():
    if not _C.crc32c_isa_supported("vpclmul"):
        pytest.skip("this CPU has no AVX-512 VPCLMULQDQ")
    data = np.random.default_rng(7).integers(0, 256, 1 << 16, dtype=np.uint8)
    good = crc32c(data, impl="vpclmul")
    for byte in (0, 1, 255, 256, 4099, (1 << 16) - 17, (1 << 16) - 1):
        flipped = data.copy()
        flipped[byte] ^= 0x10
        assert crc32c(flipped, impl="vpclmul") == crc32c(flipped, impl="software") != good


def test_seed_chains_checksums_when_buffer_is_split(impl):
    data = np.random.default_rng(1).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    whole = crc32c(data, impl=impl)
    for cut in (0, 1, 4096, 99_999):
        assert crc32c(data[cut:], seed=crc32c(data[:cut], impl=impl), impl=impl) == whole


def test_tensor_and_bytes_of_same_memory_give_same_checksum_when_dtype_differs():
    t = torch.randn(12_345)
    expected = crc32c(t.numpy().tobytes())
    assert crc32c(t) == expected
    assert crc32c(t.view(torch.bfloat16)) == expected
    assert crc32c(t.numpy()) == expected
    assert crc32c(memoryview(t.numpy())) == expected


def test_single_bit_flip_changes_checksum_when_data_is_corrupted():
    data = bytearray(np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    before = crc32c(data)
    data[123_457] ^= 0x10
    assert crc32c(data) != before


def test_bad_buffers_are_rejected_with_reason_when_not_contiguous_or_not_buffers():
    with pytest.raises(ValueError, match=r"tensor must be contiguous"):
        crc32c(torch.zeros(16)[::2])
    with pytest.raises(ValueError, match=r"buffer must be contiguous"):
        crc32c(np.zeros(16)[::2])
    with pytest.raises(TypeError, match=r"got list"):
        crc32c([1, 2, 3])
    with pytest.raises(ValueError, match=r"seed must be an unsigned 32-bit value, got -1"):
        crc32c(b"x", seed=-1)
    with pytest.raises(ValueError, match=r"must be 'auto', 'vpclmul', 'sse42' or 'software', got 'fast'"):
        crc32c(b"x", impl="fast")


def test_impl_report_names_the_path_when_queried():
    assert crc32c_impl() in ("vpclmul", "sse42", "software")
    assert crc32c_impl() == "vpclmul" if _C.crc32c_isa_supported("vpclmul") else crc32c_impl() != "vpclmul"


@pytest.mark.parametrize("cut", [0, 1, 7, 4096, 99_999, 100_000])
def test_combine_gives_checksum_of_concatenation_when_pieces_are_checksummed_separately(cut):
    data = np.random.default_rng(3).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    a, b = data[:cut], data[cut:]
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(data)


def test_combine_of_many_pieces_equals_whole_when_folded_left_to_right():
    data = np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    pieces = [data[i:i + 65_537] for i in range(0, len(data), 65_537)]
    acc = crc32c(pieces[0])
    for piece in pieces[1:]:
        acc = crc32c_combine(acc, crc32c(piece), len(piece))
    assert acc == crc32c(data)


def test_combine_rejects_out_of_range_values_with_argument_name_when_invalid():
    with pytest.raises(ValueError, match=r"crc_b must be an unsigned 32-bit value, got 4294967296"):
        crc32c_combine(0, 1 << 32, 1)
    with pytest.raises(ValueError, match=r"len_b must be >= 0, got -1"):
        crc32c_combine(0, 0, -1)


@pytest.mark.parametrize("numel, padded", [(1000, 1024), (1024, 1024), (1, 1024), (0, 1024)])
def test_region_crc_from_array_crcs_equals_the_crc_of_the_whole_region_padding_included(numel, padded):
    from megatron_mlp.optim.checksum import region_crc32c
    region = torch.from_numpy(np.random.default_rng(numel).integers(0, 256, 3 * padded * 4, dtype=np.uint8))
    arrays = [region[i * padded * 4:i * padded * 4 + numel * 4] for i in range(3)]
    crcs = [crc32c(a) for a in arrays]
    assert region_crc32c(region, numel * 4, padded * 4, crcs) == crc32c(region)


def test_region_crc_rejects_arrays_that_do_not_tile_the_region():
    from megatron_mlp.optim.checksum import region_crc32c
    with pytest.raises(ValueError, match="do not tile a region of 100 bytes"):
        region_crc32c(torch.zeros(100, dtype=torch.uint8), 32, 32, [0, 0, 0])
    with pytest.raises(ValueError, match="do not tile"):
        region_crc32c(torch.zeros(96, dtype=torch.uint8), 40, 32, [0, 0, 0])
