// CRC-32C: carry-less multiply folding where the CPU has AVX-512 VPCLMULQDQ (four 128-bit folds
// per instruction; about twice the crc32 instruction's speed on an AMD EPYC); else the SSE4.2
// crc32 instruction over three interleaved streams (the instruction has a latency of 3 cycles and
// a throughput of 1 per cycle), recombined with precomputed "append zeros" operators;
// slicing-by-8 tables as the portable fallback. All tables and constants are immutable after
// their thread-safe first-use initialisation.
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

// Carry-less multiply folding (AVX-512 VPCLMULQDQ): 256 bytes per iteration in four 512-bit
// accumulators, each 128-bit lane folded 256 bytes forward with two 64x64 carry-less products.
// For a lane V = [lo | hi] (lo: the first 8 bytes, the higher-degree half) followed by D bits,
// V(x) * x^D == lo(x) * x^(D+64) + hi(x) * x^D, and each product is replaced by one with the
// same remainder mod P of at most 96 bits. Operands are bit-reflected, so the hardware product
// of two 64-bit values comes out multiplied by x; the constants are x^(D+63) and x^(D-1) mod P.
// The folded 16 bytes have the message's remainder, so the crc32 instruction finishes on them.
std::uint64_t reflected_xpow_mod(std::size_t n) {
    std::uint64_t r = 1;                                   // normal form, bit d = coefficient of x^d
    for (std::size_t i = 0; i < n; ++i) {
        r <<= 1;
        if (r & (1ull << 32)) r ^= (1ull << 32) | 0x1EDC6F41ull;  // P, the Castagnoli polynomial
    }
    std::uint64_t out = 0;                                 // reflected: coefficient d at bit 63 - d
    for (int d = 0; d < 32; ++d)
        if ((r >> d) & 1u) out |= 1ull << (63 - d);
    return out;
}

struct FoldConstants {
    // {coefficient for lo, coefficient for hi} per distance in bits.
    std::uint64_t d2048[2], d512[2], d384[2], d256[2], d128[2];
    FoldConstants() {
        auto set = [](std::uint64_t* k, std::size_t bits) {
            k[0] = reflected_xpow_mod(bits + 63);
            k[1] = reflected_xpow_mod(bits - 1);
        };
        set(d2048, 2048);
        set(d512, 512);
        set(d384, 384);
        set(d256, 256);
        set(d128, 128);
    }
};

const FoldConstants& fold_constants() {
    static const FoldConstants k;
    return k;
}

constexpr std::size_t kFoldMinBytes = 256;

#define MLP_VPCLMUL_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))
// The helpers below pass 512-bit vectors between functions of this file only, all compiled for
// the same target: the ABI note GCC gives for that does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

MLP_VPCLMUL_TARGET inline __m512i broadcast_constants(const std::uint64_t* k) {
    const auto lo = static_cast<long long>(k[0]), hi = static_cast<long long>(k[1]);
    return _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo);
}

MLP_VPCLMUL_TARGET inline __m512i fold512(__m512i v, __m512i k, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(v, k, 0x00), _mm512_clmulepi64_epi128(v, k, 0x11),
                                     next, 0x96);
}

MLP_VPCLMUL_TARGET inline __m128i fold128(__m128i v, const std::uint64_t* k, __m128i next) {
    const __m128i kk = _mm_set_epi64x(static_cast<long long>(k[1]), static_cast<long long>(k[0]));
    return _mm_ternarylogic_epi64(_mm_clmulepi64_si128(v, kk, 0x00), _mm_clmulepi64_si128(v, kk, 0x11), next, 0x96);
}

// `crc` is the running (pre-inverted) register, as crc32c_sse42's. Needs n >= kFoldMinBytes.
MLP_VPCLMUL_TARGET std::uint32_t crc32c_vpclmul(std::uint32_t crc, const unsigned char* p, std::size_t n) {
    const FoldConstants& K = fold_constants();
    __m512i x0 = _mm512_loadu_si512(p), x1 = _mm512_loadu_si512(p + 64);
    __m512i x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
    // The register's value enters as the first 32 bits of the message (reflected CRC).
    x0 = _mm512_xor_si512(x0, _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, static_cast<long long>(crc)));
    p += 256;
    n -= 256;
    const __m512i k2048 = broadcast_constants(K.d2048);
    while (n >= 256) {
        x0 = fold512(x0, k2048, _mm512_loadu_si512(p));
        x1 = fold512(x1, k2048, _mm512_loadu_si512(p + 64));
        x2 = fold512(x2, k2048, _mm512_loadu_si512(p + 128));
        x3 = fold512(x3, k2048, _mm512_loadu_si512(p + 192));
        p += 256;
        n -= 256;
    }
    const __m512i k512 = broadcast_constants(K.d512);
    x1 = fold512(x0, k512, x1);
    x2 = fold512(x1, k512, x2);
    x3 = fold512(x2, k512, x3);
    // The four lanes of x3 into one: each folded over the lanes after it.
    alignas(64) __m128i lanes[4];
    _mm512_store_si512(lanes, x3);
    __m128i r = lanes[3];
    r = fold128(lanes[2], K.d128, r);
    r = fold128(lanes[1], K.d256, r);
    r = fold128(lanes[0], K.d384, r);
    while (n >= 16) {
        r = fold128(r, K.d128, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        p += 16;
        n -= 16;
    }
    std::uint64_t c = _mm_crc32_u64(0, static_cast<std::uint64_t>(_mm_cvtsi128_si64(r)));
    c = _mm_crc32_u64(c, static_cast<std::uint64_t>(_mm_extract_epi64(r, 1)));
    while (n--) c = _mm_crc32_u8(static_cast<std::uint32_t>(c), *p++);
    return static_cast<std::uint32_t>(c);
}
#endif

}  // namespace

bool crc32c_vpclmul_supported() {
#ifdef MLP_HAVE_CRC_HW
    return crc32c_hw_supported() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul");
#else
    return false;
#endif
}

bool crc32c_fold256_supported() {
#ifdef MLP_HAVE_CRC_HW
    return crc32c_hw_supported() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq") &&
           __builtin_cpu_supports("pclmul");
#else
    return false;
#endif
}

void crc32c_fold_constants(std::size_t bits, std::uint64_t out[2]) {
#ifdef MLP_HAVE_CRC_HW
    out[0] = reflected_xpow_mod(bits + 63);
    out[1] = reflected_xpow_mod(bits - 1);
#else
    (void)bits;
    out[0] = out[1] = 0;  // never used: crc32c_fold256_supported() is false
#endif
}

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
    if ((impl == Crc32cImpl::kAuto || impl == Crc32cImpl::kVpclmul) && nbytes >= kFoldMinBytes &&
        crc32c_vpclmul_supported())
        return ~crc32c_vpclmul(crc, p, nbytes);
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
