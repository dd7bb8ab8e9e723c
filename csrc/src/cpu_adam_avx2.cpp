// AVX2 + FMA + F16C path of the fused AdamW kernel: 8 lanes, same roundings as adam_scalar.
// The tail (< 8 elements) goes through the same vector body via small stack buffers, so every
// element of a call sees the identical instruction sequence.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")  // _mm256_add_ps(_mm256_mul_ps()) must not become an fma
#endif
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <cstring>
#include <limits>

#include "cpu_adam_dispatch.h"
#include "mlp/checksum.h"
#include "mlp/cpu_adam.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MLP_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace mlp {
namespace detail {
namespace {

MLP_TARGET_AVX2 inline __m256 load8(const void* g, DType dt) {
    switch (dt) {
        case DType::kBFloat16: {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(g)));
            return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        }
        case DType::kFloat16: return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(g)));
        default: return _mm256_loadu_ps(static_cast<const float*>(g));
    }
}

// Round-to-nearest-even to bf16 with quiet NaNs, as detail::f32_to_bf16 (integer arithmetic: the
// result is exact for subnormals too).
MLP_TARGET_AVX2 inline __m128i to_bf16_8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    return _mm256_castsi256_si128(packed);
}

MLP_TARGET_AVX2 inline void store8(void* out, DType dt, __m256 x) {
    switch (dt) {
        case DType::kBFloat16: _mm_storeu_si128(static_cast<__m128i*>(out), to_bf16_8(x)); break;
        case DType::kFloat16:
            _mm_storeu_si128(static_cast<__m128i*>(out), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            break;
        default: _mm256_storeu_ps(static_cast<float*>(out), x); break;
    }
}

// MKL's AVX2 vsSqrt: the Newton steps of the SSE kernel with fused multiply-adds; its fast
// path covers bits in [0x00800000, 0x7f7fffff], the other lanes get the exact sqrt.
MLP_TARGET_AVX2 inline __m256 sqrt8_newton_fma(__m256 x) {
    const __m256 half = _mm256_set1_ps(0.5f);
    const __m256 y = _mm256_rsqrt_ps(x);
    const __m256 s = _mm256_mul_ps(y, x);
    const __m256 h = _mm256_mul_ps(y, half);
    const __m256 r = _mm256_fnmadd_ps(s, h, half);
    const __m256 s1 = _mm256_fmadd_ps(r, s, s);
    const __m256 h1 = _mm256_fmadd_ps(r, h, h);
    const __m256 d = _mm256_fnmadd_ps(s1, s1, x);
    const __m256 approx = _mm256_fmadd_ps(h1, d, s1);
    const __m256i t = _mm256_add_epi32(_mm256_castps_si256(x), _mm256_set1_epi32(0x7f800000));
    const __m256i special = _mm256_cmpgt_epi32(t, _mm256_set1_epi32(static_cast<int>(0xfeffffffu)));
    if (__builtin_expect(_mm256_testz_si256(special, special), 1)) return approx;
    return _mm256_blendv_ps(approx, _mm256_sqrt_ps(x), _mm256_castsi256_ps(special));
}

MLP_TARGET_AVX2 inline __m256 sqrt8(SqrtMode mode, __m256 x) {
    if (mode == SqrtMode::kRsqrt14Fma) {  // only on AVX-512 CPUs forced onto this path (tests)
        alignas(32) float t[8];
        _mm256_store_ps(t, x);
        sqrt_rsqrt14_fma_8(t, t);
        return _mm256_load_ps(t);
    }
    if (mode == SqrtMode::kRsqrtNewtonFma) return sqrt8_newton_fma(x);
    if (mode != SqrtMode::kRsqrtNewton) return _mm256_sqrt_ps(x);
    const __m256 half = _mm256_set1_ps(0.5f);
    const __m256 y = _mm256_rsqrt_ps(x);
    const __m256 s = _mm256_mul_ps(x, y);
    const __m256 h = _mm256_mul_ps(y, half);
    const __m256 r = _mm256_sub_ps(half, _mm256_mul_ps(s, h));
    const __m256 s1 = _mm256_add_ps(_mm256_mul_ps(s, r), s);
    const __m256 h1 = _mm256_add_ps(_mm256_mul_ps(h, r), h);
    const __m256 d = _mm256_sub_ps(x, _mm256_mul_ps(s1, s1));
    const __m256 approx = _mm256_add_ps(_mm256_mul_ps(d, h1), s1);
    // Zero, subnormal, huge, inf and NaN lanes take the exact sqrt, as MKL's rare path does.
    const __m256i t = _mm256_add_epi32(_mm256_castps_si256(x), _mm256_set1_epi32(0x7f800000));
    const __m256i special = _mm256_cmpgt_epi32(t, _mm256_set1_epi32(static_cast<int>(0xfefff000u)));
    if (__builtin_expect(_mm256_testz_si256(special, special), 1)) return approx;
    return _mm256_blendv_ps(approx, _mm256_sqrt_ps(x), _mm256_castsi256_ps(special));
}

struct Consts8 {
    __m256 inv, clip, decay, w, wm1, b2, omb2, bc2, eps, nss;
    __m256 m_scale, v_scale, m_rscale, v_rscale;  // fp16 moments only
};

// The state of eight elements, as loaded or as updated.
struct State8 {
    __m256 p, m, v;
};

MLP_TARGET_AVX2 inline State8 load_state8(const float* p, const float* m, const float* v) {
    return {_mm256_loadu_ps(p), _mm256_loadu_ps(m), _mm256_loadu_ps(v)};
}

MLP_TARGET_AVX2 inline void store_state8(float* p, float* m, float* v, const State8& x) {
    _mm256_storeu_ps(p, x.p);
    _mm256_storeu_ps(m, x.m);
    _mm256_storeu_ps(v, x.v);
}

// bf16 moments: widened on load, rounded to nearest even on store (as to_bf16_8 does for params).
MLP_TARGET_AVX2 inline State8 load_state8(const float* p, const std::uint16_t* m, const std::uint16_t* v) {
    return {_mm256_loadu_ps(p), load8(m, DType::kBFloat16), load8(v, DType::kBFloat16)};
}

MLP_TARGET_AVX2 inline void store_state8(float* p, std::uint16_t* m, std::uint16_t* v, const State8& x) {
    _mm256_storeu_ps(p, x.p);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m), to_bf16_8(x.m));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v), to_bf16_8(x.v));
}

// fp16 moments scaled per tensor: f32(h) * scale on load, f16(x * rscale) to nearest even on store.
MLP_TARGET_AVX2 inline __m256 load_half8(const Half* a, __m256 scale) {
    return _mm256_mul_ps(load8(a, DType::kFloat16), scale);
}

MLP_TARGET_AVX2 inline void store_half8(Half* a, __m256 x, __m256 rscale) {
    store8(a, DType::kFloat16, _mm256_mul_ps(x, rscale));
}

// The scales live in the consts; the other storages ignore them.
template <class M>
MLP_TARGET_AVX2 inline State8 load_state8(const Consts8&, const float* p, const M* m, const M* v) {
    return load_state8(p, m, v);
}

template <class M>
MLP_TARGET_AVX2 inline void store_state8(const Consts8&, float* p, M* m, M* v, const State8& x) {
    store_state8(p, m, v, x);
}

MLP_TARGET_AVX2 inline State8 load_state8(const Consts8& c, const float* p, const Half* m, const Half* v) {
    return {_mm256_loadu_ps(p), load_half8(m, c.m_scale), load_half8(v, c.v_scale)};
}

MLP_TARGET_AVX2 inline void store_state8(const Consts8& c, float* p, Half* m, Half* v, const State8& x) {
    _mm256_storeu_ps(p, x.p);
    store_half8(m, x.m, c.m_rscale);
    store_half8(v, x.v, c.v_rscale);
}

MLP_TARGET_AVX2 inline __m256 scaled_grad8(const AdamScalars& s, const Consts8& c, __m256 gi) {
    if (s.apply_unscale) gi = _mm256_mul_ps(gi, c.inv);
    if (s.apply_clip) gi = _mm256_mul_ps(gi, c.clip);
    return gi;
}

// The new moments from the scaled gradient: shared by the update and the absmax pass.
template <bool SmallWeight>
MLP_TARGET_AVX2 inline void new_moments8(const Consts8& c, __m256 gi, __m256& mi, __m256& vi) {
    const __m256 diff = _mm256_sub_ps(gi, mi);
    mi = SmallWeight ? _mm256_fmadd_ps(c.w, diff, mi) : _mm256_fmadd_ps(c.wm1, diff, gi);
    vi = _mm256_fmadd_ps(_mm256_mul_ps(c.omb2, gi), gi, _mm256_mul_ps(vi, c.b2));
}

// The AdamW update of eight elements (the arithmetic of adam_scalar, lane by lane).
template <DType G, bool SmallWeight, int Sq>
MLP_TARGET_AVX2 inline State8 update8(const AdamScalars& s, const Consts8& c, State8 x, const void* g) {
    const __m256 gi = scaled_grad8(s, c, load8(g, G));
    __m256 pi = x.p;
    if (s.apply_decay) pi = _mm256_mul_ps(pi, c.decay);
    __m256 mi = x.m;
    __m256 vi = x.v;
    new_moments8<SmallWeight>(c, gi, mi, vi);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(sqrt8(static_cast<SqrtMode>(Sq), vi), c.bc2), c.eps);
    pi = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(c.nss, mi), denom));
    return {pi, mi, vi};
}

template <DType G, int O, bool SmallWeight, int Sq, class M>
MLP_TARGET_AVX2 inline void body8(const AdamScalars& s, const Consts8& c, float* p, M* m, M* v,
                                  const void* g, void* out) {
    const State8 y = update8<G, SmallWeight, Sq>(s, c, load_state8(c, p, m, v), g);
    store_state8(c, p, m, v, y);
    if constexpr (O >= 0) store8(out, static_cast<DType>(O), y.p);
}

// The last r < 8 elements of a loop, staged in zero-padded vectors so they go through the same
// body as the others. M: the moments' storage (float, or bf16 bits).
template <class M = float>
struct Tail8 {
    alignas(64) float p[8] = {};
    alignas(64) M m[8] = {}, v[8] = {};
    alignas(64) unsigned char g[32] = {}, out[32] = {};
    std::size_t r;

    Tail8(const float* ps, const M* ms, const M* vs, const void* gs, std::size_t gb, std::size_t n)
        : r(n) {
        std::memcpy(p, ps, r * 4);
        std::memcpy(m, ms, r * sizeof(M));
        std::memcpy(v, vs, r * sizeof(M));
        std::memcpy(g, gs, r * gb);
    }

    // Copies the updated elements (and `ob`-byte outputs, when `o` is not null) back.
    void write_back(float* pd, M* md, M* vd, void* o, std::size_t ob) const {
        std::memcpy(pd, p, r * 4);
        std::memcpy(md, m, r * sizeof(M));
        std::memcpy(vd, v, r * sizeof(M));
        if (o) std::memcpy(o, out, r * ob);
    }
};

template <DType G, int O, bool SmallWeight, int Sq>
struct Loop8 {
    template <class M>
    MLP_TARGET_AVX2 static void run(const AdamScalars& s, const Consts8& c, float* p, M* m, M* v,
                                    const void* g, void* out, std::size_t n) {
        constexpr std::size_t gb = G == DType::kFloat32 ? 4 : 2;
        constexpr std::size_t ob = O == static_cast<int>(DType::kFloat32) ? 4 : 2;
        std::size_t i = 0;
        for (; i + 8 <= n; i += 8) {
            body8<G, O, SmallWeight, Sq>(s, c, p + i, m + i, v + i, static_cast<const char*>(g) + i * gb,
                                            O >= 0 ? static_cast<char*>(out) + i * ob : nullptr);
        }
        if (i < n) {
            Tail8<M> t(p + i, m + i, v + i, static_cast<const char*>(g) + i * gb, gb, n - i);
            body8<G, O, SmallWeight, Sq>(s, c, t.p, t.m, t.v, t.g, t.out);
            t.write_back(p + i, m + i, v + i, O >= 0 ? static_cast<char*>(out) + i * ob : nullptr, ob);
        }
    }
};

// Running absmax of new moments (fp16 moments): max of |x| over the non-NaN lanes, NaN lanes noted apart.
struct Absmax8 {
    __m256 m, v, nan_m, nan_v;
};

template <DType G, bool SmallWeight>
MLP_TARGET_AVX2 inline void absmax_body8(const AdamScalars& s, const Consts8& c, const Half* m, const Half* v,
                                         const void* g, Absmax8& a) {
    const __m256 gi = scaled_grad8(s, c, load8(g, G));
    __m256 mi = load_half8(m, c.m_scale);
    __m256 vi = load_half8(v, c.v_scale);
    new_moments8<SmallWeight>(c, gi, mi, vi);
    a.nan_m = _mm256_or_ps(a.nan_m, _mm256_cmp_ps(mi, mi, _CMP_UNORD_Q));
    a.nan_v = _mm256_or_ps(a.nan_v, _mm256_cmp_ps(vi, vi, _CMP_UNORD_Q));
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    a.m = _mm256_max_ps(_mm256_and_ps(mi, magnitude), a.m);  // a NaN lane keeps a.m (vmaxps returns its second operand)
    a.v = _mm256_max_ps(_mm256_and_ps(vi, magnitude), a.v);
}

MLP_TARGET_AVX2 inline float max8(__m256 x) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, x);
    float r = lanes[0];
    for (int i = 1; i < 8; ++i) r = lanes[i] > r ? lanes[i] : r;
    return r;
}

template <DType G, bool SmallWeight>
struct AbsmaxLoop8 {
    MLP_TARGET_AVX2 static void run(const AdamScalars& s, const Consts8& c, const Half* m, const Half* v,
                                    const void* g, std::size_t n, float* absmax);
};

template <DType G, bool SmallWeight>
MLP_TARGET_AVX2 void AbsmaxLoop8<G, SmallWeight>::run(const AdamScalars& s, const Consts8& c, const Half* m,
                                                      const Half* v, const void* g, std::size_t n, float* absmax) {
    constexpr std::size_t gb = G == DType::kFloat32 ? 4 : 2;
    Absmax8 a{_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) absmax_body8<G, SmallWeight>(s, c, m + i, v + i, static_cast<const char*>(g) + i * gb, a);
    if (i < n) {  // zero-padded lanes: zero moments and gradient give zero new moments
        alignas(32) Half tm[8] = {}, tv[8] = {};
        alignas(32) unsigned char tg[32] = {};
        std::memcpy(tm, m + i, (n - i) * 2);
        std::memcpy(tv, v + i, (n - i) * 2);
        std::memcpy(tg, static_cast<const char*>(g) + i * gb, (n - i) * gb);
        absmax_body8<G, SmallWeight>(s, c, tm, tv, tg, a);
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    absmax[0] = _mm256_movemask_ps(a.nan_m) ? nan : max8(a.m);
    absmax[1] = _mm256_movemask_ps(a.nan_v) ? nan : max8(a.v);
}

// ---- the same loop, checksumming the state it loads and stores (crc32c_fold256_supported CPUs)
//
// A region read back from storage is verified, and one to be written back is checksummed, by
// the pass that updates it. Checksumming a 16 KiB tile in a pass of its own right before and
// after its update (the other paths) streams every byte through the crc32 instruction in a
// second loop; here each 32 bytes the update loads or stores are checksummed while they are in
// registers or in L1, split between two kinds of execution pipes:
//   - p, m, v as loaded and p as stored: the crc32 instruction (integer pipes), one chain per
//     array, reading the 32 bytes again from L1;
//   - m, v as stored: folded into one 256-bit CRC-32C accumulator per array with carry-less
//     multiplies (its two 128-bit lanes are the last 32 bytes, folded 256 bits forward by each
//     next 32 bytes, as crc32c_vpclmul does with four 512-bit accumulators).
// Folding all six streams put 12 ymm carry-less multiplies per 8 elements on the floating-point
// pipes, which the update's divisions and square root already keep busy; chaining all six
// through crc32 made the integer side the longer one. The split above was the fastest of the
// splits measured on a 2-core AMD EPYC (Zen 3): see docs/benchmarks/adam.md.
#define MLP_TARGET_AVX2_CLMUL __attribute__((target("avx2,fma,f16c,vpclmulqdq,pclmul,sse4.2")))

struct CrcConsts8 {
    Consts8 adam;
    __m256i k256;          // folds each 128-bit lane 256 bits forward
    __m128i k128;          // folds the first lane onto the second
    std::uint32_t* in;     // CRC-32C of p, m, v as loaded (null: not wanted)
    std::uint32_t* out;    // CRC-32C of p, m, v as stored (null: not wanted)
};

MLP_TARGET_AVX2_CLMUL inline __m256i fold256(__m256i acc, __m256i k, __m256 next) {
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(acc, k, 0x00),
                                             _mm256_clmulepi64_epi128(acc, k, 0x11)),
                            _mm256_castps_si256(next));
}

// The running (pre-inverted) CRC register of the bytes an accumulator has folded.
MLP_TARGET_AVX2_CLMUL inline std::uint32_t fold_finish(__m256i acc, __m128i k128) {
    const __m128i first = _mm256_castsi256_si128(acc), second = _mm256_extracti128_si256(acc, 1);
    const __m128i r = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(first, k128, 0x00),
                                                  _mm_clmulepi64_si128(first, k128, 0x11)),
                                    second);
    std::uint64_t c = _mm_crc32_u64(0, static_cast<std::uint64_t>(_mm_cvtsi128_si64(r)));
    c = _mm_crc32_u64(c, static_cast<std::uint64_t>(_mm_extract_epi64(r, 1)));
    return static_cast<std::uint32_t>(c);
}

MLP_TARGET_AVX2_CLMUL inline std::uint32_t crc_floats(std::uint32_t reg, const float* x, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
        std::uint32_t w;
        std::memcpy(&w, x + i, 4);
        reg = _mm_crc32_u32(reg, w);
    }
    return reg;
}

// Extends a CRC register by the 32 bytes of 8 floats (read from L1: they were just loaded or
// stored).
MLP_TARGET_AVX2_CLMUL inline std::uint32_t crc_8floats(std::uint32_t reg, const float* x) {
    std::uint64_t w[4];
    std::memcpy(w, x, 32);
    std::uint64_t c = reg;
    c = _mm_crc32_u64(c, w[0]);
    c = _mm_crc32_u64(c, w[1]);
    c = _mm_crc32_u64(c, w[2]);
    c = _mm_crc32_u64(c, w[3]);
    return static_cast<std::uint32_t>(c);
}

template <DType G, int O, bool SmallWeight, int Sq>
struct Loop8Crc {
    MLP_TARGET_AVX2_CLMUL static void run(const AdamScalars& s, const CrcConsts8& c, float* p, float* m, float* v,
                                          const void* g, void* out, std::size_t n) {
        constexpr std::size_t gb = G == DType::kFloat32 ? 4 : 2;
        constexpr std::size_t ob = O == static_cast<int>(DType::kFloat32) ? 4 : 2;
        const bool want_in = c.in != nullptr, want_out = c.out != nullptr;
        // Registers of a fresh CRC (seed 0); they enter the message as its first 32 bits.
        std::uint32_t reg_in[3] = {~0u, ~0u, ~0u}, reg_out[3] = {~0u, ~0u, ~0u};
        std::size_t i = 0;
        // The crc32 chains need no first step of their own; the folds start from the first
        // stored vectors with the register's seed in their first 32 bits.
        __m256i out_m = _mm256_setzero_si256(), out_v = _mm256_setzero_si256();
        for (; i + 8 <= n; i += 8) {
            const State8 xi = load_state8(p + i, m + i, v + i);
            if (want_in) {
                reg_in[0] = crc_8floats(reg_in[0], p + i);
                reg_in[1] = crc_8floats(reg_in[1], m + i);
                reg_in[2] = crc_8floats(reg_in[2], v + i);
            }
            const State8 yi = update8<G, SmallWeight, Sq>(s, c.adam, xi, static_cast<const char*>(g) + i * gb);
            store_state8(p + i, m + i, v + i, yi);
            if constexpr (O >= 0) store8(static_cast<char*>(out) + i * ob, static_cast<DType>(O), yi.p);
            if (want_out) {
                reg_out[0] = crc_8floats(reg_out[0], p + i);
                if (i == 0) {
                    const __m256i seed = _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, -1);
                    out_m = _mm256_xor_si256(_mm256_castps_si256(yi.m), seed);
                    out_v = _mm256_xor_si256(_mm256_castps_si256(yi.v), seed);
                } else {
                    out_m = fold256(out_m, c.k256, yi.m);
                    out_v = fold256(out_v, c.k256, yi.v);
                }
            }
        }
        if (want_out && i > 0) {
            reg_out[1] = fold_finish(out_m, c.k128);
            reg_out[2] = fold_finish(out_v, c.k128);
        }
        if (i < n) {  // the last < 8 elements, through the same body as in Loop8
            Tail8<> t(p + i, m + i, v + i, static_cast<const char*>(g) + i * gb, gb, n - i);
            if (want_in) {
                reg_in[0] = crc_floats(reg_in[0], t.p, t.r);
                reg_in[1] = crc_floats(reg_in[1], t.m, t.r);
                reg_in[2] = crc_floats(reg_in[2], t.v, t.r);
            }
            body8<G, O, SmallWeight, Sq>(s, c.adam, t.p, t.m, t.v, t.g, t.out);
            if (want_out) {
                reg_out[0] = crc_floats(reg_out[0], t.p, t.r);
                reg_out[1] = crc_floats(reg_out[1], t.m, t.r);
                reg_out[2] = crc_floats(reg_out[2], t.v, t.r);
            }
            t.write_back(p + i, m + i, v + i, O >= 0 ? static_cast<char*>(out) + i * ob : nullptr, ob);
        }
        for (int a = 0; a < 3; ++a) {
            if (want_in) c.in[a] = ~reg_in[a];
            if (want_out) c.out[a] = ~reg_out[a];
        }
    }
};

}  // namespace

static MLP_TARGET_AVX2 Consts8 make_consts8(const AdamScalars& s) {
    Consts8 c;
    c.inv = _mm256_set1_ps(s.inv_loss_scale);
    c.clip = _mm256_set1_ps(s.clip_coef);
    c.decay = _mm256_set1_ps(s.decay);
    c.w = _mm256_set1_ps(s.lerp_weight);
    c.wm1 = _mm256_set1_ps(s.lerp_weight - 1.0f);
    c.b2 = _mm256_set1_ps(s.beta2);
    c.omb2 = _mm256_set1_ps(s.one_minus_beta2);
    c.bc2 = _mm256_set1_ps(s.bc2_sqrt);
    c.eps = _mm256_set1_ps(s.eps);
    c.nss = _mm256_set1_ps(s.neg_step_size);
    c.m_scale = _mm256_set1_ps(s.m_scale);
    c.v_scale = _mm256_set1_ps(s.v_scale);
    c.m_rscale = _mm256_set1_ps(s.m_rscale);
    c.v_rscale = _mm256_set1_ps(s.v_rscale);
    return c;
}

MLP_TARGET_AVX2 void adam_avx2(const AdamScalars& s, float* p, float* m, float* v, const void* g, DType gdt,
                               void* out, DType odt, std::size_t n) {
    adam_dispatch<Loop8>(s, make_consts8(s), p, m, v, g, gdt, out, odt, n);
}

MLP_TARGET_AVX2 void adam_avx2_m16(const AdamScalars& s, float* p, std::uint16_t* m, std::uint16_t* v,
                                   const void* g, DType gdt, void* out, DType odt, std::size_t n) {
    adam_dispatch<Loop8>(s, make_consts8(s), p, m, v, g, gdt, out, odt, n);
}

MLP_TARGET_AVX2 void adam_avx2_mh(const AdamScalars& s, float* p, Half* m, Half* v, const void* g, DType gdt,
                                  void* out, DType odt, std::size_t n) {
    adam_dispatch<Loop8>(s, make_consts8(s), p, m, v, g, gdt, out, odt, n);
}

MLP_TARGET_AVX2 void absmax_avx2_mh(const AdamScalars& s, const Half* m, const Half* v, const void* g, DType gdt,
                                    std::size_t n, float* absmax) {
    absmax_dispatch<AbsmaxLoop8>(s, make_consts8(s), m, v, g, gdt, n, absmax);
}

MLP_TARGET_AVX2_CLMUL void adam_avx2_checksummed(const AdamScalars& s, float* p, float* m, float* v, const void* g,
                                                 DType gdt, void* out, DType odt, std::size_t n,
                                                 std::uint32_t* in_crcs, std::uint32_t* out_crcs) {
    struct FoldKeys {   // derived once per process, not per call and thread
        std::uint64_t k256[2], k128[2];
        FoldKeys() {
            crc32c_fold_constants(256, k256);
            crc32c_fold_constants(128, k128);
        }
    };
    static const FoldKeys k;
    const CrcConsts8 c{make_consts8(s),
                       _mm256_set_epi64x(static_cast<long long>(k.k256[1]), static_cast<long long>(k.k256[0]),
                                         static_cast<long long>(k.k256[1]), static_cast<long long>(k.k256[0])),
                       _mm_set_epi64x(static_cast<long long>(k.k128[1]), static_cast<long long>(k.k128[0])),
                       in_crcs, out_crcs};
    adam_dispatch<Loop8Crc>(s, c, p, m, v, g, gdt, out, odt, n);
}

namespace {
struct StatsAcc8 {
    __m256d acc0, acc1;
    __m256i bad;
};
MLP_TARGET_AVX2 inline void stats_one8(StatsAcc8& a, __m256 x) {
    const __m256i expmask = _mm256_set1_epi32(0x7f800000);
    const __m256i e = _mm256_and_si256(_mm256_castps_si256(x), expmask);
    a.bad = _mm256_or_si256(a.bad, _mm256_cmpeq_epi32(e, expmask));
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    a.acc0 = _mm256_fmadd_pd(lo, lo, a.acc0);  // the product of two widened floats is exact
    a.acc1 = _mm256_fmadd_pd(hi, hi, a.acc1);
}
}  // namespace

MLP_TARGET_AVX2 void stats_avx2(const void* g, DType dt, std::size_t n, GradStats* out) {
    StatsAcc8 a{_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_si256()};
    const std::size_t gb = dtype_bytes(dt);
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) stats_one8(a, load8(static_cast<const char*>(g) + i * gb, dt));
    if (i < n) {
        alignas(32) unsigned char tg[32] = {};
        std::memcpy(tg, static_cast<const char*>(g) + i * gb, (n - i) * gb);
        stats_one8(a, load8(tg, dt));
    }
    alignas(32) double parts[4];
    _mm256_store_pd(parts, _mm256_add_pd(a.acc0, a.acc1));
    out->sum_of_squares = (parts[0] + parts[1]) + (parts[2] + parts[3]);
    out->found_nonfinite = !_mm256_testz_si256(a.bad, a.bad);
}

MLP_TARGET_AVX2 void sqrt_avx2(SqrtMode mode, const float* in, float* out, std::size_t n) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, sqrt8(mode, _mm256_loadu_ps(in + i)));
    if (i < n) {
        alignas(32) float t[8] = {};
        std::memcpy(t, in + i, (n - i) * 4);
        _mm256_store_ps(t, sqrt8(mode, _mm256_load_ps(t)));
        std::memcpy(out + i, t, (n - i) * 4);
    }
}

MLP_TARGET_AVX2 float sqrt_rsqrt_newton_fma_1(float x) {
    return _mm256_cvtss_f32(sqrt8_newton_fma(_mm256_set1_ps(x)));
}

}  // namespace detail
}  // namespace mlp

#else  // not x86-64 GCC/Clang: never selected (isa_supported(kAvx2) is false)

namespace mlp {
namespace detail {
void adam_avx2(const AdamScalars& s, float* p, float* m, float* v, const void* g, DType gdt, void* out, DType odt,
               std::size_t n) {
    adam_scalar(s, p, m, v, g, gdt, out, odt, n);
}
void adam_avx2_m16(const AdamScalars& s, float* p, std::uint16_t* m, std::uint16_t* v, const void* g, DType gdt,
                   void* out, DType odt, std::size_t n) {
    adam_scalar_m16(s, p, m, v, g, gdt, out, odt, n);
}
void adam_avx2_mh(const AdamScalars& s, float* p, Half* m, Half* v, const void* g, DType gdt, void* out, DType odt,
                  std::size_t n) {
    adam_scalar_mh(s, p, m, v, g, gdt, out, odt, n);
}
void absmax_avx2_mh(const AdamScalars& s, const Half* m, const Half* v, const void* g, DType gdt, std::size_t n,
                    float* absmax) {
    absmax_scalar_mh(s, m, v, g, gdt, n, absmax);
}
void adam_avx2_checksummed(const AdamScalars& s, float* p, float* m, float* v, const void* g, DType gdt, void* out,
                           DType odt, std::size_t n, std::uint32_t*, std::uint32_t*) {
    adam_scalar(s, p, m, v, g, gdt, out, odt, n);  // never called: crc32c_fold256_supported() is false
}
void stats_avx2(const void* g, DType dt, std::size_t n, GradStats* out) { stats_scalar(g, dt, n, out); }
void sqrt_avx2(SqrtMode mode, const float* in, float* out, std::size_t n) { sqrt_scalar(mode, in, out, n); }
float sqrt_rsqrt_newton_fma_1(float x) { return x; }  // never called: the mode is unsupported here
}  // namespace detail
}  // namespace mlp
#endif
