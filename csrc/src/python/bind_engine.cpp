#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace mlp::python {
void bind_engine(py::module_& m) { (void)m; }  // placeholder until the engine lands
}  // namespace mlp::python
