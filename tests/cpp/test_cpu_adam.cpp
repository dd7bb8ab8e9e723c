// Plain C++ checks of the fused Adam kernel, gradient statistics and crc32c (no Python, no
// framework): every SIMD path agrees bit for bit with the scalar path, conversions round as
// specified, the pool covers every element once, and crc32c matches published vectors.
// Returns non-zero on the first failure. Built by tests/cpp/run_sanitizers.sh under ASan/UBSan.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "mlp/checksum.h"
#include "mlp/cpu_adam.h"

namespace {

int g_failures = 0;

#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond)) {                                                \
            std::fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            std::fprintf(stderr, __VA_ARGS__);                        \
            std::fprintf(stderr, "\n");                               \
            ++g_failures;                                             \
        }                                                             \
    } while (0)

float from_bits(std::uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

struct State {
    std::vector<float> p, m, v;
    std::vector<unsigned char> grad, out;
};

State make_state(std::size_t n, mlp::DType gdt, mlp::DType odt, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    State s;
    s.p.resize(n);
    s.m.assign(n, 0.0f);
    s.v.assign(n, 0.0f);
    for (auto& x : s.p) x = nd(rng);
    s.grad.resize(n * mlp::dtype_bytes(gdt) + 1);  // +1: a guard byte that must stay untouched
    s.out.assign(n * mlp::dtype_bytes(odt) + 1, 0xAB);
    for (std::size_t i = 0; i < n; ++i) {
        float g = nd(rng) * 0.01f;
        if (i % 17 == 0) g = 0.0f;
        if (gdt == mlp::DType::kFloat32) {
            std::memcpy(&s.grad[i * 4], &g, 4);
        } else {
            const std::uint16_t h = gdt == mlp::DType::kBFloat16 ? mlp::detail::f32_to_bf16(g) : mlp::detail::f32_to_f16(g);
            std::memcpy(&s.grad[i * 2], &h, 2);
        }
    }
    s.grad.back() = 0xCD;
    return s;
}

void test_simd_paths_match_scalar() {
    const mlp::DType dts[] = {mlp::DType::kFloat32, mlp::DType::kBFloat16, mlp::DType::kFloat16};
    const std::size_t sizes[] = {1, 7, 15, 16, 17, 31, 33, 1000, 4099};
    for (mlp::SqrtMode mode : {mlp::SqrtMode::kIeee, mlp::SqrtMode::kRsqrtNewton, mlp::SqrtMode::kRsqrtNewtonFma,
                               mlp::SqrtMode::kRsqrt14Fma}) {
        if (!mlp::sqrt_mode_supported(mode)) {
            std::printf("skip: this CPU cannot compute sqrt mode %s\n", mlp::sqrt_mode_name(mode));
            continue;
        }
        for (mlp::Isa isa : {mlp::Isa::kAvx2, mlp::Isa::kAvx512}) {
            if (!mlp::isa_supported(isa)) {
                std::printf("skip: this CPU cannot run the %s path\n", mlp::isa_name(isa));
                continue;
            }
            for (mlp::DType gdt : dts) {
                for (mlp::DType odt : dts) {
                    for (std::size_t n : sizes) {
                        State a = make_state(n, gdt, odt, static_cast<unsigned>(n));
                        State b = a;
                        mlp::AdamHyper h;
                        h.weight_decay = 0.1;
                        h.inv_loss_scale = 1.0 / 1024;
                        h.clip_coef = 0.7;
                        for (int step = 1; step <= 5; ++step) {
                            h.step = step;
                            mlp::AdamScalars s;
                            CHECK(mlp::make_adam_scalars(h, mode, &s) == 0, "scalars");
                            CHECK(mlp::adam_update_range(mlp::Isa::kScalar, s, a.p.data(), a.m.data(), a.v.data(),
                                                         a.grad.data(), gdt, a.out.data(), odt, n) == 0, "scalar");
                            CHECK(mlp::adam_update_range(isa, s, b.p.data(), b.m.data(), b.v.data(), b.grad.data(),
                                                         gdt, b.out.data(), odt, n) == 0, "simd");
                        }
                        CHECK(std::memcmp(a.p.data(), b.p.data(), n * 4) == 0, "%s param differs (n=%zu, %s)",
                              mlp::isa_name(isa), n, mlp::dtype_name(gdt));
                        CHECK(std::memcmp(a.m.data(), b.m.data(), n * 4) == 0, "%s exp_avg differs", mlp::isa_name(isa));
                        CHECK(std::memcmp(a.v.data(), b.v.data(), n * 4) == 0, "%s exp_avg_sq differs", mlp::isa_name(isa));
                        CHECK(a.out == b.out, "%s out differs (n=%zu, out %s)", mlp::isa_name(isa), n, mlp::dtype_name(odt));
                        CHECK(b.out.back() == 0xAB, "%s wrote past the output buffer", mlp::isa_name(isa));
                    }
                }
            }
        }
    }
}

void test_conversions() {
    // bf16: ties to even, NaN stays quiet NaN with its sign, subnormals are rounded, not flushed.
    CHECK(mlp::detail::f32_to_bf16(from_bits(0x3f808000u)) == 0x3f80, "tie to even (down)");
    CHECK(mlp::detail::f32_to_bf16(from_bits(0x3f818000u)) == 0x3f82, "tie to even (up)");
    CHECK(mlp::detail::f32_to_bf16(from_bits(0x3f808001u)) == 0x3f81, "above tie");
    CHECK(mlp::detail::f32_to_bf16(from_bits(0x00018000u)) == 0x0002, "subnormal tie");
    CHECK(mlp::detail::f32_to_bf16(from_bits(0x7f7fffffu)) == 0x7f80, "max float rounds to inf");
    CHECK(mlp::detail::f32_to_bf16(from_bits(0xff800001u)) == 0xffc0, "signalling NaN becomes quiet");
    // fp16
    CHECK(mlp::detail::f32_to_f16(65504.0f) == 0x7bff, "fp16 max");
    CHECK(mlp::detail::f32_to_f16(65520.0f) == 0x7c00, "fp16 overflow tie to inf");
    CHECK(mlp::detail::f32_to_f16(65519.996f) == 0x7bff, "fp16 below overflow tie");
    CHECK(mlp::detail::f32_to_f16(5.9604645e-08f) == 0x0001, "fp16 smallest subnormal");
    CHECK(mlp::detail::f32_to_f16(2.9802322e-08f) == 0x0000, "fp16 half of smallest subnormal ties to 0");
    CHECK(mlp::detail::f32_to_f16(8.940697e-08f) == 0x0002, "fp16 1.5 subnormal ties to even 2");
    CHECK(mlp::detail::f32_to_f16(-1.0f) == 0xbc00, "fp16 -1");
    CHECK(std::isnan(mlp::detail::f16_to_f32(0x7e00)), "fp16 NaN");
    // Round trip of every half value.
    for (std::uint32_t h = 0; h < 0x10000; ++h) {
        const float f = mlp::detail::f16_to_f32(static_cast<std::uint16_t>(h));
        if (std::isnan(f)) continue;
        CHECK(mlp::detail::f32_to_f16(f) == h, "fp16 round trip of 0x%04x", h);
        if (g_failures > 20) return;
    }
}

void test_pool_covers_every_element_once() {
    mlp::CpuAdam adam(3);
    CHECK(adam.num_threads() == 3, "threads");
    const std::size_t n = 3 * mlp::kMinElemsPerThread + 123;
    std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f);
    std::vector<std::uint16_t> g(n, mlp::detail::f32_to_bf16(1.0f)), out(n + 1, 0xBEEF);
    mlp::AdamHyper h;
    CHECK(adam.step(h, p.data(), m.data(), v.data(), g.data(), mlp::DType::kBFloat16, out.data(),
                    mlp::DType::kBFloat16, n) == 0, "step");
    // First step of Adam on g = 1: m_hat / sqrt(v_hat) = 1, so p = 1 - lr (up to eps).
    for (std::size_t i = 0; i < n; ++i) {
        if (std::fabs(p[i] - (1.0f - 1e-3f)) > 1e-6f || m[i] == 0.0f) {
            CHECK(false, "element %zu not updated exactly once (p=%g)", i, p[i]);
            break;
        }
    }
    CHECK(out[n] == 0xBEEF, "pool wrote past the output");
    mlp::GradStats st;
    CHECK(adam.grad_stats(g.data(), mlp::DType::kBFloat16, n, &st) == 0, "stats");
    CHECK(st.sum_of_squares == static_cast<double>(n) && !st.found_nonfinite, "sumsq %f", st.sum_of_squares);
    // Many back-to-back runs with varying widths: workers must neither miss nor repeat a round.
    for (int round = 0; round < 200; ++round) {
        mlp::GradStats r;
        adam.grad_stats(g.data(), mlp::DType::kBFloat16, n, &r, 1 + round % 3);
        if (r.sum_of_squares != static_cast<double>(n)) {
            CHECK(false, "round %d: sumsq %f", round, r.sum_of_squares);
            break;
        }
    }
    CHECK(adam.step(h, p.data(), m.data(), v.data(), g.data(), static_cast<mlp::DType>(7), nullptr,
                    mlp::DType::kFloat32, n) == -EINVAL, "bad dtype must be -EINVAL");
    h.step = 0;
    CHECK(adam.step(h, p.data(), m.data(), v.data(), g.data(), mlp::DType::kBFloat16, nullptr,
                    mlp::DType::kFloat32, n) == -EINVAL, "step 0 must be -EINVAL");
}

void test_crc32c() {
    const char* s = "123456789";
    for (auto impl : {mlp::Crc32cImpl::kSoftware, mlp::Crc32cImpl::kSse42, mlp::Crc32cImpl::kAuto}) {
        CHECK(mlp::crc32c(s, 9, 0, impl) == 0xE3069283u, "crc32c(123456789) = %08x", mlp::crc32c(s, 9, 0, impl));
        CHECK(mlp::crc32c(s, 0, 0, impl) == 0u, "empty");
        std::vector<unsigned char> zeros(32, 0), ones(32, 0xff), inc(32);
        for (int i = 0; i < 32; ++i) inc[i] = static_cast<unsigned char>(i);
        CHECK(mlp::crc32c(zeros.data(), 32, 0, impl) == 0x8A9136AAu, "32 zeros (RFC 3720)");
        CHECK(mlp::crc32c(ones.data(), 32, 0, impl) == 0x62A8AB43u, "32 0xff (RFC 3720)");
        CHECK(mlp::crc32c(inc.data(), 32, 0, impl) == 0x46DD794Eu, "0..31 (RFC 3720)");
    }
    // Long, unaligned buffers exercise the 3-way interleave; chaining with a seed must agree.
    std::vector<unsigned char> buf(3 * 8192 * 2 + 3 * 256 + 77);
    std::mt19937 rng(5);
    for (auto& c : buf) c = static_cast<unsigned char>(rng());
    for (std::size_t off : {0u, 1u, 3u, 7u}) {
        const std::size_t n = buf.size() - off;
        const std::uint32_t sw = mlp::crc32c(buf.data() + off, n, 0, mlp::Crc32cImpl::kSoftware);
        const std::uint32_t hw = mlp::crc32c(buf.data() + off, n, 0, mlp::Crc32cImpl::kAuto);
        CHECK(sw == hw, "software %08x vs auto %08x at offset %zu", sw, hw, off);
        const std::uint32_t first = mlp::crc32c(buf.data() + off, 1000, 0);
        CHECK(mlp::crc32c(buf.data() + off + 1000, n - 1000, first) == hw, "chaining with seed");
        const std::uint32_t rest = mlp::crc32c(buf.data() + off + 1000, n - 1000, 0);
        CHECK(mlp::crc32c_combine(first, rest, n - 1000) == hw, "combine of two pieces");
    }
}

// step() checksums each thread's tiles before (in_crcs) and after (crcs) updating them and joins
// the pieces: both must equal crc32c of the whole arrays, whatever the split over threads.
void test_step_checksums_before_and_after() {
    mlp::CpuAdam adam(3);
    const std::size_t n = 3 * mlp::kMinElemsPerThread + mlp::kCrcTileElems / 2 + 7;
    State s = make_state(n, mlp::DType::kBFloat16, mlp::DType::kBFloat16, 11);
    for (std::size_t i = 0; i < n; ++i) s.m[i] = 0.001f * static_cast<float>(i % 97);
    const std::uint32_t want_before[3] = {mlp::crc32c(s.p.data(), n * 4), mlp::crc32c(s.m.data(), n * 4),
                                          mlp::crc32c(s.v.data(), n * 4)};
    mlp::AdamHyper h;
    for (int threads : {1, 2, 3}) {
        State t = s;
        std::uint32_t before[3] = {1, 1, 1}, after[3] = {1, 1, 1};
        CHECK(adam.step(h, t.p.data(), t.m.data(), t.v.data(), t.grad.data(), mlp::DType::kBFloat16, nullptr,
                        mlp::DType::kBFloat16, n, threads, after, before) == 0, "step");
        const float* arrays[3] = {t.p.data(), t.m.data(), t.v.data()};
        for (int a = 0; a < 3; ++a) {
            CHECK(before[a] == want_before[a], "threads %d array %d: before %08x != %08x", threads, a, before[a],
                  want_before[a]);
            CHECK(after[a] == mlp::crc32c(arrays[a], n * 4), "threads %d array %d: after", threads, a);
        }
        std::uint32_t only_before[3] = {0, 0, 0};
        State u = s;
        CHECK(adam.step(h, u.p.data(), u.m.data(), u.v.data(), u.grad.data(), mlp::DType::kBFloat16, nullptr,
                        mlp::DType::kBFloat16, n, threads, nullptr, only_before) == 0, "step");
        CHECK(std::memcmp(only_before, want_before, sizeof want_before) == 0, "threads %d: before only", threads);
        CHECK(u.p == t.p && u.m == t.m && u.v == t.v, "threads %d: checksums changed the update", threads);
    }
}

// adam_update_range_checksummed (the AVX2 path with VPCLMULQDQ) folds the state it loads and
// stores: every length from empty to several vectors, at every misalignment of the arrays, gives
// crc32c of the arrays before and after and the update of adam_update_range; elsewhere -ENOTSUP.
void test_checksummed_range() {
    mlp::AdamHyper h;
    h.weight_decay = 0.1;
    h.step = 5;
    mlp::AdamScalars sc;
    CHECK(mlp::make_adam_scalars(h, mlp::SqrtMode::kIeee, &sc) == 0, "scalars");
    std::uint32_t in[3], out[3];
    CHECK(mlp::adam_update_range_checksummed(mlp::Isa::kScalar, sc, nullptr, nullptr, nullptr, nullptr,
                                             mlp::DType::kBFloat16, nullptr, mlp::DType::kBFloat16, 0, in,
                                             out) == -ENOTSUP, "scalar path must refuse");
    if (!mlp::checksummed_update_supported(mlp::Isa::kAvx2)) {
        std::printf("checksummed range: skipped (no AVX2 with VPCLMULQDQ)\n");
        return;
    }
    for (std::size_t n = 0; n <= 70; ++n) {
        for (std::size_t shift : {0, 1, 3}) {  // element offset into the vectors: unaligned loads
            State a = make_state(n + shift, mlp::DType::kBFloat16, mlp::DType::kBFloat16, static_cast<unsigned>(n));
            for (std::size_t i = 0; i < n + shift; ++i) a.v[i] = 0.01f * static_cast<float>(i % 13);
            State b = a;
            float* arrays[3] = {a.p.data() + shift, a.m.data() + shift, a.v.data() + shift};
            std::uint32_t want_in[3];
            for (int k = 0; k < 3; ++k) want_in[k] = mlp::crc32c(arrays[k], n * 4);
            CHECK(mlp::adam_update_range_checksummed(mlp::Isa::kAvx2, sc, arrays[0], arrays[1], arrays[2],
                                                     a.grad.data() + shift * 2, mlp::DType::kBFloat16,
                                                     a.out.data() + shift * 2, mlp::DType::kBFloat16, n, in,
                                                     out) == 0, "n %zu", n);
            CHECK(mlp::adam_update_range(mlp::Isa::kAvx2, sc, b.p.data() + shift, b.m.data() + shift,
                                         b.v.data() + shift, b.grad.data() + shift * 2, mlp::DType::kBFloat16,
                                         b.out.data() + shift * 2, mlp::DType::kBFloat16, n) == 0, "n %zu", n);
            for (int k = 0; k < 3; ++k) {
                CHECK(in[k] == want_in[k], "n %zu shift %zu array %d: before %08x != %08x", n, shift, k, in[k],
                      want_in[k]);
                CHECK(out[k] == mlp::crc32c(arrays[k], n * 4), "n %zu shift %zu array %d: after", n, shift, k);
            }
            CHECK(a.p == b.p && a.m == b.m && a.v == b.v && a.out == b.out, "n %zu shift %zu: update differs", n,
                  shift);
            // Either checksum alone.
            State c = b, d = b;
            std::uint32_t only[3];
            CHECK(mlp::adam_update_range_checksummed(mlp::Isa::kAvx2, sc, c.p.data() + shift, c.m.data() + shift,
                                                     c.v.data() + shift, c.grad.data() + shift * 2,
                                                     mlp::DType::kBFloat16, nullptr, mlp::DType::kBFloat16, n,
                                                     only, nullptr) == 0, "in only");
            CHECK(only[0] == mlp::crc32c(b.p.data() + shift, n * 4), "n %zu: in only", n);
            CHECK(mlp::adam_update_range_checksummed(mlp::Isa::kAvx2, sc, d.p.data() + shift, d.m.data() + shift,
                                                     d.v.data() + shift, d.grad.data() + shift * 2,
                                                     mlp::DType::kBFloat16, nullptr, mlp::DType::kBFloat16, n,
                                                     nullptr, only) == 0, "out only");
            CHECK(only[2] == mlp::crc32c(d.v.data() + shift, n * 4), "n %zu: out only", n);
        }
    }
}

}  // namespace

// The bound of bench adam: the step's loads and stores with no arithmetic. Every length (the
// vector body and the tail), every dtype pair, several threads: p, m, v keep their bits, `out`
// is written up to n and not past it.
void test_traffic_moves_the_bytes_and_changes_nothing() {
    mlp::CpuAdam adam(3);
    const mlp::DType dts[] = {mlp::DType::kFloat32, mlp::DType::kBFloat16, mlp::DType::kFloat16};
    for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{9},
                          3 * mlp::kMinElemsPerThread + 13}) {
        for (mlp::DType gdt : dts) {
            for (mlp::DType odt : dts) {
                std::vector<float> p(n), m(n), v(n);
                for (std::size_t i = 0; i < n; ++i) p[i] = 0.5f * i, m[i] = -1.0f * i, v[i] = 2.0f + i;
                const std::vector<float> p0 = p, m0 = m, v0 = v;
                std::vector<float> g(n, 3.0f);                   // 4 bytes per element covers every dtype
                std::vector<unsigned char> out(4 * n + 16, 0xAB);
                CHECK(adam.traffic(p.data(), m.data(), v.data(), g.data(), gdt, out.data(), odt, n) == 0, "traffic");
                CHECK(p == p0 && m == m0 && v == v0, "traffic changed the state (n=%zu)", n);
                const std::size_t ob = odt == mlp::DType::kFloat32 ? 4 : 2;
                CHECK(out[n * ob] == 0xAB, "traffic wrote past the output (n=%zu)", n);
            }
        }
    }
    CHECK(adam.traffic(nullptr, nullptr, nullptr, nullptr, mlp::DType::kFloat32, nullptr, mlp::DType::kFloat32, 4)
              == -EINVAL, "null arrays refused");
}

// bf16 moments (Megatron's --exp-avg-dtype bf16): every SIMD path equals the scalar path bit for
// bit, writes no moment element past n, and step() checksums the 2-byte moment arrays.
void test_bf16_moments_match_scalar() {
    const std::size_t sizes[] = {1, 7, 15, 16, 17, 33, 4099};
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (mlp::Isa isa : {mlp::Isa::kAvx2, mlp::Isa::kAvx512}) {
        if (!mlp::isa_supported(isa)) continue;
        for (std::size_t n : sizes) {
            std::vector<float> pa(n), pb;
            std::vector<std::uint16_t> ma(n + 1, 0), va(n + 1, 0), mb, vb;
            std::vector<std::uint16_t> grad(n);
            for (std::size_t i = 0; i < n; ++i) {
                pa[i] = nd(rng);
                grad[i] = mlp::detail::f32_to_bf16(nd(rng) * 1e-2f);
            }
            ma[n] = va[n] = 0xBEEF;   // sentinels past the end
            pb = pa;
            mb = ma;
            vb = va;
            mlp::AdamHyper h;
            h.weight_decay = 0.1;
            h.clip_coef = 0.7;
            for (int step = 1; step <= 5; ++step) {
                h.step = step;
                mlp::AdamScalars s;
                CHECK(mlp::make_adam_scalars(h, mlp::SqrtMode::kIeee, &s) == 0, "scalars");
                CHECK(mlp::adam_update_range(mlp::Isa::kScalar, s, pa.data(), ma.data(), va.data(), grad.data(),
                                             mlp::DType::kBFloat16, nullptr, mlp::DType::kFloat32, n,
                                             mlp::DType::kBFloat16) == 0, "scalar bf16 moments");
                CHECK(mlp::adam_update_range(isa, s, pb.data(), mb.data(), vb.data(), grad.data(),
                                             mlp::DType::kBFloat16, nullptr, mlp::DType::kFloat32, n,
                                             mlp::DType::kBFloat16) == 0, "simd bf16 moments");
            }
            CHECK(pa == pb, "%s param differs with bf16 moments (n=%zu)", mlp::isa_name(isa), n);
            CHECK(ma == mb && va == vb, "%s bf16 moments differ (n=%zu)", mlp::isa_name(isa), n);
            CHECK(mb[n] == 0xBEEF && vb[n] == 0xBEEF, "%s wrote past the bf16 moments", mlp::isa_name(isa));
        }
    }
    mlp::AdamScalars s;
    mlp::AdamHyper h;
    CHECK(mlp::make_adam_scalars(h, mlp::SqrtMode::kIeee, &s) == 0, "scalars");
    float p = 0.f, m = 0.f, v = 0.f, g = 0.f;
    CHECK(mlp::adam_update_range(mlp::Isa::kScalar, s, &p, &m, &v, &g, mlp::DType::kFloat32, nullptr,
                                 mlp::DType::kFloat32, 1, static_cast<mlp::DType>(7)) == -EINVAL,
          "unknown moment dtype refused");
    // step(): the CRCs of the bf16 arrays are of their 2-byte elements, over the pool's pieces.
    const std::size_t n = 200003;
    std::vector<float> param(n);
    std::vector<std::uint16_t> m16(n), v16(n), grad(n);
    for (std::size_t i = 0; i < n; ++i) {
        param[i] = nd(rng);
        m16[i] = mlp::detail::f32_to_bf16(nd(rng) * 1e-3f);
        v16[i] = mlp::detail::f32_to_bf16(std::fabs(nd(rng)) * 1e-6f);
        grad[i] = mlp::detail::f32_to_bf16(nd(rng) * 1e-2f);
    }
    const std::uint32_t before[3] = {mlp::crc32c(param.data(), n * 4), mlp::crc32c(m16.data(), n * 2),
                                     mlp::crc32c(v16.data(), n * 2)};
    mlp::CpuAdam adam(2);
    h.step = 3;
    std::uint32_t in_crcs[3], out_crcs[3];
    CHECK(adam.step(h, param.data(), m16.data(), v16.data(), grad.data(), mlp::DType::kBFloat16, nullptr,
                    mlp::DType::kFloat32, n, 0, out_crcs, in_crcs, mlp::DType::kBFloat16) == 0, "step bf16 moments");
    for (int a = 0; a < 3; ++a) CHECK(in_crcs[a] == before[a], "bf16 step: crc before, array %d", a);
    CHECK(out_crcs[0] == mlp::crc32c(param.data(), n * 4), "bf16 step: param crc after");
    CHECK(out_crcs[1] == mlp::crc32c(m16.data(), n * 2), "bf16 step: exp_avg crc after");
    CHECK(out_crcs[2] == mlp::crc32c(v16.data(), n * 2), "bf16 step: exp_avg_sq crc after");
}

// fp16 moments scaled per tensor (--exp-avg-dtype fp16): every SIMD path equals the scalar path
// bit for bit in the absmax pass and the update, with the scales the absmax gives, and writes no
// moment element past n.
void test_fp16_scaled_moments_match_scalar() {
    const std::size_t sizes[] = {1, 7, 15, 16, 17, 33, 4099};
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.f, 1.f);
    const float range = 65504.f / 2.f;
    for (mlp::Isa isa : {mlp::Isa::kAvx2, mlp::Isa::kAvx512}) {
        if (!mlp::isa_supported(isa)) continue;
        for (std::size_t n : sizes) {
            std::vector<float> pa(n), pb;
            std::vector<std::uint16_t> ma(n + 1, 0), va(n + 1, 0), mb, vb, grad(n);
            for (std::size_t i = 0; i < n; ++i) {
                pa[i] = nd(rng);
                grad[i] = mlp::detail::f32_to_bf16(nd(rng) * 1e-2f);
            }
            ma[n] = va[n] = 0xBEEF;   // sentinels past the end
            pb = pa;
            mb = ma;
            vb = va;
            float scale_a[2] = {1.f, 1.f}, scale_b[2] = {1.f, 1.f};
            mlp::AdamHyper h;
            h.weight_decay = 0.1;
            h.inv_loss_scale = 0.5;
            for (int step = 1; step <= 5; ++step) {
                h.step = step;
                for (int path = 0; path < 2; ++path) {
                    const mlp::Isa use = path == 0 ? mlp::Isa::kScalar : isa;
                    float* scale = path == 0 ? scale_a : scale_b;
                    auto* mm = reinterpret_cast<const std::uint16_t*>(path == 0 ? ma.data() : mb.data());
                    auto* vv = reinterpret_cast<const std::uint16_t*>(path == 0 ? va.data() : vb.data());
                    mlp::AdamScalars s;
                    CHECK(mlp::make_adam_scalars(h, mlp::SqrtMode::kIeee, &s) == 0, "scalars");
                    s.m_scale = scale[0];
                    s.v_scale = scale[1];
                    float absmax[2];
                    CHECK(mlp::moments_absmax_range(use, s, mm, vv, grad.data(), mlp::DType::kBFloat16, n, absmax) == 0,
                          "absmax");
                    for (int k = 0; k < 2; ++k) {
                        scale[k] = absmax[k] / range;
                        const float r = scale[k] > 0.f ? 1.f / scale[k] : 0.f;
                        (k == 0 ? s.m_rscale : s.v_rscale) = r;
                    }
                    CHECK(mlp::adam_update_range(use, s, path == 0 ? pa.data() : pb.data(),
                                                 path == 0 ? ma.data() : mb.data(), path == 0 ? va.data() : vb.data(),
                                                 grad.data(), mlp::DType::kBFloat16, nullptr, mlp::DType::kFloat32, n,
                                                 mlp::DType::kFloat16) == 0, "fp16 moments update");
                }
                CHECK(scale_a[0] == scale_b[0] && scale_a[1] == scale_b[1], "%s fp16 scales differ (n=%zu, step %d)",
                      mlp::isa_name(isa), n, step);
            }
            CHECK(pa == pb, "%s param differs with fp16 moments (n=%zu)", mlp::isa_name(isa), n);
            CHECK(ma == mb && va == vb, "%s fp16 moments differ (n=%zu)", mlp::isa_name(isa), n);
            CHECK(mb[n] == 0xBEEF && vb[n] == 0xBEEF, "%s wrote past the fp16 moments", mlp::isa_name(isa));
            float top = 0.f;
            for (std::size_t i = 0; i < n; ++i) top = std::max(top, std::fabs(mlp::detail::f16_to_f32(vb[i])));
            CHECK(top == range, "%s fp16 exp_avg_sq not scaled to the range: max %g (n=%zu)", mlp::isa_name(isa),
                  top, n);
        }
    }
}

int main() {
    test_traffic_moves_the_bytes_and_changes_nothing();
    test_simd_paths_match_scalar();
    test_bf16_moments_match_scalar();
    test_fp16_scaled_moments_match_scalar();
    test_conversions();
    test_pool_covers_every_element_once();
    test_crc32c();
    test_step_checksums_before_and_after();
    test_checksummed_range();
    if (g_failures) {
        std::fprintf(stderr, "test_cpu_adam: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("test_cpu_adam: ok (best isa %s)\n", mlp::isa_name(mlp::best_isa()));
    return 0;
}
