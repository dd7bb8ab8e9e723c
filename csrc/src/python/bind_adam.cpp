#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace mlp::python {
void bind_adam(py::module_& m) { (void)m; }  // placeholder until the adam lands
}  // namespace mlp::python
