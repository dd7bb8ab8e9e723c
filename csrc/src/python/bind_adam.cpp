// Python face of the fused CPU Adam (mlp::CpuAdam), gradient statistics and crc32c.
// Buffers arrive as integer addresses (torch's data_ptr()); megatron_mlp/optim/fused_adam.py
// validates dtypes, sizes and contiguity before anything reaches this file.
#include <pybind11/pybind11.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "mlp/checksum.h"
#include "mlp/cpu_adam.h"

namespace py = pybind11;

namespace mlp::python {
namespace {

template <typename T>
T* ptr(std::uintptr_t addr) {
    return reinterpret_cast<T*>(addr);
}

Isa parse_isa(const std::string& name) {
    if (name == "avx512") return Isa::kAvx512;
    if (name == "avx2") return Isa::kAvx2;
    if (name == "scalar") return Isa::kScalar;
    throw py::value_error("kernel isa must be 'avx512', 'avx2' or 'scalar', got '" + name + "'");
}

SqrtMode parse_sqrt(const std::string& name) {
    if (name == "ieee") return SqrtMode::kIeee;
    if (name == "rsqrt_newton") return SqrtMode::kRsqrtNewton;
    if (name == "rsqrt14_fma") return SqrtMode::kRsqrt14Fma;
    if (name == "rsqrt_newton_fma") return SqrtMode::kRsqrtNewtonFma;
    throw py::value_error("sqrt mode must be 'ieee', 'rsqrt_newton', 'rsqrt_newton_fma' or 'rsqrt14_fma', got '" +
                          name + "'");
}

DType to_dtype(int code) {
    if (code < 0 || code > 2) throw py::value_error("unknown dtype code " + std::to_string(code));
    return static_cast<DType>(code);
}

void check(int rc, const char* what) {
    if (rc == 0) return;
    std::string msg = std::string(what) + " failed: " + std::strerror(-rc);
    if (rc == -EINVAL) throw py::value_error(msg);
    throw std::runtime_error(msg);
}

}  // namespace

void bind_adam(py::module_& m) {
    py::enum_<DType>(m, "DType")
        .value("float32", DType::kFloat32)
        .value("bfloat16", DType::kBFloat16)
        .value("float16", DType::kFloat16);

    m.def("isa_supported", [](const std::string& name) { return isa_supported(parse_isa(name)); },
          "Whether this CPU can run the given kernel ISA ('avx512', 'avx2', 'scalar').");
    m.def("best_isa", [] { return std::string(isa_name(best_isa())); });
    m.def("checksummed_update_supported",
          [](const std::string& name) { return checksummed_update_supported(parse_isa(name)); },
          "Whether the kernel path `name` folds its checksums from the vectors it loads and stores");
    m.def("sqrt_mode_supported", [](const std::string& name) { return sqrt_mode_supported(parse_sqrt(name)); });

    py::class_<CpuAdam>(m, "CpuAdam")
        .def(py::init<int>(), py::arg("num_threads") = 0)
        .def_property_readonly("num_threads", &CpuAdam::num_threads)
        .def_property_readonly("isa", [](const CpuAdam& a) { return std::string(isa_name(a.isa())); })
        .def("set_isa",
             [](CpuAdam& a, const std::string& name) {
                 const Isa isa = parse_isa(name);
                 if (a.set_isa(isa) != 0)
                     throw py::value_error("kernel isa '" + name + "' is not supported by this CPU");
             })
        .def_property_readonly("sqrt_mode",
                               [](const CpuAdam& a) {
                                   return std::string(sqrt_mode_name(a.sqrt_mode()));
                               })
        .def("set_sqrt_mode",
             [](CpuAdam& a, const std::string& name) {
                 if (a.set_sqrt_mode(parse_sqrt(name)) != 0)
                     throw py::value_error("sqrt mode '" + name + "' is not supported by this CPU");
             })
        .def(
            "step",
            [](CpuAdam& a, std::uintptr_t param, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
               std::uintptr_t grad, int grad_dtype, std::uintptr_t out, int out_dtype, std::size_t n, double lr,
               double beta1, double beta2, double eps, double weight_decay, std::int64_t step,
               double inv_loss_scale, double clip_coef, int num_threads, bool checksums,
               bool input_checksums, int moment_dtype, py::object moment_scales) -> py::object {
                AdamHyper h;
                h.lr = lr;
                h.beta1 = beta1;
                h.beta2 = beta2;
                h.eps = eps;
                h.weight_decay = weight_decay;
                h.step = step;
                h.inv_loss_scale = inv_loss_scale;
                h.clip_coef = clip_coef;
                const DType gdt = to_dtype(grad_dtype), odt = to_dtype(out_dtype), mdt = to_dtype(moment_dtype);
                if (!moment_dtype_supported(mdt))
                    throw py::value_error(std::string("fused Adam: moments in ") + dtype_name(mdt) +
                                          " are not supported (fp32, bf16 or fp16)");
                float scales[4] = {1.0f, 1.0f, 1.0f, 1.0f};
                if (!moment_scales.is_none()) {
                    const auto given = moment_scales.cast<py::sequence>();
                    if (py::len(given) != 4)
                        throw py::value_error("fused Adam: moment_scales takes 4 floats (m_scale, v_scale, m_rscale, "
                                              "v_rscale), got " + std::to_string(py::len(given)));
                    for (int i = 0; i < 4; ++i) scales[i] = given[i].cast<float>();
                }
                std::uint32_t crcs[3] = {0, 0, 0}, in_crcs[3] = {0, 0, 0};
                int rc;
                {
                    py::gil_scoped_release release;
                    rc = a.step(h, ptr<float>(param), ptr<void>(exp_avg), ptr<void>(exp_avg_sq),
                                ptr<const void>(grad), gdt, out ? ptr<void>(out) : nullptr, odt, n, num_threads,
                                checksums ? crcs : nullptr, input_checksums ? in_crcs : nullptr, mdt, scales);
                }
                check(rc, "fused Adam step");
                py::object after = checksums ? py::object(py::make_tuple(crcs[0], crcs[1], crcs[2])) : py::none();
                if (!input_checksums) return after;
                return py::make_tuple(py::make_tuple(in_crcs[0], in_crcs[1], in_crcs[2]), after);
            },
            py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("grad_dtype"),
            py::arg("out"), py::arg("out_dtype"), py::arg("numel"), py::arg("lr"), py::arg("beta1"),
            py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
            py::arg("inv_loss_scale"), py::arg("clip_coef"), py::arg("num_threads"), py::arg("checksums") = false,
            py::arg("input_checksums") = false, py::arg("moment_dtype") = 0, py::arg("moment_scales") = py::none(),
            "One AdamW step (exp_avg and exp_avg_sq in moment_dtype: 0 fp32, 1 bf16, 2 fp16 scaled per tensor by "
            "moment_scales = (m_scale, v_scale, m_rscale, v_rscale), the scales the stored moments were written with "
            "and the reciprocals of the new ones); with checksums=True returns the CRC-32C of the updated (param, exp_avg, "
            "exp_avg_sq), computed while each tile is in cache, else None; with input_checksums=True "
            "returns (CRC-32C of the three before the update, that result).")
        .def(
            "moments_absmax",
            [](CpuAdam& a, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::uintptr_t grad, int grad_dtype,
               std::size_t n, double beta1, double beta2, double inv_loss_scale, double clip_coef, float m_scale,
               float v_scale, int num_threads) {
                AdamHyper h;
                h.beta1 = beta1;
                h.beta2 = beta2;
                h.inv_loss_scale = inv_loss_scale;
                h.clip_coef = clip_coef;
                const float scales[2] = {m_scale, v_scale};
                float absmax[2] = {0.0f, 0.0f};
                int rc;
                {
                    py::gil_scoped_release release;
                    rc = a.moments_absmax(h, scales, ptr<const std::uint16_t>(exp_avg),
                                          ptr<const std::uint16_t>(exp_avg_sq), ptr<const void>(grad),
                                          to_dtype(grad_dtype), n, absmax, num_threads);
                }
                check(rc, "moments absmax");
                return py::make_tuple(absmax[0], absmax[1]);
            },
            py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("grad_dtype"), py::arg("numel"),
            py::arg("beta1"), py::arg("beta2"), py::arg("inv_loss_scale"), py::arg("clip_coef"), py::arg("m_scale"),
            py::arg("v_scale"), py::arg("num_threads") = 0,
            "(absmax of the new exp_avg, of the new exp_avg_sq) that step() with fp16 moments would compute from "
            "these fp16 moments (written with m_scale, v_scale) and grad; NaN where any is NaN. Stores nothing.")
        .def(
            "grad_stats",
            [](CpuAdam& a, std::uintptr_t grad, int dtype, std::size_t n, int num_threads) {
                GradStats st;
                int rc;
                {
                    py::gil_scoped_release release;
                    rc = a.grad_stats(ptr<const void>(grad), to_dtype(dtype), n, &st, num_threads);
                }
                check(rc, "grad_stats");
                return py::make_tuple(st.sum_of_squares, st.found_nonfinite);
            },
            py::arg("grad"), py::arg("dtype"), py::arg("numel"), py::arg("num_threads") = 0)
        .def(
            "copy",
            [](CpuAdam& a, std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, int num_threads) {
                int rc;
                {
                    py::gil_scoped_release release;
                    rc = a.copy(ptr<void>(dst), ptr<const void>(src), nbytes, num_threads);
                }
                check(rc, "copy");
            },
            py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("num_threads") = 0,
            "memcpy split over the pool (the bandwidth bound of bench adam).")
        .def(
            "traffic",
            [](CpuAdam& a, std::uintptr_t param, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
               std::uintptr_t grad, int grad_dtype, std::uintptr_t out, int out_dtype, std::size_t n,
               int num_threads) {
                const DType gdt = to_dtype(grad_dtype), odt = to_dtype(out_dtype);
                int rc;
                {
                    py::gil_scoped_release release;
                    rc = a.traffic(ptr<float>(param), ptr<float>(exp_avg), ptr<float>(exp_avg_sq),
                                   ptr<const void>(grad), gdt, out ? ptr<void>(out) : nullptr, odt, n, num_threads);
                }
                check(rc, "traffic");
            },
            py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("grad_dtype"),
            py::arg("out"), py::arg("out_dtype"), py::arg("numel"), py::arg("num_threads") = 0,
            "The fused step's reads and writes with no arithmetic (the upper bound of bench adam).")
        .def(
            "sqrt",
            [](CpuAdam& a, std::uintptr_t in, std::uintptr_t out, std::size_t n) {
                int rc;
                {
                    py::gil_scoped_release release;
                    rc = sqrt_range(a.isa(), a.sqrt_mode(), ptr<const float>(in), ptr<float>(out), n);
                }
                check(rc, "sqrt");
            },
            "The kernel's sqrt over n floats (detects which sqrt the installed torch computes).");

    m.def("crc32c_isa_supported", [](const std::string& name) {
        if (name == "vpclmul") return crc32c_vpclmul_supported();
        if (name == "sse42") return crc32c_hw_supported();
        if (name == "software") return true;
        throw py::value_error("crc32c implementation must be 'vpclmul', 'sse42' or 'software', got '" + name + "'");
    });
    m.def("crc32c_combine", &crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"),
          "CRC-32C of A||B from crc32c(A), crc32c(B) and len(B).");
    m.def(
        "crc32c",
        [](std::uintptr_t addr, std::size_t nbytes, std::uint32_t seed, const std::string& impl) {
            Crc32cImpl which = Crc32cImpl::kAuto;
            if (impl == "vpclmul") {
                if (!crc32c_vpclmul_supported())
                    throw py::value_error("crc32c: this CPU has no AVX-512 VPCLMULQDQ");
                which = Crc32cImpl::kVpclmul;
            } else if (impl == "sse42") {
                if (!crc32c_hw_supported()) throw py::value_error("crc32c: this CPU has no SSE4.2 crc32 instruction");
                which = Crc32cImpl::kSse42;
            } else if (impl == "software") {
                which = Crc32cImpl::kSoftware;
            } else if (impl != "auto") {
                throw py::value_error("crc32c implementation must be 'auto', 'vpclmul', 'sse42' or 'software', got '" +
                                      impl + "'");
            }
            std::uint32_t crc;
            {
                py::gil_scoped_release release;
                crc = crc32c(ptr<const void>(addr), nbytes, seed, which);
            }
            return crc;
        },
        py::arg("addr"), py::arg("nbytes"), py::arg("seed") = 0, py::arg("impl") = "auto");
}

}  // namespace mlp::python
