// Fused CPU AdamW over one subgroup: low-precision gradients are upcast in registers.
//
// The update reproduces torch.optim.AdamW's single-tensor CPU path bit for bit (fp32 state),
// applied to float(grad) * inv_loss_scale * clip_coef (two fp32 roundings, as Megatron unscales
// and then clips). The op sequence and its roundings are those of ATen's CPU kernels:
//   g  = float(grad); g = g * f32(inv_loss_scale); g = g * f32(clip_coef)   (each skipped when == 1)
//   p  = p * f32(1 - lr*wd)                                  (skipped when wd == 0)
//   m  = lerp(m, g, w),  w = f32(1 - beta1):  w < 0.5 ? fma(w, g-m, m) : fma(w-1, g-m, g)
//   v  = v * f32(beta2);  v = fma(f32(1-beta2) * g, g, v)    (addcmul, contracted in ATen)
//   d  = sqrt(v) / f32(sqrt(1 - beta2^step)) + f32(eps)
//   p  = p + (f32(-lr / (1 - beta1^step)) * m) / d           (addcdiv)
// Bias corrections are computed in double exactly as torch's Python code does.
// `sqrt` is one of the three that torch's Tensor.sqrt() computes on x86 CPUs:
//   SqrtMode::kIeee            correctly rounded (torch without MKL),
//   SqrtMode::kRsqrtNewton     MKL vsSqrt's generic SSE kernel, rsqrt + Newton without fma
//                              (taken e.g. on AMD EPYC, where MKL skips its Intel kernels),
//   SqrtMode::kRsqrtNewtonFma  MKL vsSqrt's AVX2 kernel, the same Newton steps with fma (Intel
//                              CPUs with AVX2 but no AVX-512; needs FMA on every path),
//   SqrtMode::kRsqrt14Fma      MKL vsSqrt's AVX-512 kernel, rsqrt14 + one fma correction (Intel
//                              CPUs with AVX-512; needs AVX-512F on every path).
// The Python layer detects which one the installed torch uses.
//
// No libtorch, no libpython: raw pointers, element counts and a dtype enum. The hot path returns
// -errno and never throws.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mlp {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
enum class SqrtMode : int { kIeee = 0, kRsqrtNewton = 1, kRsqrt14Fma = 2, kRsqrtNewtonFma = 3 };

const char* isa_name(Isa isa);
const char* dtype_name(DType dt);
std::size_t dtype_bytes(DType dt);
// Whether this CPU (and this build) can run `isa`.
bool isa_supported(Isa isa);
// The fastest supported ISA.
Isa best_isa();
const char* sqrt_mode_name(SqrtMode mode);
// Whether this CPU can compute `mode` (kRsqrt14Fma needs AVX-512F, kRsqrtNewton x86 SSE).
bool sqrt_mode_supported(SqrtMode mode);

// Hyper-parameters of one step, as the caller (torch's param_groups) holds them.
struct AdamHyper {
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.0;
    std::int64_t step = 1;  // 1-based step count after increment, as torch's state["step"]
    double inv_loss_scale = 1.0;
    double clip_coef = 1.0;
};

// The fp32 constants the kernel uses, derived from AdamHyper with torch's double arithmetic.
struct AdamScalars {
    float inv_loss_scale;
    float clip_coef;
    float decay;             // f32(1 - lr*wd)
    float lerp_weight;       // f32(1 - beta1)
    float beta2;             // f32(beta2)
    float one_minus_beta2;   // f32(1 - beta2)
    float bc2_sqrt;          // f32(sqrt(1 - beta2^step))
    float eps;               // f32(eps)
    float neg_step_size;     // f32(-(lr / (1 - beta1^step)))
    bool apply_unscale;      // inv_loss_scale != 1
    bool apply_clip;         // clip_coef != 1
    bool apply_decay;        // weight_decay != 0
    SqrtMode sqrt_mode;
    // fp16 moments only (see moment_dtype_supported): this call's tensor's scales, the ones its
    // stored moments were written with (m_scale, v_scale) and the reciprocals of the new ones
    // (m_rscale, v_rscale, from moments_absmax_range's result). Unused with fp32 or bf16 moments.
    float m_scale = 1.0f;
    float v_scale = 1.0f;
    float m_rscale = 1.0f;
    float v_rscale = 1.0f;
};

// Returns 0, or -EINVAL when the hyper-parameters cannot be used (step < 1, non-finite values).
int make_adam_scalars(const AdamHyper& h, SqrtMode mode, AdamScalars* out);

// Whether the kernel stores Adam's moments (exp_avg, exp_avg_sq) in `dt`: fp32, or bf16 or fp16 as
// Megatron's precision-aware optimizer does (--exp-avg-dtype / --exp-avg-sq-dtype, Transformer
// Engine's FusedAdam). With 16-bit moments the arithmetic is unchanged (fp32 in registers, the op
// sequence above, the param updated from the unrounded fp32 moments); only what is stored differs:
//   bf16: the fp32 moment rounded to nearest even (torch's .bfloat16());
//   fp16: per tensor scaled, as FusedAdam's get_unscaled_state / _apply_scale: a moment is loaded
//         as f32(h) * scale and stored as f16(x * rscale) (each product one fp32 rounding, the
//         conversion to nearest even), where scale = absmax / (fp16 max / 2) over the tensor's
//         new moments and rscale = 1 / scale (0 where scale is not > 0). The absmax must be
//         known before any element is stored: moments_absmax_range computes it in a pass of its
//         own, with the same arithmetic, and the caller derives the scales (AdamScalars).
bool moment_dtype_supported(DType dt);

// One thread's share: elements [0, n) of the given arrays. `out` may be null. exp_avg and
// exp_avg_sq hold `moment_dtype` elements (fp32 or bf16, see moment_dtype_supported).
// Returns 0 or -EINVAL (unknown dtype / unsupported isa).
int adam_update_range(Isa isa, const AdamScalars& s, float* param, void* exp_avg, void* exp_avg_sq,
                      const void* grad, DType grad_dtype, void* out, DType out_dtype, std::size_t n,
                      DType moment_dtype = DType::kFloat32);

// The largest magnitude of the new exp_avg and exp_avg_sq of elements [0, n) as
// adam_update_range with fp16 moments would compute them (s.m_scale, s.v_scale unscale the stored
// ones), without storing anything: absmax[0] for exp_avg, absmax[1] for exp_avg_sq, NaN where
// any new moment is NaN (torch.aminmax propagates NaN). Returns 0 or -EINVAL.
int moments_absmax_range(Isa isa, const AdamScalars& s, const std::uint16_t* exp_avg, const std::uint16_t* exp_avg_sq,
                         const void* grad, DType grad_dtype, std::size_t n, float* absmax);

// adam_update_range that also gives the CRC-32C (seed 0) of the param, exp_avg and exp_avg_sq
// arrays as they were before the update (`in_crcs`, 3 values; may be null) and after it
// (`out_crcs`; may be null), folded from the vectors the update loads and stores. Only where
// checksummed_update_supported(isa); returns -ENOTSUP elsewhere, 0 or -EINVAL as
// adam_update_range otherwise.
bool checksummed_update_supported(Isa isa);
int adam_update_range_checksummed(Isa isa, const AdamScalars& s, float* param, float* exp_avg, float* exp_avg_sq,
                                  const void* grad, DType grad_dtype, void* out, DType out_dtype, std::size_t n,
                                  std::uint32_t* in_crcs, std::uint32_t* out_crcs);

// Partial gradient statistics of one range: sum of squares (double) and non-finite detection.
struct GradStats {
    double sum_of_squares = 0.0;
    bool found_nonfinite = false;
};
int grad_stats_range(Isa isa, const void* grad, DType dtype, std::size_t n, GradStats* out);

// sqrt of n floats with the kernel's sqrt (for detecting which sqrt the installed torch uses).
int sqrt_range(Isa isa, SqrtMode mode, const float* in, float* out, std::size_t n);

// A small persistent pool: `run(k, fn)` calls fn(0..k-1) with the calling thread taking index 0,
// and returns when all calls returned. Not re-entrant; one run at a time (guarded by a mutex).
// Fork-safe: in a child process (where the workers do not exist) run() calls every task on the
// calling thread, and the destructor leaves the absent threads alone.
class WorkerPool {
public:
    explicit WorkerPool(int num_threads);  // total threads including the caller, >= 1
    ~WorkerPool();
    WorkerPool(const WorkerPool&) = delete;
    WorkerPool& operator=(const WorkerPool&) = delete;

    int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
    void run(int num_tasks, const std::function<void(int)>& fn);

private:
    void worker_loop(int index);

    std::vector<std::thread> workers_;
    int owner_pid_;         // the process whose threads these are
    std::mutex run_mutex_;  // serialises run()
    std::mutex mutex_;
    std::condition_variable start_cv_;
    std::condition_variable done_cv_;
    const std::function<void(int)>* task_ = nullptr;
    int num_tasks_ = 0;
    std::uint64_t generation_ = 0;
    int pending_ = 0;
    bool stopping_ = false;
};

// Owns the worker pool and the selected kernel paths. Move-only by construction (owns threads).
class CpuAdam {
public:
    // num_threads <= 0: all CPUs this process may run on.
    explicit CpuAdam(int num_threads = 0);

    int num_threads() const { return pool_.num_threads(); }
    Isa isa() const { return isa_; }
    // Returns -ENOTSUP when this CPU cannot run `isa`.
    int set_isa(Isa isa);
    SqrtMode sqrt_mode() const { return sqrt_mode_; }
    // Returns -ENOTSUP when this CPU cannot compute `mode`.
    int set_sqrt_mode(SqrtMode mode);

    // Updates param/exp_avg/exp_avg_sq (fp32, n elements) in place from grad; writes the new
    // params converted to out_dtype into `out` when it is not null. num_threads <= 0: all.
    // When `crcs` is not null it receives the CRC-32C of the updated param, exp_avg and
    // exp_avg_sq arrays (n * 4 bytes each), computed tile by tile while the tile is still in
    // cache: the write-back needs them, and a separate pass would stream the state through
    // memory once more. When `in_crcs` is not null it receives the CRC-32C of the three arrays
    // as they were before the update, computed the same way: a region read back from storage is
    // verified by the pass that updates it instead of a pass of its own. On the AVX2 path of a
    // CPU with VPCLMULQDQ both are folded from the vectors the update loads and stores instead
    // of tile by tile (adam_update_range_checksummed). Returns 0 or -EINVAL.
    // `moment_dtype`: what exp_avg and exp_avg_sq hold (fp32, or bf16; the CRCs are then of their
    // n * 2 bytes, and always tile by tile).
    // `moment_scales` (fp16 moments only, else ignored): m_scale, v_scale, m_rscale, v_rscale of
    // AdamScalars for the one tensor [0, n) belongs to; null means 1, 1, 1, 1.
    int step(const AdamHyper& hyper, float* param, void* exp_avg, void* exp_avg_sq, const void* grad,
             DType grad_dtype, void* out, DType out_dtype, std::size_t n, int num_threads = 0,
             std::uint32_t* crcs = nullptr, std::uint32_t* in_crcs = nullptr,
             DType moment_dtype = DType::kFloat32, const float* moment_scales = nullptr);

    // moments_absmax_range over the pool: `scales` holds the stored moments' m_scale, v_scale.
    int moments_absmax(const AdamHyper& hyper, const float* scales, const std::uint16_t* exp_avg,
                       const std::uint16_t* exp_avg_sq, const void* grad, DType grad_dtype, std::size_t n,
                       float* absmax, int num_threads = 0);

    int grad_stats(const void* grad, DType dtype, std::size_t n, GradStats* out, int num_threads = 0);

    // memcpy split over the pool like step(): the STREAM-like copy that measures the memory
    // bandwidth available to this pool's threads (the bound of a memory-bound step).
    int copy(void* dst, const void* src, std::size_t nbytes, int num_threads = 0);

    // The memory traffic of step() with no arithmetic: on the same pool and partition, reads
    // param/exp_avg/exp_avg_sq and grad and writes the three arrays back in place and `out`
    // (non-temporal where aligned, as the AVX-512 path). Leaves the arrays' values unchanged and
    // writes arbitrary bytes to `out`. No Adam step with the same
    // arguments can move its bytes faster: the upper bound of bench adam. Returns 0 or -EINVAL.
    int traffic(float* param, float* exp_avg, float* exp_avg_sq, const void* grad, DType grad_dtype, void* out,
                DType out_dtype, std::size_t n, int num_threads = 0);

private:
    // Splits [0, n) into at most `want` pieces whose boundaries are multiples of kChunkElems, so
    // no two threads write the same cache line of any array.
    int plan_tasks(std::size_t n, int want) const;

    WorkerPool pool_;
    Isa isa_;
    SqrtMode sqrt_mode_ = SqrtMode::kIeee;
};

// Boundary granularity of the per-thread partition: 64 elements = 256 bytes of fp32 state and
// 128 bytes of 16-bit data, whole cache lines for every array when the arrays are 64-byte aligned.
constexpr std::size_t kChunkElems = 64;
// Elements per tile when step() also checksums: 16 KiB of each fp32 array, so the tile the
// kernel just wrote is still in L1/L2 when its CRC-32C reads it (a multiple of kChunkElems).
constexpr std::size_t kCrcTileElems = 4096;
// Below this many elements per extra thread, waking a worker costs more than it saves.
constexpr std::size_t kMinElemsPerThread = 1 << 15;

namespace detail {
// Per-ISA kernels (defined in cpu_adam_<isa>.cpp, compiled with function-level target attributes).
void adam_scalar(const AdamScalars& s, float* p, float* m, float* v, const void* g, DType gdt, void* out,
                 DType odt, std::size_t n);
void adam_avx2(const AdamScalars& s, float* p, float* m, float* v, const void* g, DType gdt, void* out,
               DType odt, std::size_t n);
void adam_avx512(const AdamScalars& s, float* p, float* m, float* v, const void* g, DType gdt, void* out,
                 DType odt, std::size_t n);
// The same paths with bf16 moments (fp32 arithmetic, moments stored rounded to nearest even).
void adam_scalar_m16(const AdamScalars& s, float* p, std::uint16_t* m, std::uint16_t* v, const void* g, DType gdt,
                     void* out, DType odt, std::size_t n);
void adam_avx2_m16(const AdamScalars& s, float* p, std::uint16_t* m, std::uint16_t* v, const void* g, DType gdt,
                   void* out, DType odt, std::size_t n);
void adam_avx512_m16(const AdamScalars& s, float* p, std::uint16_t* m, std::uint16_t* v, const void* g, DType gdt,
                     void* out, DType odt, std::size_t n);
// fp16 moments as stored bits (a type of its own, so overloads tell it from bf16's uint16_t).
struct Half {
    std::uint16_t bits;
};
// The same paths with per-tensor scaled fp16 moments (AdamScalars' m_scale ... v_rscale).
void adam_scalar_mh(const AdamScalars& s, float* p, Half* m, Half* v, const void* g, DType gdt, void* out, DType odt,
                    std::size_t n);
void adam_avx2_mh(const AdamScalars& s, float* p, Half* m, Half* v, const void* g, DType gdt, void* out, DType odt,
                  std::size_t n);
void adam_avx512_mh(const AdamScalars& s, float* p, Half* m, Half* v, const void* g, DType gdt, void* out,
                    DType odt, std::size_t n);
// moments_absmax_range per path.
void absmax_scalar_mh(const AdamScalars& s, const Half* m, const Half* v, const void* g, DType gdt, std::size_t n,
                      float* absmax);
void absmax_avx2_mh(const AdamScalars& s, const Half* m, const Half* v, const void* g, DType gdt, std::size_t n,
                    float* absmax);
void absmax_avx512_mh(const AdamScalars& s, const Half* m, const Half* v, const void* g, DType gdt, std::size_t n,
                      float* absmax);
// adam_avx2 folding the loaded and stored state into CRC-32Cs (crc32c_fold256_supported CPUs).
void adam_avx2_checksummed(const AdamScalars& s, float* p, float* m, float* v, const void* g, DType gdt, void* out,
                           DType odt, std::size_t n, std::uint32_t* in_crcs, std::uint32_t* out_crcs);
void stats_scalar(const void* g, DType dt, std::size_t n, GradStats* out);
void stats_avx2(const void* g, DType dt, std::size_t n, GradStats* out);
void stats_avx512(const void* g, DType dt, std::size_t n, GradStats* out);
void sqrt_scalar(SqrtMode mode, const float* in, float* out, std::size_t n);
void sqrt_avx2(SqrtMode mode, const float* in, float* out, std::size_t n);
void sqrt_avx512(SqrtMode mode, const float* in, float* out, std::size_t n);
// MKL's AVX-512 sqrt sequence for the scalar and AVX2 paths (defined with an AVX-512 target;
// only called when sqrt_mode_supported(kRsqrt14Fma)).
float sqrt_rsqrt14_fma_1(float x);
// MKL's AVX2 sqrt sequence for the scalar path (AVX2+FMA target; only when supported).
float sqrt_rsqrt_newton_fma_1(float x);
void sqrt_rsqrt14_fma_8(const float* in, float* out);

// Bit conversions shared by all paths (scalar definitions; SIMD paths reproduce them exactly).
inline float bf16_to_f32(std::uint16_t h) {
    std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
inline std::uint16_t f32_to_bf16(float f) {
    std::uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
    return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
}
float f16_to_f32(std::uint16_t h);
std::uint16_t f32_to_f16(float f);  // round to nearest even, overflow to inf, NaN kept quiet
}  // namespace detail

}  // namespace mlp
