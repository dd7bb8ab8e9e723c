// Dispatch, hyper-parameter preparation, the worker pool and the CpuAdam object.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")  // 1 - lr*wd etc. must round exactly as Python does
#endif
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#include "mlp/cpu_adam.h"
#include "mlp/checksum.h"

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

namespace mlp {

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::kAvx512: return "avx512";
        case Isa::kAvx2: return "avx2";
        default: return "scalar";
    }
}

const char* dtype_name(DType dt) {
    switch (dt) {
        case DType::kBFloat16: return "bfloat16";
        case DType::kFloat16: return "float16";
        default: return "float32";
    }
}

std::size_t dtype_bytes(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

bool isa_supported(Isa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
    switch (isa) {
        case Isa::kScalar: return true;
        case Isa::kAvx2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
        case Isa::kAvx512:
            return isa_supported(Isa::kAvx2) && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    }
    return false;
#else
    return isa == Isa::kScalar;
#endif
}

Isa best_isa() {
    if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
    if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
    return Isa::kScalar;
}

const char* sqrt_mode_name(SqrtMode mode) {
    switch (mode) {
        case SqrtMode::kRsqrtNewton: return "rsqrt_newton";
        case SqrtMode::kRsqrt14Fma: return "rsqrt14_fma";
        case SqrtMode::kRsqrtNewtonFma: return "rsqrt_newton_fma";
        default: return "ieee";
    }
}

bool sqrt_mode_supported(SqrtMode mode) {
    switch (mode) {
        case SqrtMode::kIeee: return true;
#if defined(__x86_64__) && defined(__GNUC__)
        case SqrtMode::kRsqrtNewton: return true;
        case SqrtMode::kRsqrt14Fma: return isa_supported(Isa::kAvx512);
        case SqrtMode::kRsqrtNewtonFma: return isa_supported(Isa::kAvx2);
#endif
        default: return false;
    }
}

int make_adam_scalars(const AdamHyper& h, SqrtMode mode, AdamScalars* out) {
    if (h.step < 1) return -EINVAL;
    for (double x : {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.inv_loss_scale, h.clip_coef})
        if (!std::isfinite(x)) return -EINVAL;
    // Same double arithmetic as torch.optim.adam._single_tensor_adam (Python floats; ** is pow()).
    const double step = static_cast<double>(h.step);
    const double bias_correction1 = 1.0 - std::pow(h.beta1, step);
    const double bias_correction2 = 1.0 - std::pow(h.beta2, step);
    const double step_size = h.lr / bias_correction1;
    const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
    const double decay = 1.0 - h.lr * h.weight_decay;
    out->inv_loss_scale = static_cast<float>(h.inv_loss_scale);
    out->clip_coef = static_cast<float>(h.clip_coef);
    out->decay = static_cast<float>(decay);
    out->lerp_weight = static_cast<float>(1.0 - h.beta1);
    out->beta2 = static_cast<float>(h.beta2);
    out->one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    out->bc2_sqrt = static_cast<float>(bias_correction2_sqrt);
    out->eps = static_cast<float>(h.eps);
    out->neg_step_size = static_cast<float>(-step_size);
    out->apply_unscale = h.inv_loss_scale != 1.0;
    out->apply_clip = h.clip_coef != 1.0;
    out->apply_decay = h.weight_decay != 0.0;
    if (!sqrt_mode_supported(mode)) return -EINVAL;
    out->sqrt_mode = mode;
    return 0;
}

static bool valid_dtype(DType dt) {
    return dt == DType::kFloat32 || dt == DType::kBFloat16 || dt == DType::kFloat16;
}

bool moment_dtype_supported(DType dt) { return valid_dtype(dt); }

int adam_update_range(Isa isa, const AdamScalars& s, float* param, void* exp_avg, void* exp_avg_sq,
                      const void* grad, DType grad_dtype, void* out, DType out_dtype, std::size_t n,
                      DType moment_dtype) {
    if (!valid_dtype(grad_dtype) || !valid_dtype(out_dtype) || !isa_supported(isa)) return -EINVAL;
    if (!moment_dtype_supported(moment_dtype)) return -EINVAL;
    if (n == 0) return 0;
    if (!param || !exp_avg || !exp_avg_sq || !grad) return -EINVAL;
    if (moment_dtype == DType::kFloat16) {
        auto* m = static_cast<detail::Half*>(exp_avg);
        auto* v = static_cast<detail::Half*>(exp_avg_sq);
        switch (isa) {
            case Isa::kAvx512: detail::adam_avx512_mh(s, param, m, v, grad, grad_dtype, out, out_dtype, n); break;
            case Isa::kAvx2: detail::adam_avx2_mh(s, param, m, v, grad, grad_dtype, out, out_dtype, n); break;
            default: detail::adam_scalar_mh(s, param, m, v, grad, grad_dtype, out, out_dtype, n); break;
        }
        return 0;
    }
    if (moment_dtype == DType::kBFloat16) {
        auto* m = static_cast<std::uint16_t*>(exp_avg);
        auto* v = static_cast<std::uint16_t*>(exp_avg_sq);
        switch (isa) {
            case Isa::kAvx512: detail::adam_avx512_m16(s, param, m, v, grad, grad_dtype, out, out_dtype, n); break;
            case Isa::kAvx2: detail::adam_avx2_m16(s, param, m, v, grad, grad_dtype, out, out_dtype, n); break;
            default: detail::adam_scalar_m16(s, param, m, v, grad, grad_dtype, out, out_dtype, n); break;
        }
        return 0;
    }
    auto* m = static_cast<float*>(exp_avg);
    auto* v = static_cast<float*>(exp_avg_sq);
    switch (isa) {
        case Isa::kAvx512:
            detail::adam_avx512(s, param, m, v, grad, grad_dtype, out, out_dtype, n);
            break;
        case Isa::kAvx2:
            detail::adam_avx2(s, param, m, v, grad, grad_dtype, out, out_dtype, n);
            break;
        default:
            detail::adam_scalar(s, param, m, v, grad, grad_dtype, out, out_dtype, n);
            break;
    }
    return 0;
}

int moments_absmax_range(Isa isa, const AdamScalars& s, const std::uint16_t* exp_avg, const std::uint16_t* exp_avg_sq,
                         const void* grad, DType grad_dtype, std::size_t n, float* absmax) {
    if (!valid_dtype(grad_dtype) || !isa_supported(isa) || !absmax) return -EINVAL;
    absmax[0] = absmax[1] = 0.0f;
    if (n == 0) return 0;
    if (!exp_avg || !exp_avg_sq || !grad) return -EINVAL;
    const auto* m = reinterpret_cast<const detail::Half*>(exp_avg);
    const auto* v = reinterpret_cast<const detail::Half*>(exp_avg_sq);
    switch (isa) {
        case Isa::kAvx512: detail::absmax_avx512_mh(s, m, v, grad, grad_dtype, n, absmax); break;
        case Isa::kAvx2: detail::absmax_avx2_mh(s, m, v, grad, grad_dtype, n, absmax); break;
        default: detail::absmax_scalar_mh(s, m, v, grad, grad_dtype, n, absmax); break;
    }
    return 0;
}

bool checksummed_update_supported(Isa isa) {
    return isa == Isa::kAvx2 && isa_supported(isa) && crc32c_fold256_supported();
}

int adam_update_range_checksummed(Isa isa, const AdamScalars& s, float* param, float* exp_avg, float* exp_avg_sq,
                                  const void* grad, DType grad_dtype, void* out, DType out_dtype, std::size_t n,
                                  std::uint32_t* in_crcs, std::uint32_t* out_crcs) {
    if (!checksummed_update_supported(isa)) return -ENOTSUP;
    if (!valid_dtype(grad_dtype) || !valid_dtype(out_dtype)) return -EINVAL;
    if (n == 0) {
        for (int a = 0; a < 3; ++a) {
            if (in_crcs) in_crcs[a] = 0;
            if (out_crcs) out_crcs[a] = 0;
        }
        return 0;
    }
    if (!param || !exp_avg || !exp_avg_sq || !grad) return -EINVAL;
    detail::adam_avx2_checksummed(s, param, exp_avg, exp_avg_sq, grad, grad_dtype, out, out_dtype, n, in_crcs,
                                  out_crcs);
    return 0;
}

int grad_stats_range(Isa isa, const void* grad, DType dtype, std::size_t n, GradStats* out) {
    if (!valid_dtype(dtype) || !isa_supported(isa) || !out) return -EINVAL;
    *out = GradStats{};
    if (n == 0) return 0;
    if (!grad) return -EINVAL;
    switch (isa) {
        case Isa::kAvx512: detail::stats_avx512(grad, dtype, n, out); break;
        case Isa::kAvx2: detail::stats_avx2(grad, dtype, n, out); break;
        default: detail::stats_scalar(grad, dtype, n, out); break;
    }
    return 0;
}

int sqrt_range(Isa isa, SqrtMode mode, const float* in, float* out, std::size_t n) {
    if (!isa_supported(isa) || !sqrt_mode_supported(mode)) return -EINVAL;
    if (n == 0) return 0;
    if (!in || !out) return -EINVAL;
    switch (isa) {
        case Isa::kAvx512: detail::sqrt_avx512(mode, in, out, n); break;
        case Isa::kAvx2: detail::sqrt_avx2(mode, in, out, n); break;
        default: detail::sqrt_scalar(mode, in, out, n); break;
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
WorkerPool::WorkerPool(int num_threads) : owner_pid_(static_cast<int>(getpid())) {
    const int extra = std::max(1, num_threads) - 1;
    workers_.reserve(static_cast<std::size_t>(extra));
    for (int i = 0; i < extra; ++i) workers_.emplace_back([this, i] { worker_loop(i + 1); });
}

WorkerPool::~WorkerPool() {
    if (static_cast<int>(getpid()) != owner_pid_) {
        // A forked child: the workers exist only in the parent. Joining (or destroying joinable
        // std::thread objects) would hang or terminate, so their handles are deliberately leaked.
        new std::vector<std::thread>(std::move(workers_));
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    start_cv_.notify_all();
    for (auto& t : workers_) t.join();
}

void WorkerPool::worker_loop(int index) {
    std::uint64_t seen = 0;
    for (;;) {
        const std::function<void(int)>* task;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            start_cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
            if (stopping_) return;
            seen = generation_;
            if (index >= num_tasks_) continue;  // not needed this round
            task = task_;
        }
        (*task)(index);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (--pending_ == 0) done_cv_.notify_one();
        }
    }
}

void WorkerPool::run(int num_tasks, const std::function<void(int)>& fn) {
    num_tasks = std::min(num_tasks, num_threads());
    if (num_tasks <= 1 || static_cast<int>(getpid()) != owner_pid_) {  // alone, or a forked child
        for (int t = 0; t < num_tasks; ++t) fn(t);
        return;
    }
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        task_ = &fn;
        num_tasks_ = num_tasks;
        pending_ = num_tasks - 1;
        ++generation_;
    }
    start_cv_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return pending_ == 0; });
    task_ = nullptr;
}

// ---------------------------------------------------------------------------------------------
static int available_cpus() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        const int c = CPU_COUNT(&set);
        if (c > 0) return c;
    }
    const unsigned hc = std::thread::hardware_concurrency();
    return hc ? static_cast<int>(hc) : 1;
}

CpuAdam::CpuAdam(int num_threads) : pool_(num_threads > 0 ? num_threads : available_cpus()), isa_(best_isa()) {}

int CpuAdam::set_sqrt_mode(SqrtMode mode) {
    if (!sqrt_mode_supported(mode)) return -ENOTSUP;
    sqrt_mode_ = mode;
    return 0;
}

int CpuAdam::set_isa(Isa isa) {
    if (!isa_supported(isa)) return -ENOTSUP;
    isa_ = isa;
    return 0;
}

int CpuAdam::plan_tasks(std::size_t n, int want) const {
    int k = want > 0 ? std::min(want, num_threads()) : num_threads();
    const std::size_t by_size = n / kMinElemsPerThread;
    if (by_size < static_cast<std::size_t>(k)) k = static_cast<int>(std::max<std::size_t>(1, by_size));
    return k;
}

// Piece t of [0, n) split in k pieces at multiples of kChunkElems.
static void piece(std::size_t n, int k, int t, std::size_t* begin, std::size_t* end) {
    const std::size_t chunks = (n + kChunkElems - 1) / kChunkElems;
    const std::size_t per = chunks / static_cast<std::size_t>(k);
    const std::size_t extra = chunks % static_cast<std::size_t>(k);
    const std::size_t tt = static_cast<std::size_t>(t);
    const std::size_t c0 = tt * per + std::min(tt, extra);
    const std::size_t c1 = c0 + per + (tt < extra ? 1 : 0);
    *begin = std::min(n, c0 * kChunkElems);
    *end = std::min(n, c1 * kChunkElems);
}

int CpuAdam::step(const AdamHyper& hyper, float* param, void* exp_avg, void* exp_avg_sq, const void* grad,
                  DType grad_dtype, void* out, DType out_dtype, std::size_t n, int num_threads,
                  std::uint32_t* crcs, std::uint32_t* in_crcs, DType moment_dtype, const float* moment_scales) {
    AdamScalars s;
    if (int rc = make_adam_scalars(hyper, sqrt_mode_, &s); rc < 0) return rc;
    if (moment_dtype == DType::kFloat16 && moment_scales) {
        s.m_scale = moment_scales[0];
        s.v_scale = moment_scales[1];
        s.m_rscale = moment_scales[2];
        s.v_rscale = moment_scales[3];
    }
    if (!valid_dtype(grad_dtype) || !valid_dtype(out_dtype)) return -EINVAL;
    if (!moment_dtype_supported(moment_dtype)) return -EINVAL;
    if (n == 0) return 0;
    if (!param || !exp_avg || !exp_avg_sq || !grad) return -EINVAL;
    const int k = plan_tasks(n, num_threads);
    const Isa isa = isa_;
    const std::size_t gb = dtype_bytes(grad_dtype), ob = dtype_bytes(out_dtype), mb = dtype_bytes(moment_dtype);
    char* const m_bytes = static_cast<char*>(exp_avg);
    char* const v_bytes = static_cast<char*>(exp_avg_sq);
    // With `crcs` (`in_crcs`), each thread checksums its own piece of each array tile by tile,
    // right after (before) updating the tile, while it is in cache; the pieces' CRCs are then
    // joined in order (crc32c_combine). Without either, a thread's piece is one tile.
    struct PieceCrc {
        std::uint32_t out[3] = {0, 0, 0};
        std::uint32_t in[3] = {0, 0, 0};
        std::size_t bytes[3] = {0, 0, 0};
    };
    const bool tiled = crcs || in_crcs;
    // Where the path can, each thread folds its piece's checksums in its update loop instead
    // (fp32 moments only).
    const bool folded = tiled && checksummed_update_supported(isa) && moment_dtype == DType::kFloat32;
    std::vector<PieceCrc> parts(tiled ? static_cast<std::size_t>(k) : 0);
    // Extends the running CRCs of the three arrays by elements [i, i + len).
    auto checksum_tile = [&](std::uint32_t* crc, std::size_t i, std::size_t len) {
        crc[0] = crc32c(param + i, len * 4, crc[0]);
        crc[1] = crc32c(m_bytes + i * mb, len * mb, crc[1]);
        crc[2] = crc32c(v_bytes + i * mb, len * mb, crc[2]);
    };
    pool_.run(k, [&](int t) {
        std::size_t b, e;
        piece(n, k, t, &b, &e);
        if (folded) {
            PieceCrc& part = parts[static_cast<std::size_t>(t)];
            void* o = out ? static_cast<char*>(out) + b * ob : nullptr;
            adam_update_range_checksummed(isa, s, param + b, reinterpret_cast<float*>(m_bytes) + b,
                                          reinterpret_cast<float*>(v_bytes) + b,
                                          static_cast<const char*>(grad) + b * gb, grad_dtype, o, out_dtype, e - b,
                                          in_crcs ? part.in : nullptr, crcs ? part.out : nullptr);
            for (auto& nb : part.bytes) nb = (e - b) * 4;
            return;
        }
        const std::size_t tile = tiled ? kCrcTileElems : e - b;
        for (std::size_t i = b; i < e; i += tile) {
            const std::size_t len = std::min(tile, e - i);
            void* o = out ? static_cast<char*>(out) + i * ob : nullptr;
            if (in_crcs) checksum_tile(parts[static_cast<std::size_t>(t)].in, i, len);
            adam_update_range(isa, s, param + i, m_bytes + i * mb, v_bytes + i * mb,
                              static_cast<const char*>(grad) + i * gb, grad_dtype, o, out_dtype, len, moment_dtype);
            if (!tiled) continue;
            PieceCrc& part = parts[static_cast<std::size_t>(t)];
            if (crcs) checksum_tile(part.out, i, len);
            part.bytes[0] += len * 4;
            part.bytes[1] += len * mb;
            part.bytes[2] += len * mb;
        }
    });
    for (int a = 0; tiled && a < 3; ++a) {
        std::uint32_t before = parts[0].in[a], after = parts[0].out[a];
        for (std::size_t t = 1; t < parts.size(); ++t) {
            before = crc32c_combine(before, parts[t].in[a], parts[t].bytes[a]);
            after = crc32c_combine(after, parts[t].out[a], parts[t].bytes[a]);
        }
        if (crcs) crcs[a] = after;
        if (in_crcs) in_crcs[a] = before;
    }
    return 0;
}

int CpuAdam::moments_absmax(const AdamHyper& hyper, const float* scales, const std::uint16_t* exp_avg,
                            const std::uint16_t* exp_avg_sq, const void* grad, DType grad_dtype, std::size_t n,
                            float* absmax, int num_threads) {
    AdamScalars s;
    if (int rc = make_adam_scalars(hyper, sqrt_mode_, &s); rc < 0) return rc;
    if (!valid_dtype(grad_dtype) || !absmax) return -EINVAL;
    if (scales) {
        s.m_scale = scales[0];
        s.v_scale = scales[1];
    }
    absmax[0] = absmax[1] = 0.0f;
    if (n == 0) return 0;
    if (!exp_avg || !exp_avg_sq || !grad) return -EINVAL;
    const int k = plan_tasks(n, num_threads);
    std::vector<float> parts(2 * static_cast<std::size_t>(k), 0.0f);
    const Isa isa = isa_;
    const std::size_t gb = dtype_bytes(grad_dtype);
    pool_.run(k, [&](int t) {
        std::size_t b, e;
        piece(n, k, t, &b, &e);
        if (b < e)
            moments_absmax_range(isa, s, exp_avg + b, exp_avg_sq + b, static_cast<const char*>(grad) + b * gb,
                                 grad_dtype, e - b, &parts[2 * static_cast<std::size_t>(t)]);
    });
    for (int a = 0; a < 2; ++a) {
        float r = 0.0f;
        for (int t = 0; t < k; ++t) {
            const float x = parts[2 * static_cast<std::size_t>(t) + a];
            if (std::isnan(x) || std::isnan(r)) r = std::isnan(r) ? r : x;
            else r = x > r ? x : r;
        }
        absmax[a] = r;
    }
    return 0;
}

int CpuAdam::grad_stats(const void* grad, DType dtype, std::size_t n, GradStats* out, int num_threads) {
    if (!valid_dtype(dtype) || !out) return -EINVAL;
    *out = GradStats{};
    if (n == 0) return 0;
    if (!grad) return -EINVAL;
    const int k = plan_tasks(n, num_threads);
    std::vector<GradStats> parts(static_cast<std::size_t>(k));
    const Isa isa = isa_;
    const std::size_t gb = dtype_bytes(dtype);
    pool_.run(k, [&](int t) {
        std::size_t b, e;
        piece(n, k, t, &b, &e);
        if (b < e) grad_stats_range(isa, static_cast<const char*>(grad) + b * gb, dtype, e - b, &parts[t]);
    });
    for (const auto& p : parts) {
        out->sum_of_squares += p.sum_of_squares;
        out->found_nonfinite |= p.found_nonfinite;
    }
    return 0;
}

int CpuAdam::copy(void* dst, const void* src, std::size_t nbytes, int num_threads) {
    if (nbytes == 0) return 0;
    if (!dst || !src) return -EINVAL;
    const std::size_t n = nbytes / 4;  // pieces in 4-byte units, as fp32 state
    const int k = plan_tasks(n, num_threads);
    pool_.run(k, [&](int t) {
        std::size_t b, e;
        piece(n, k, t, &b, &e);
        const std::size_t len = (e - b) * 4 + (t == k - 1 ? nbytes % 4 : 0);  // last piece: odd tail bytes
        if (len) std::memcpy(static_cast<char*>(dst) + b * 4, static_cast<const char*>(src) + b * 4, len);
    });
    return 0;
}

namespace {
// One thread's piece of CpuAdam::traffic: per 8 elements, the loads and stores of the update loop
// (p, m, v read and written in place, the gradient read, the output written non-temporally when
// aligned, as the AVX-512 path does), with an empty asm between them so that the compiler keeps
// every load and store but computes nothing. SSE2 (every x86-64): a memory-bound loop on two
// cores reaches the memory's limit at this width too.
void traffic_range(float* const* arrays, const char* grad, std::size_t gb, char* out, std::size_t ob,
                   std::size_t b, std::size_t e) {
    std::size_t i = b;
#if defined(__x86_64__) || defined(__i386__)
    const bool stream = out && (reinterpret_cast<std::uintptr_t>(out + b * ob) & 15u) == 0;
    for (; i + 8 <= e; i += 8) {
        __m128 x[6];
        for (int a = 0; a < 3; ++a) {
            x[2 * a] = _mm_loadu_ps(arrays[a] + i);
            x[2 * a + 1] = _mm_loadu_ps(arrays[a] + i + 4);
        }
        __m128i g0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(grad + i * gb));
        __m128i g1 = gb == 4 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(grad + i * gb + 16)) : g0;
        asm volatile("" : "+x"(x[0]), "+x"(x[1]), "+x"(x[2]), "+x"(x[3]), "+x"(x[4]), "+x"(x[5]), "+x"(g0), "+x"(g1));
        for (int a = 0; a < 3; ++a) {
            _mm_storeu_ps(arrays[a] + i, x[2 * a]);
            _mm_storeu_ps(arrays[a] + i + 4, x[2 * a + 1]);
        }
        if (!out) continue;
        __m128i* o = reinterpret_cast<__m128i*>(out + i * ob);
        if (stream) {
            _mm_stream_si128(o, g0);
            if (ob == 4) _mm_stream_si128(o + 1, g1);
        } else {
            _mm_storeu_si128(o, g0);
            if (ob == 4) _mm_storeu_si128(o + 1, g1);
        }
    }
    if (stream) _mm_sfence();
#endif
    for (; i < e; ++i) {   // the tail (and every element off x86)
        float x[3];
        for (int a = 0; a < 3; ++a) x[a] = arrays[a][i];
        char g[4];
        std::memcpy(g, grad + i * gb, gb);
        asm volatile("" : : "r"(x), "r"(g) : "memory");
        for (int a = 0; a < 3; ++a) arrays[a][i] = x[a];
        if (out) std::memcpy(out + i * ob, g, std::min(gb, ob));
    }
}
}  // namespace

int CpuAdam::traffic(float* param, float* exp_avg, float* exp_avg_sq, const void* grad, DType grad_dtype, void* out,
                     DType out_dtype, std::size_t n, int num_threads) {
    if (!valid_dtype(grad_dtype) || !valid_dtype(out_dtype)) return -EINVAL;
    if (n == 0) return 0;
    if (!param || !exp_avg || !exp_avg_sq || !grad) return -EINVAL;
    const int k = plan_tasks(n, num_threads);
    const std::size_t gb = dtype_bytes(grad_dtype), ob = dtype_bytes(out_dtype);
    float* const arrays[3] = {param, exp_avg, exp_avg_sq};
    pool_.run(k, [&](int t) {
        std::size_t b, e;
        piece(n, k, t, &b, &e);
        traffic_range(arrays, static_cast<const char*>(grad), gb, static_cast<char*>(out), ob, b, e);
    });
    return 0;
}

}  // namespace mlp
