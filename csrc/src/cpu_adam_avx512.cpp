// AVX-512 path of the fused AdamW kernel: 16 lanes, same roundings as adam_scalar.
//
// bf16 output uses integer round-to-nearest-even rather than AVX512-BF16's vcvtneps2bf16: that
// instruction flushes subnormal inputs to zero, which torch's conversion does not, and the
// integer sequence costs nothing next to the memory traffic. The rsqrt of the MKL-compatible
// sqrt uses two 256-bit vrsqrtps (the 512-bit vrsqrt14ps is a different approximation).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_adam_dispatch.h"
#include "mlp/cpu_adam.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's avx512fintrin.h trips -Wmaybe-uninitialized on its own _mm512_undefined_*() (GCC PR105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MLP_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace mlp {
namespace detail {
namespace {

MLP_TARGET_AVX512 inline __m512 load16(const void* g, DType dt) {
    switch (dt) {
        case DType::kBFloat16: {
            const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(g)));
            return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        }
        case DType::kFloat16: return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(g)));
        default: return _mm512_loadu_ps(g);
    }
}

MLP_TARGET_AVX512 inline __m256i to_bf16_16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet));
}

// `stream`: non-temporal store (the output is only read later, by the host-to-device copy, so
// fetching its lines into the cache first would cost a read per write). Needs `out` aligned to
// the store width.
MLP_TARGET_AVX512 inline void store16(void* out, DType dt, __m512 x, bool stream) {
    switch (dt) {
        case DType::kBFloat16: {
            const __m256i h = to_bf16_16(x);
            if (stream) _mm256_stream_si256(static_cast<__m256i*>(out), h);
            else _mm256_storeu_si256(static_cast<__m256i*>(out), h);
            break;
        }
        case DType::kFloat16: {
            const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            if (stream) _mm256_stream_si256(static_cast<__m256i*>(out), h);
            else _mm256_storeu_si256(static_cast<__m256i*>(out), h);
            break;
        }
        default:
            if (stream) _mm512_stream_ps(static_cast<float*>(out), x);
            else _mm512_storeu_ps(out, x);
            break;
    }
}

// MKL's AVX-512 vsSqrt: y = rsqrt14(x), s = x*y, h = y/2, sqrt = s + h*(x - s*s) with two fmas;
// inputs below 2^-78 (y > 2^39) are scaled by 2^78 inside the correction; +-0, +-inf and
// negatives take the exact sqrt (their IEEE results).
MLP_TARGET_AVX512 inline __m512 sqrt16_rsqrt14_fma(__m512 x) {
    const __m512 y = _mm512_rsqrt14_ps(x);
    const __m512 h = _mm512_mul_ps(y, _mm512_set1_ps(0.5f));
    const __m512 s = _mm512_mul_ps(y, x);
    const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_set1_ps(0x1p39f), y, _CMP_LT_OS);
    __m512 r;
    if (__builtin_expect(tiny == 0, 1)) {
        r = _mm512_fmadd_ps(_mm512_fnmadd_ps(s, s, x), h, s);
    } else {
        const __m512 xs = _mm512_mask_mul_ps(x, tiny, x, _mm512_set1_ps(0x1p78f));
        const __m512 ss = _mm512_mask_mul_ps(s, tiny, s, _mm512_set1_ps(0x1p39f));
        const __m512 hs = _mm512_mask_mul_ps(h, tiny, h, _mm512_set1_ps(0x1p-78f));
        r = _mm512_fmadd_ps(hs, _mm512_fnmadd_ps(ss, ss, xs), s);
    }
    // +-0, +-inf and negative non-NaN lanes (vfpclassps 0x5e in MKL; integer compares need no AVX512DQ)
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __m512i inf = _mm512_set1_epi32(0x7f800000);
    const __mmask16 special = static_cast<__mmask16>(
        _mm512_cmpeq_epi32_mask(mag, _mm512_setzero_si512()) | _mm512_cmpeq_epi32_mask(mag, inf) |
        (_mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512()) & _mm512_cmple_epi32_mask(mag, inf)));
    if (__builtin_expect(special == 0, 1)) return r;
    return _mm512_mask_blend_ps(special, r, _mm512_sqrt_ps(x));
}

MLP_TARGET_AVX512 inline __m512 rsqrt16_sse(__m512 x) {  // vrsqrtps on both halves
    const __m256 ylo = _mm256_rsqrt_ps(_mm512_castps512_ps256(x));
    const __m256 yhi = _mm256_rsqrt_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(ylo)), _mm256_castps_pd(yhi), 1));
}

// MKL's AVX2 vsSqrt (see cpu_adam_avx2.cpp), for AVX-512 CPUs forced to that sqrt (tests).
MLP_TARGET_AVX512 inline __m512 sqrt16_newton_fma(__m512 x) {
    const __m512 half = _mm512_set1_ps(0.5f);
    const __m512 y = rsqrt16_sse(x);
    const __m512 s = _mm512_mul_ps(y, x);
    const __m512 h = _mm512_mul_ps(y, half);
    const __m512 r = _mm512_fnmadd_ps(s, h, half);
    const __m512 s1 = _mm512_fmadd_ps(r, s, s);
    const __m512 h1 = _mm512_fmadd_ps(r, h, h);
    const __m512 d = _mm512_fnmadd_ps(s1, s1, x);
    const __m512 approx = _mm512_fmadd_ps(h1, d, s1);
    const __m512i t = _mm512_add_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(0x7f800000));
    const __mmask16 special = _mm512_cmpgt_epi32_mask(t, _mm512_set1_epi32(static_cast<int>(0xfeffffffu)));
    if (__builtin_expect(special == 0, 1)) return approx;
    return _mm512_mask_blend_ps(special, approx, _mm512_sqrt_ps(x));
}

MLP_TARGET_AVX512 inline __m512 sqrt16(SqrtMode mode, __m512 x) {
    if (mode == SqrtMode::kRsqrt14Fma) return sqrt16_rsqrt14_fma(x);
    if (mode == SqrtMode::kRsqrtNewtonFma) return sqrt16_newton_fma(x);
    if (mode != SqrtMode::kRsqrtNewton) return _mm512_sqrt_ps(x);
    const __m512 half = _mm512_set1_ps(0.5f);
    const __m512 y = rsqrt16_sse(x);
    const __m512 s = _mm512_mul_ps(x, y);
    const __m512 h = _mm512_mul_ps(y, half);
    const __m512 r = _mm512_sub_ps(half, _mm512_mul_ps(s, h));
    const __m512 s1 = _mm512_add_ps(_mm512_mul_ps(s, r), s);
    const __m512 h1 = _mm512_add_ps(_mm512_mul_ps(h, r), h);
    const __m512 d = _mm512_sub_ps(x, _mm512_mul_ps(s1, s1));
    const __m512 approx = _mm512_add_ps(_mm512_mul_ps(d, h1), s1);
    // Zero, subnormal, huge, inf and NaN lanes take the exact sqrt, as MKL's rare path does. They
    // are rare (v == 0 where a gradient was exactly zero), so the costly vsqrtps runs only then.
    const __m512i t = _mm512_add_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(0x7f800000));
    const __mmask16 special = _mm512_cmpgt_epi32_mask(t, _mm512_set1_epi32(static_cast<int>(0xfefff000u)));
    if (__builtin_expect(special == 0, 1)) return approx;
    return _mm512_mask_blend_ps(special, approx, _mm512_sqrt_ps(x));
}

struct Consts16 {
    __m512 inv, clip, decay, w, wm1, b2, omb2, bc2, eps, nss;
    __m512 m_scale, v_scale, m_rscale, v_rscale;  // fp16 moments only
};

// The moments' storage: fp32, bf16 bits widened on load and rounded to nearest even on store, or
// fp16 bits scaled per tensor (`scale` multiplies a loaded moment, `rscale` one to be stored; the
// other two ignore them).
MLP_TARGET_AVX512 inline __m512 load_moment16(const float* a, __m512) { return _mm512_loadu_ps(a); }
MLP_TARGET_AVX512 inline __m512 load_moment16(const std::uint16_t* a, __m512) {
    return load16(a, DType::kBFloat16);
}
MLP_TARGET_AVX512 inline __m512 load_moment16(const Half* a, __m512 scale) {
    return _mm512_mul_ps(load16(a, DType::kFloat16), scale);
}
MLP_TARGET_AVX512 inline void store_moment16(float* a, __m512 x, __m512) { _mm512_storeu_ps(a, x); }
MLP_TARGET_AVX512 inline void store_moment16(std::uint16_t* a, __m512 x, __m512) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), to_bf16_16(x));
}
MLP_TARGET_AVX512 inline void store_moment16(Half* a, __m512 x, __m512 rscale) {
    store16(a, DType::kFloat16, _mm512_mul_ps(x, rscale), false);
}

MLP_TARGET_AVX512 inline __m512 scaled_grad16(const AdamScalars& s, const Consts16& c, __m512 gi) {
    if (s.apply_unscale) gi = _mm512_mul_ps(gi, c.inv);
    if (s.apply_clip) gi = _mm512_mul_ps(gi, c.clip);
    return gi;
}

// The new moments from the scaled gradient: shared by the update and the absmax pass.
template <bool SmallWeight>
MLP_TARGET_AVX512 inline void new_moments16(const Consts16& c, __m512 gi, __m512& mi, __m512& vi) {
    const __m512 diff = _mm512_sub_ps(gi, mi);
    mi = SmallWeight ? _mm512_fmadd_ps(c.w, diff, mi) : _mm512_fmadd_ps(c.wm1, diff, gi);
    vi = _mm512_fmadd_ps(_mm512_mul_ps(c.omb2, gi), gi, _mm512_mul_ps(vi, c.b2));
}

template <DType G, int O, bool SmallWeight, int Sq, class M>
MLP_TARGET_AVX512 inline void body16(const AdamScalars& s, const Consts16& c, float* p, M* m, M* v,
                                     const void* g, void* out, bool stream) {
    const __m512 gi = scaled_grad16(s, c, load16(g, G));
    __m512 pi = _mm512_loadu_ps(p);
    if (s.apply_decay) pi = _mm512_mul_ps(pi, c.decay);
    __m512 mi = load_moment16(m, c.m_scale);
    __m512 vi = load_moment16(v, c.v_scale);
    new_moments16<SmallWeight>(c, gi, mi, vi);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(sqrt16(static_cast<SqrtMode>(Sq), vi), c.bc2), c.eps);
    pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(c.nss, mi), denom));
    _mm512_storeu_ps(p, pi);
    store_moment16(m, mi, c.m_rscale);
    store_moment16(v, vi, c.v_rscale);
    if constexpr (O >= 0) store16(out, static_cast<DType>(O), pi, stream);
}

// Running absmax of new moments: max of |x| over the non-NaN lanes; NaN lanes noted apart.
struct Absmax16 {
    __m512 m, v;
    __mmask16 nan_m, nan_v;
};

template <DType G, bool SmallWeight>
MLP_TARGET_AVX512 inline void absmax_body16(const AdamScalars& s, const Consts16& c, const Half* m, const Half* v,
                                            const void* g, Absmax16& a) {
    const __m512 gi = scaled_grad16(s, c, load16(g, G));
    __m512 mi = load_moment16(m, c.m_scale);
    __m512 vi = load_moment16(v, c.v_scale);
    new_moments16<SmallWeight>(c, gi, mi, vi);
    a.nan_m = static_cast<__mmask16>(a.nan_m | _mm512_cmp_ps_mask(mi, mi, _CMP_UNORD_Q));
    a.nan_v = static_cast<__mmask16>(a.nan_v | _mm512_cmp_ps_mask(vi, vi, _CMP_UNORD_Q));
    a.m = _mm512_max_ps(_mm512_abs_ps(mi), a.m);  // a NaN lane keeps a.m (vmaxps returns its second operand)
    a.v = _mm512_max_ps(_mm512_abs_ps(vi), a.v);
}

template <DType G, bool SmallWeight>
struct AbsmaxLoop16 {
    MLP_TARGET_AVX512 static void run(const AdamScalars& s, const Consts16& c, const Half* m, const Half* v,
                                      const void* g, std::size_t n, float* absmax);
};

template <DType G, bool SmallWeight>
MLP_TARGET_AVX512 void AbsmaxLoop16<G, SmallWeight>::run(const AdamScalars& s, const Consts16& c, const Half* m,
                                                         const Half* v, const void* g, std::size_t n,
                                                         float* absmax) {
    constexpr std::size_t gb = G == DType::kFloat32 ? 4 : 2;
    Absmax16 a{_mm512_setzero_ps(), _mm512_setzero_ps(), 0, 0};
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) absmax_body16<G, SmallWeight>(s, c, m + i, v + i, static_cast<const char*>(g) + i * gb, a);
    if (i < n) {  // zero-padded lanes: zero moments and gradient give zero new moments
        alignas(64) Half tm[16] = {}, tv[16] = {};
        alignas(64) unsigned char tg[64] = {};
        std::memcpy(tm, m + i, (n - i) * 2);
        std::memcpy(tv, v + i, (n - i) * 2);
        std::memcpy(tg, static_cast<const char*>(g) + i * gb, (n - i) * gb);
        absmax_body16<G, SmallWeight>(s, c, tm, tv, tg, a);
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    absmax[0] = a.nan_m ? nan : _mm512_reduce_max_ps(a.m);
    absmax[1] = a.nan_v ? nan : _mm512_reduce_max_ps(a.v);
}

struct StatsAcc16 {
    __m512d acc0, acc1;
    __mmask16 bad;
};

MLP_TARGET_AVX512 inline void stats_one16(StatsAcc16& a, __m512 x) {
    const __m512i expmask = _mm512_set1_epi32(0x7f800000);
    const __m512i e = _mm512_and_si512(_mm512_castps_si512(x), expmask);
    a.bad = static_cast<__mmask16>(a.bad | _mm512_cmpeq_epi32_mask(e, expmask));
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    a.acc0 = _mm512_fmadd_pd(lo, lo, a.acc0);  // the product of two widened floats is exact
    a.acc1 = _mm512_fmadd_pd(hi, hi, a.acc1);
}

template <DType G, int O, bool SmallWeight, int Sq>
struct Loop16 {
    template <class M>
    MLP_TARGET_AVX512 static void run(const AdamScalars& s, const Consts16& c, float* p, M* m, M* v,
                                      const void* g, void* out, std::size_t n) {
        constexpr std::size_t gb = G == DType::kFloat32 ? 4 : 2;
        constexpr std::size_t ob = O == static_cast<int>(DType::kFloat32) ? 4 : 2;
        // Every full-vector store lands on a multiple of its width when `out` is 64-byte aligned.
        const bool stream = O >= 0 && (reinterpret_cast<std::uintptr_t>(out) & 63u) == 0;
        std::size_t i = 0;
        for (; i + 16 <= n; i += 16) {
            body16<G, O, SmallWeight, Sq>(s, c, p + i, m + i, v + i, static_cast<const char*>(g) + i * gb,
                                            O >= 0 ? static_cast<char*>(out) + i * ob : nullptr, stream);
        }
        if (stream) _mm_sfence();  // order the streamed stores before the caller reads `out`
        if (i < n) {
            const std::size_t r = n - i;
            alignas(64) float tp[16] = {};
            alignas(64) M tm[16] = {}, tv[16] = {};
            alignas(64) unsigned char tg[64] = {}, to[64] = {};
            std::memcpy(tp, p + i, r * 4);
            std::memcpy(tm, m + i, r * sizeof(M));
            std::memcpy(tv, v + i, r * sizeof(M));
            std::memcpy(tg, static_cast<const char*>(g) + i * gb, r * gb);
            body16<G, O, SmallWeight, Sq>(s, c, tp, tm, tv, tg, to, false);
            std::memcpy(p + i, tp, r * 4);
            std::memcpy(m + i, tm, r * sizeof(M));
            std::memcpy(v + i, tv, r * sizeof(M));
            if constexpr (O >= 0) std::memcpy(static_cast<char*>(out) + i * ob, to, r * ob);
        }
    }
};

}  // namespace

namespace {
MLP_TARGET_AVX512 Consts16 make_consts16(const AdamScalars& s) {
    Consts16 c;
    c.inv = _mm512_set1_ps(s.inv_loss_scale);
    c.clip = _mm512_set1_ps(s.clip_coef);
    c.decay = _mm512_set1_ps(s.decay);
    c.w = _mm512_set1_ps(s.lerp_weight);
    c.wm1 = _mm512_set1_ps(s.lerp_weight - 1.0f);
    c.b2 = _mm512_set1_ps(s.beta2);
    c.omb2 = _mm512_set1_ps(s.one_minus_beta2);
    c.bc2 = _mm512_set1_ps(s.bc2_sqrt);
    c.eps = _mm512_set1_ps(s.eps);
    c.nss = _mm512_set1_ps(s.neg_step_size);
    c.m_scale = _mm512_set1_ps(s.m_scale);
    c.v_scale = _mm512_set1_ps(s.v_scale);
    c.m_rscale = _mm512_set1_ps(s.m_rscale);
    c.v_rscale = _mm512_set1_ps(s.v_rscale);
    return c;
}
}  // namespace

MLP_TARGET_AVX512 void adam_avx512(const AdamScalars& s, float* p, float* m, float* v, const void* g, DType gdt,
                                   void* out, DType odt, std::size_t n) {
    adam_dispatch<Loop16>(s, make_consts16(s), p, m, v, g, gdt, out, odt, n);
}

MLP_TARGET_AVX512 void adam_avx512_m16(const AdamScalars& s, float* p, std::uint16_t* m, std::uint16_t* v,
                                       const void* g, DType gdt, void* out, DType odt, std::size_t n) {
    adam_dispatch<Loop16>(s, make_consts16(s), p, m, v, g, gdt, out, odt, n);
}

MLP_TARGET_AVX512 void adam_avx512_mh(const AdamScalars& s, float* p, Half* m, Half* v, const void* g, DType gdt,
                                      void* out, DType odt, std::size_t n) {
    adam_dispatch<Loop16>(s, make_consts16(s), p, m, v, g, gdt, out, odt, n);
}

MLP_TARGET_AVX512 void absmax_avx512_mh(const AdamScalars& s, const Half* m, const Half* v, const void* g, DType gdt,
                                        std::size_t n, float* absmax) {
    absmax_dispatch<AbsmaxLoop16>(s, make_consts16(s), m, v, g, gdt, n, absmax);
}

MLP_TARGET_AVX512 void stats_avx512(const void* g, DType dt, std::size_t n, GradStats* out) {
    StatsAcc16 a{_mm512_setzero_pd(), _mm512_setzero_pd(), 0};
    const std::size_t gb = dtype_bytes(dt);
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) stats_one16(a, load16(static_cast<const char*>(g) + i * gb, dt));
    if (i < n) {
        alignas(64) unsigned char tg[64] = {};
        std::memcpy(tg, static_cast<const char*>(g) + i * gb, (n - i) * gb);
        stats_one16(a, load16(tg, dt));
    }
    alignas(64) double parts[8];
    _mm512_store_pd(parts, _mm512_add_pd(a.acc0, a.acc1));
    out->sum_of_squares = ((parts[0] + parts[1]) + (parts[2] + parts[3])) + ((parts[4] + parts[5]) + (parts[6] + parts[7]));
    out->found_nonfinite = a.bad != 0;
}

MLP_TARGET_AVX512 void sqrt_avx512(SqrtMode mode, const float* in, float* out, std::size_t n) {
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, sqrt16(mode, _mm512_loadu_ps(in + i)));
    if (i < n) {
        alignas(64) float t[16] = {};
        std::memcpy(t, in + i, (n - i) * 4);
        _mm512_store_ps(t, sqrt16(mode, _mm512_load_ps(t)));
        std::memcpy(out + i, t, (n - i) * 4);
    }
}

MLP_TARGET_AVX512 float sqrt_rsqrt14_fma_1(float x) {
    return _mm_cvtss_f32(_mm512_castps512_ps128(sqrt16_rsqrt14_fma(_mm512_set1_ps(x))));
}

MLP_TARGET_AVX512 void sqrt_rsqrt14_fma_8(const float* in, float* out) {
    const __m512 r = sqrt16_rsqrt14_fma(_mm512_castps256_ps512(_mm256_loadu_ps(in)));
    _mm256_storeu_ps(out, _mm512_castps512_ps256(r));
}

}  // namespace detail
}  // namespace mlp

#else

namespace mlp {
namespace detail {
void adam_avx512(const AdamScalars& s, float* p, float* m, float* v, const void* g, DType gdt, void* out,
                 DType odt, std::size_t n) {
    adam_scalar(s, p, m, v, g, gdt, out, odt, n);
}
void adam_avx512_m16(const AdamScalars& s, float* p, std::uint16_t* m, std::uint16_t* v, const void* g, DType gdt,
                     void* out, DType odt, std::size_t n) {
    adam_scalar_m16(s, p, m, v, g, gdt, out, odt, n);
}
void adam_avx512_mh(const AdamScalars& s, float* p, Half* m, Half* v, const void* g, DType gdt, void* out, DType odt,
                    std::size_t n) {
    adam_scalar_mh(s, p, m, v, g, gdt, out, odt, n);
}
void absmax_avx512_mh(const AdamScalars& s, const Half* m, const Half* v, const void* g, DType gdt, std::size_t n,
                      float* absmax) {
    absmax_scalar_mh(s, m, v, g, gdt, n, absmax);
}
void stats_avx512(const void* g, DType dt, std::size_t n, GradStats* out) { stats_scalar(g, dt, n, out); }
void sqrt_avx512(SqrtMode mode, const float* in, float* out, std::size_t n) { sqrt_scalar(mode, in, out, n); }
float sqrt_rsqrt14_fma_1(float x) { return x; }  // never called: the mode is unsupported here
void sqrt_rsqrt14_fma_8(const float* in, float* out) { for (int i = 0; i < 8; ++i) out[i] = in[i]; }
}  // namespace detail
}  // namespace mlp
#endif
