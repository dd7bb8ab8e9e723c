// The only translation units that see Python live in csrc/src/python/.
// Each component registers itself into the one extension module `megatron_mlp._C`.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace mlp::python {
void bind_engine(py::module_& m);  // bind_engine.cpp
void bind_adam(py::module_& m);    // bind_adam.cpp
}  // namespace mlp::python

PYBIND11_MODULE(_C, m) {
    m.doc() = "megatron_mlp C++ core: multi-path async I/O engine and fused CPU Adam";
    mlp::python::bind_engine(m);
    mlp::python::bind_adam(m);
}
