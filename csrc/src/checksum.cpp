// CRC-32C: SSE4.2 crc32 instruction over three interleaved streams (the instruction has a latency
// of 3 cycles and a throughput of 1 per cycle), recombined with precomputed "append zeros"
// operators; slicing-by-8 tables as the portable fallback. All tables are immutable after their
// thread-safe first-use initialisation.
#include "mlp/checksum.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MLP_HAVE_CRC_HW 1
#endif

namespace mlp {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct SoftTables {
    std::uint32_t t[8][256];
    SoftTables() {
        for (std::uint32_t i = 0; i < 256; ++i) {
            std::uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
            t[0][i] = c;
        }
        for (std::uint32_t i = 0; i < 256; ++i)
            for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
    }
};

const SoftTables& soft_tables() {
    static const SoftTables tables;
    return tables;
}

std::uint32_t crc32c_software(std::uint32_t crc, const unsigned char* p, std::size_t n) {
    const auto& T = soft_tables().t;
    while (n && (reinterpret_cast<std::uintptr_t>(p) & 7u)) {
        crc = (crc >> 8) ^ T[0][(crc ^ *p++) & 0xffu];
        --n;
    }
    while (n >= 8) {
        std::uint64_t w;
        std::memcpy(&w, p, 8);  // little-endian x86/ARM: byte 0 is the low byte
        w ^= crc;
        crc = T[7][w & 0xff] ^ T[6][(w >> 8) & 0xff] ^ T[5][(w >> 16) & 0xff] ^ T[4][(w >> 24) & 0xff] ^
              T[3][(w >> 32) & 0xff] ^ T[2][(w >> 40) & 0xff] ^ T[1][(w >> 48) & 0xff] ^ T[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ T[0][(crc ^ *p++) & 0xffu];
    return crc;
}

// GF(2) 32x32 matrices (column i = image of bit i) for the operator "append k zero bytes".
using Mat = std::array<std::uint32_t, 32>;

std::uint32_t mat_times(const Mat& m, std::uint32_t v) {
    std::uint32_t r = 0;
    for (int i = 0; v; ++i, v >>= 1)
        if (v & 1u) r ^= m[i];
    return r;
}

Mat mat_square(const Mat& m) {
    Mat r;
    for (int i = 0; i < 32; ++i) r[i] = mat_times(m, m[i]);
    return r;
}

// Operator that advances a (pre-inverted, reflected) CRC register over `nbytes` zero bytes.
Mat zeros_operator(std::size_t nbytes) {
    Mat one_bit;  // shifting one zero bit through the reflected register
    one_bit[0] = kPoly;
    for (int i = 1; i < 32; ++i) one_bit[i] = 1u << (i - 1);
    Mat op = mat_square(mat_square(mat_square(one_bit)));  // 8 zero bits = one zero byte
    Mat result{};
    bool have = false;
    for (std::size_t k = nbytes; k; k >>= 1) {  // square-and-multiply over the bits of nbytes
        if (k & 1u) {
            if (!have) {
                result = op;
                have = true;
            } else {
                Mat r;
                for (int i = 0; i < 32; ++i) r[i] = mat_times(op, result[i]);
                result = r;
            }
        }
        op = mat_square(op);
    }
    return result;
}

#ifdef MLP_HAVE_CRC_HW
struct ShiftTable {
    std::uint32_t t[4][256];
    explicit ShiftTable(std::size_t nbytes) {
        const Mat op = zeros_operator(nbytes);
        for (std::uint32_t i = 0; i < 256; ++i)
            for (int b = 0; b < 4; ++b) t[b][i] = mat_times(op, i << (8 * b));
    }
    std::uint32_t apply(std::uint32_t crc) const {
        return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
    }
};

constexpr std::size_t kLong = 8192;  // bytes per stream in the long interleave
constexpr std::size_t kShort = 256;  // bytes per stream in the short interleave

const ShiftTable& long_shift() {
    static const ShiftTable t(kLong);
    return t;
}
const ShiftTable& short_shift() {
    static const ShiftTable t(kShort);
    return t;
}

__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(std::uint32_t crc, const unsigned char* p,
                                                               std::size_t n) {
    std::uint64_t c0 = crc;
    while (n && (reinterpret_cast<std::uintptr_t>(p) & 7u)) {
        c0 = _mm_crc32_u8(static_cast<std::uint32_t>(c0), *p++);
        --n;
    }
    auto word = [](const unsigned char* q) {
        std::uint64_t w;
        std::memcpy(&w, q, 8);
        return w;
    };
    const ShiftTable& ls = long_shift();
    const ShiftTable& ss = short_shift();
    // Three streams over consecutive blocks; stream k's CRC starts at 0 and is appended by
    // shifting the running CRC over the block length (crc(A||B) = shift(crc(A), |B|) ^ crc0(B)).
    for (const auto& [block, shift] : {std::pair<std::size_t, const ShiftTable*>{kLong, &ls}, {kShort, &ss}}) {
        while (n >= 3 * block) {
            std::uint64_t c1 = 0, c2 = 0;
            const unsigned char* end = p + block;
            do {
                c0 = _mm_crc32_u64(c0, word(p));
                c1 = _mm_crc32_u64(c1, word(p + block));
                c2 = _mm_crc32_u64(c2, word(p + 2 * block));
                p += 8;
            } while (p < end);
            c0 = shift->apply(static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c1);
            c0 = shift->apply(static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c2);
            p += 2 * block;
            n -= 3 * block;
        }
    }
    while (n >= 8) {
        c0 = _mm_crc32_u64(c0, word(p));
        p += 8;
        n -= 8;
    }
    while (n--) c0 = _mm_crc32_u8(static_cast<std::uint32_t>(c0), *p++);
    return static_cast<std::uint32_t>(c0);
}
#endif

}  // namespace

bool crc32c_hw_supported() {
#ifdef MLP_HAVE_CRC_HW
    return __builtin_cpu_supports("sse4.2");
#else
    return false;
#endif
}

std::uint32_t crc32c(const void* data, std::size_t nbytes, std::uint32_t seed, Crc32cImpl impl) {
    const auto* p = static_cast<const unsigned char*>(data);
    const std::uint32_t crc = ~seed;
#ifdef MLP_HAVE_CRC_HW
    if (impl != Crc32cImpl::kSoftware && crc32c_hw_supported()) return ~crc32c_sse42(crc, p, nbytes);
#else
    (void)impl;
#endif
    return ~crc32c_software(crc, p, nbytes);
}

std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::size_t len_b) {
    if (len_b == 0) return crc_a;
    // The pre/post inversions of A's and B's registers cancel: crc(A||B) = Z^|B|(crc_a) ^ crc_b,
    // with Z the "append one zero byte" operator.
    return mat_times(zeros_operator(len_b), crc_a) ^ crc_b;
}

}  // namespace mlp
