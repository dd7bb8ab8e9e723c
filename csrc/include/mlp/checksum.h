// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI, ext4 and RocksDB:
// crc32c("123456789") == 0xE3069283. Verifies every subgroup read back from a storage tier.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlp {

enum class Crc32cImpl : int { kAuto = 0, kSse42 = 1, kSoftware = 2, kVpclmul = 3 };

// Whether this CPU has the SSE4.2 crc32 instruction.
bool crc32c_hw_supported();
// Whether this CPU can fold with AVX-512 VPCLMULQDQ (used for buffers of 256 bytes or more).
bool crc32c_vpclmul_supported();

// CRC-32C of `nbytes` bytes at `data`, continuing from `seed` (the CRC of the preceding bytes;
// 0 for a fresh start), so crc32c(b, crc32c(a)) == crc32c(a + b). kAuto picks VPCLMULQDQ folding
// (buffers of 256 bytes or more), else SSE4.2, else software, whichever the CPU has; kVpclmul
// and kSse42 on a CPU without them fall back the same way; all give the same value.
std::uint32_t crc32c(const void* data, std::size_t nbytes, std::uint32_t seed = 0,
                     Crc32cImpl impl = Crc32cImpl::kAuto);

// For kernels that fold data they already hold in vector registers (the AVX2 Adam kernel's
// checksums): whether this CPU has the 256-bit (VEX) VPCLMULQDQ and the SSE4.2 crc32 they need,
// and the two carry-less multiply constants that fold a 128-bit lane of a reflected CRC-32C
// register `bits` bits forward ({x^(bits+63), x^(bits-1)} mod P, bit-reflected; `bits` >= 64).
bool crc32c_fold256_supported();
void crc32c_fold_constants(std::size_t bits, std::uint64_t out[2]);

// CRC-32C of the concatenation A||B from crc_a = crc32c(A), crc_b = crc32c(B) and |B|, in
// O(log |B|) matrix work: lets several threads (or I/O completions) checksum pieces of one
// subgroup independently.
std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::size_t len_b);

}  // namespace mlp
