// Shared by the vector paths of the fused AdamW kernel: turns the run-time choices of one call
// (gradient dtype, output dtype or none, sqrt mode, lerp branch) into the compile-time parameters
// of an ISA's element loop, so that loop has no branch on any of them.
#pragma once

#include <cstddef>

#include "mlp/cpu_adam.h"

namespace mlp {
namespace detail {

// Loop<G, O, SmallWeight, Sq>::run(s, c, p, m, v, g, out, n) is one ISA's element loop: G the
// gradient dtype, O the output dtype as an int (-1: no output), Sq the SqrtMode as an int; Consts
// the ISA's broadcast scalars, passed through untouched. M is the moments' storage type: float
// (fp32 moments) or std::uint16_t (bf16 moments; a Loop's run is then a member template).
// lerp's branch as ATen's is_lerp_weight_small: |w| < 0.5 -> m + w*(g-m), else g + (w-1)*(g-m).
inline bool lerp_weight_small(const AdamScalars& s) { return s.lerp_weight < 0.5f && s.lerp_weight > -0.5f; }

template <template <DType, int, bool, int> class Loop, DType G, int O, class Consts, class M>
void adam_for_sqrt(const AdamScalars& s, const Consts& c, float* p, M* m, M* v, const void* g, void* out,
                   std::size_t n) {
    const bool small = lerp_weight_small(s);
    constexpr int kIeee = static_cast<int>(SqrtMode::kIeee);
    constexpr int kNewton = static_cast<int>(SqrtMode::kRsqrtNewton);
    constexpr int k14 = static_cast<int>(SqrtMode::kRsqrt14Fma);
    constexpr int kNewtonFma = static_cast<int>(SqrtMode::kRsqrtNewtonFma);
    switch (s.sqrt_mode) {
        case SqrtMode::kRsqrtNewton:
            return small ? Loop<G, O, true, kNewton>::run(s, c, p, m, v, g, out, n)
                         : Loop<G, O, false, kNewton>::run(s, c, p, m, v, g, out, n);
        case SqrtMode::kRsqrt14Fma:
            return small ? Loop<G, O, true, k14>::run(s, c, p, m, v, g, out, n)
                         : Loop<G, O, false, k14>::run(s, c, p, m, v, g, out, n);
        case SqrtMode::kRsqrtNewtonFma:
            return small ? Loop<G, O, true, kNewtonFma>::run(s, c, p, m, v, g, out, n)
                         : Loop<G, O, false, kNewtonFma>::run(s, c, p, m, v, g, out, n);
        default:
            return small ? Loop<G, O, true, kIeee>::run(s, c, p, m, v, g, out, n)
                         : Loop<G, O, false, kIeee>::run(s, c, p, m, v, g, out, n);
    }
}

template <template <DType, int, bool, int> class Loop, DType G, class Consts, class M>
void adam_for_output(const AdamScalars& s, const Consts& c, float* p, M* m, M* v, const void* g, void* out,
                     DType odt, std::size_t n) {
    if (!out) return adam_for_sqrt<Loop, G, -1>(s, c, p, m, v, g, out, n);
    switch (odt) {
        case DType::kBFloat16: return adam_for_sqrt<Loop, G, static_cast<int>(DType::kBFloat16)>(s, c, p, m, v, g, out, n);
        case DType::kFloat16: return adam_for_sqrt<Loop, G, static_cast<int>(DType::kFloat16)>(s, c, p, m, v, g, out, n);
        default: return adam_for_sqrt<Loop, G, static_cast<int>(DType::kFloat32)>(s, c, p, m, v, g, out, n);
    }
}

template <template <DType, int, bool, int> class Loop, class Consts, class M>
void adam_dispatch(const AdamScalars& s, const Consts& c, float* p, M* m, M* v, const void* g, DType gdt,
                   void* out, DType odt, std::size_t n) {
    switch (gdt) {
        case DType::kBFloat16: return adam_for_output<Loop, DType::kBFloat16>(s, c, p, m, v, g, out, odt, n);
        case DType::kFloat16: return adam_for_output<Loop, DType::kFloat16>(s, c, p, m, v, g, out, odt, n);
        default: return adam_for_output<Loop, DType::kFloat32>(s, c, p, m, v, g, out, odt, n);
    }
}

// Absmax<G, SmallWeight>::run(s, c, m, v, g, n, absmax) is one ISA's absmax pass over fp16
// moments (moments_absmax_range): the update's moment arithmetic, nothing stored.
template <template <DType, bool> class Absmax, class Consts>
void absmax_dispatch(const AdamScalars& s, const Consts& c, const Half* m, const Half* v, const void* g, DType gdt,
                     std::size_t n, float* absmax) {
    const bool small = lerp_weight_small(s);
    switch (gdt) {
        case DType::kBFloat16:
            return small ? Absmax<DType::kBFloat16, true>::run(s, c, m, v, g, n, absmax)
                         : Absmax<DType::kBFloat16, false>::run(s, c, m, v, g, n, absmax);
        case DType::kFloat16:
            return small ? Absmax<DType::kFloat16, true>::run(s, c, m, v, g, n, absmax)
                         : Absmax<DType::kFloat16, false>::run(s, c, m, v, g, n, absmax);
        default:
            return small ? Absmax<DType::kFloat32, true>::run(s, c, m, v, g, n, absmax)
                         : Absmax<DType::kFloat32, false>::run(s, c, m, v, g, n, absmax);
    }
}

}  // namespace detail
}  // namespace mlp
