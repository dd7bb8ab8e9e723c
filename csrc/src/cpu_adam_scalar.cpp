// Portable reference path of the fused AdamW kernel. Every SIMD path reproduces these
// roundings exactly (see cpu_adam.h for the op sequence and why each op looks the way it does).
//
// Floating-point contraction is off for this file: ATen does not fuse the products we compute as
// separate operations, and the fused ones (lerp, addcmul) are written with explicit fma.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <cmath>
#include <cstring>
#include <limits>

#include "mlp/cpu_adam.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MLP_HAVE_SSE_RSQRT 1
#endif

namespace mlp {
namespace detail {

float f16_to_f32(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1fu;
    const std::uint32_t man = h & 0x3ffu;
    std::uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);  // inf, or a quiet NaN
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {
            float f = static_cast<float>(man) * 0x1p-24f;  // exact: a subnormal half is man * 2^-24
            std::memcpy(&u, &f, 4);
            u |= sign;
        }
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

std::uint16_t f32_to_f16(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    const std::uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x3ffu));  // NaN
    if (u >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (u < 0x38800000u) {  // below 2^-14: a subnormal half (or zero)
        const std::uint32_t e = u >> 23;
        const std::uint32_t shift = 126u - e;
        if (shift > 24u) return static_cast<std::uint16_t>(sign);
        const std::uint32_t m = (u & 0x7fffffu) | 0x800000u;
        std::uint32_t r = m >> shift;
        const std::uint32_t rem = m & ((1u << shift) - 1u);
        const std::uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) ++r;
        return static_cast<std::uint16_t>(sign | r);
    }
    std::uint32_t h = (u >> 13) - (112u << 10);
    const std::uint32_t rem = u & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
}

namespace {

// True where MKL's vsSqrt leaves its fast path: bits outside [0x00800000, 0x7f7ff000]
// (zero, subnormals, negatives, huge values, inf, NaN). Those get the exact sqrt.
inline bool rsqrt_special(float x) {
    std::int32_t b;
    std::memcpy(&b, &x, 4);
    const std::int32_t t = static_cast<std::int32_t>(static_cast<std::uint32_t>(b) + 0x7f800000u);
    return t > static_cast<std::int32_t>(0xfefff000u);
}

inline float kernel_sqrt(SqrtMode mode, float x) {
#ifdef MLP_HAVE_SSE_RSQRT
    if (mode == SqrtMode::kRsqrtNewton && !rsqrt_special(x)) {
        const float y = _mm_cvtss_f32(_mm_rsqrt_ss(_mm_set_ss(x)));
        const float s = x * y;
        const float h = y * 0.5f;
        const float r = 0.5f - s * h;
        const float s1 = s * r + s;
        const float h1 = h * r + h;
        const float d = x - s1 * s1;
        return d * h1 + s1;
    }
    if (mode == SqrtMode::kRsqrt14Fma) return sqrt_rsqrt14_fma_1(x);
    if (mode == SqrtMode::kRsqrtNewtonFma) return sqrt_rsqrt_newton_fma_1(x);
#else
    (void)mode;
#endif
    return std::sqrt(x);
}

inline float load_grad(const void* g, DType dt, std::size_t i) {
    switch (dt) {
        case DType::kBFloat16: return bf16_to_f32(static_cast<const std::uint16_t*>(g)[i]);
        case DType::kFloat16: return f16_to_f32(static_cast<const std::uint16_t*>(g)[i]);
        default: return static_cast<const float*>(g)[i];
    }
}

inline void store_out(void* out, DType dt, std::size_t i, float x) {
    switch (dt) {
        case DType::kBFloat16: static_cast<std::uint16_t*>(out)[i] = f32_to_bf16(x); break;
        case DType::kFloat16: static_cast<std::uint16_t*>(out)[i] = f32_to_f16(x); break;
        default: static_cast<float*>(out)[i] = x; break;
    }
}

}  // namespace

namespace {

// The moments' storage: fp32, bf16 bits, or fp16 bits scaled per tensor (`scale` unscales a loaded
// moment, `rscale` scales one to be stored; both ignored by the other two).
inline float load_moment(const float* a, std::size_t i, float) { return a[i]; }
inline float load_moment(const std::uint16_t* a, std::size_t i, float) { return bf16_to_f32(a[i]); }
inline float load_moment(const Half* a, std::size_t i, float scale) { return f16_to_f32(a[i].bits) * scale; }
inline void store_moment(float* a, std::size_t i, float x, float) { a[i] = x; }
inline void store_moment(std::uint16_t* a, std::size_t i, float x, float) { a[i] = f32_to_bf16(x); }
inline void store_moment(Half* a, std::size_t i, float x, float rscale) { a[i].bits = f32_to_f16(x * rscale); }

// The gradient as the update uses it, and the new moments from it: shared by the update and
// the absmax pass, so the two compute the same bits.
inline float scaled_grad(const AdamScalars& s, const void* g, DType gdt, std::size_t i) {
    float gi = load_grad(g, gdt, i);
    if (s.apply_unscale) gi = gi * s.inv_loss_scale;
    if (s.apply_clip) gi = gi * s.clip_coef;
    return gi;
}

inline void new_moments(const AdamScalars& s, bool small_weight, float gi, float* mi, float* vi) {
    const float diff = gi - *mi;
    *mi = small_weight ? std::fma(s.lerp_weight, diff, *mi) : std::fma(s.lerp_weight - 1.0f, diff, gi);
    const float v = *vi * s.beta2;
    *vi = std::fma(s.one_minus_beta2 * gi, gi, v);
}

// M: the moments' storage. The arithmetic is fp32 either way; 16-bit moments are rounded only
// when stored, after the param has been updated from their fp32 values.
template <class M>
void adam_scalar_impl(const AdamScalars& s, float* p, M* m, M* v, const void* g, DType gdt, void* out, DType odt,
                      std::size_t n) {
    const bool small_weight = std::fabs(s.lerp_weight) < 0.5f;
    for (std::size_t i = 0; i < n; ++i) {
        const float gi = scaled_grad(s, g, gdt, i);
        float pi = p[i];
        if (s.apply_decay) pi = pi * s.decay;
        float mi = load_moment(m, i, s.m_scale);
        float vi = load_moment(v, i, s.v_scale);
        new_moments(s, small_weight, gi, &mi, &vi);
        const float denom = kernel_sqrt(s.sqrt_mode, vi) / s.bc2_sqrt + s.eps;
        pi = pi + (s.neg_step_size * mi) / denom;
        p[i] = pi;
        store_moment(m, i, mi, s.m_rscale);
        store_moment(v, i, vi, s.v_rscale);
        if (out) store_out(out, odt, i, pi);
    }
}

}  // namespace

void adam_scalar(const AdamScalars& s, float* p, float* m, float* v, const void* g, DType gdt, void* out,
                 DType odt, std::size_t n) {
    adam_scalar_impl(s, p, m, v, g, gdt, out, odt, n);
}

void adam_scalar_m16(const AdamScalars& s, float* p, std::uint16_t* m, std::uint16_t* v, const void* g, DType gdt,
                     void* out, DType odt, std::size_t n) {
    adam_scalar_impl(s, p, m, v, g, gdt, out, odt, n);
}

void adam_scalar_mh(const AdamScalars& s, float* p, Half* m, Half* v, const void* g, DType gdt, void* out, DType odt,
                    std::size_t n) {
    adam_scalar_impl(s, p, m, v, g, gdt, out, odt, n);
}

void absmax_scalar_mh(const AdamScalars& s, const Half* m, const Half* v, const void* g, DType gdt, std::size_t n,
                      float* absmax) {
    const bool small_weight = std::fabs(s.lerp_weight) < 0.5f;
    float am = 0.0f, av = 0.0f;
    bool nan_m = false, nan_v = false;
    for (std::size_t i = 0; i < n; ++i) {
        float mi = load_moment(m, i, s.m_scale);
        float vi = load_moment(v, i, s.v_scale);
        new_moments(s, small_weight, scaled_grad(s, g, gdt, i), &mi, &vi);
        nan_m |= std::isnan(mi);
        nan_v |= std::isnan(vi);
        am = std::fmax(am, std::fabs(mi));
        av = std::fmax(av, std::fabs(vi));
    }
    absmax[0] = nan_m ? std::numeric_limits<float>::quiet_NaN() : am;
    absmax[1] = nan_v ? std::numeric_limits<float>::quiet_NaN() : av;
}

void stats_scalar(const void* g, DType dt, std::size_t n, GradStats* out) {
    double acc = 0.0;
    bool nonfinite = false;
    for (std::size_t i = 0; i < n; ++i) {
        const float x = load_grad(g, dt, i);
        nonfinite |= !std::isfinite(x);
        acc += static_cast<double>(x) * static_cast<double>(x);
    }
    out->sum_of_squares = acc;
    out->found_nonfinite = nonfinite;
}

void sqrt_scalar(SqrtMode mode, const float* in, float* out, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) out[i] = kernel_sqrt(mode, in[i]);
}

}  // namespace detail
}  // namespace mlp
