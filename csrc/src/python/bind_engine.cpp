// Python bindings of the I/O engine. The core takes addresses and sizes; turning numpy arrays,
// torch tensors and HostBuffers into addresses, keeping them alive, and raising TierIOError
// with errno/path/offset/length is done by the thin Python layer in megatron_mlp/engine/.
// Every call that can block releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "mlp/aligned_buffer.h"
#include "mlp/engine.h"

namespace py = pybind11;

namespace mlp::python {
namespace {

// An engine-allocated host buffer exposed through the buffer protocol (1-D, uint8, writable),
// so numpy.frombuffer / torch.frombuffer view it without copying and keep it alive.
class PyHostBuffer {
public:
    explicit PyHostBuffer(AlignedBuffer b) : buf_(std::move(b)) {}
    ~PyHostBuffer() {
        // Runs with the GIL held (pybind11 dealloc). The hook (e.g. cudaHostUnregister) must
        // run before the memory is unmapped by buf_'s destructor.
        if (hook_ && !hook_.is_none()) {
            try {
                hook_();
            } catch (py::error_already_set& e) {
                e.discard_as_unraisable("HostBuffer release hook");
            }
        }
    }
    AlignedBuffer buf_;
    py::object hook_;
};

py::dict stats_dict(const EngineStats& s) {
    py::dict d;
    d["bytes_read"] = s.bytes_read;
    d["bytes_written"] = s.bytes_written;
    d["read_requests"] = s.read_requests;
    d["write_requests"] = s.write_requests;
    d["requests"] = s.read_requests + s.write_requests;
    d["failed_requests"] = s.failed_requests;
    d["tasks"] = s.tasks;
    d["direct_tasks"] = s.direct_tasks;
    d["buffered_tasks"] = s.buffered_tasks;
    d["bounced_tasks"] = s.bounced_tasks;
    d["retries"] = s.retries;
    d["busy_s"] = s.busy_s;
    d["throttle_s"] = s.throttle_s;
    return d;
}

}  // namespace

void bind_engine(py::module_& m) {
    py::class_<PyHostBuffer>(m, "HostBuffer", py::buffer_protocol())
        .def_buffer([](PyHostBuffer& b) {
            return py::buffer_info(b.buf_.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(b.buf_.nbytes())}, {1});
        })
        .def_property_readonly("address", [](const PyHostBuffer& b) {
            return reinterpret_cast<uintptr_t>(b.buf_.data());
        })
        .def_property_readonly("nbytes", [](const PyHostBuffer& b) { return b.buf_.nbytes(); })
        .def_property_readonly("mapped_bytes", [](const PyHostBuffer& b) { return b.buf_.mapped_bytes(); })
        .def_property_readonly("locked", [](const PyHostBuffer& b) { return b.buf_.locked(); })
        .def_property_readonly("lock_errno", [](const PyHostBuffer& b) { return b.buf_.lock_error(); })
        .def("_set_release_hook", [](PyHostBuffer& b, py::object hook) { b.hook_ = std::move(hook); });

    m.def(
        "alloc_host_buffer",
        [](size_t nbytes, bool lock) {
            int err = 0;
            AlignedBuffer b;
            {
                py::gil_scoped_release nogil;  // mlock faults every page in
                b = AlignedBuffer::allocate(nbytes, lock, &err);
            }
            if (err != 0) {
                errno = err;
                PyErr_SetFromErrno(PyExc_OSError);
                throw py::error_already_set();
            }
            return std::make_unique<PyHostBuffer>(std::move(b));
        },
        py::arg("nbytes"), py::arg("lock") = true);

    py::class_<File, std::shared_ptr<File>>(m, "File")
        .def_property_readonly("path", &File::path)
        .def_property_readonly("direct", &File::direct)
        .def_property_readonly("direct_refused", &File::direct_refused)
        .def_property_readonly("read_only", &File::read_only)
        .def_property_readonly("closed", &File::closed)
        .def("close", &File::close)
        .def("size", [](const File& f) {
            int64_t n = -1;
            Status st = f.size(&n);
            return py::make_tuple(n, st.err, st.message);
        })
        .def("sync", [](const File& f) {
            Status st;
            {
                py::gil_scoped_release nogil;
                st = f.sync();
            }
            return py::make_tuple(st.err, st.message);
        })
        .def("allocate", [](const File& f, int64_t nbytes) {
            Status st;
            {
                py::gil_scoped_release nogil;
                st = f.allocate(nbytes);
            }
            return py::make_tuple(st.err, st.message);
        }, py::arg("nbytes"))
        .def("drop_page_cache", [](const File& f) {
            Status st = f.drop_page_cache();
            return py::make_tuple(st.err, st.message);
        });

    py::class_<Request, std::shared_ptr<Request>>(m, "Request")
        .def_property_readonly("is_write", [](const Request& r) { return r.op() == Op::kWrite; })
        .def_property_readonly("path", &Request::path)
        .def_property_readonly("offset", &Request::offset)
        .def_property_readonly("length", &Request::length)
        .def("done", &Request::done)
        .def("wait", &Request::wait, py::arg("timeout_s") = -1.0, py::call_guard<py::gil_scoped_release>())
        .def("result", [](const Request& r) {
            Status st = r.status();
            return py::make_tuple(r.bytes(), st.err, st.message);
        });

    py::class_<Engine>(m, "Engine")
        .def(py::init([](const std::string& backend, uint64_t block_bytes, unsigned queue_depth,
                         unsigned num_threads, uint64_t read_limit, uint64_t write_limit, int simulate) {
                 EngineOptions o;
                 o.backend = backend;
                 o.block_bytes = block_bytes;
                 o.queue_depth = queue_depth;
                 o.num_threads = num_threads;
                 o.read_limit_bytes_per_s = read_limit;
                 o.write_limit_bytes_per_s = write_limit;
                 o.simulate_io_uring_error = simulate;
                 return std::make_unique<Engine>(o);
             }),
             py::arg("backend"), py::arg("block_bytes"), py::arg("queue_depth"), py::arg("num_threads"),
             py::arg("read_limit_bytes_per_s"), py::arg("write_limit_bytes_per_s"),
             py::arg("simulate_io_uring_error") = 0)
        .def_property_readonly("backend", &Engine::backend)
        .def_property_readonly("fallback_reason", &Engine::fallback_reason)
        .def_property_readonly("closed", &Engine::closed)
        .def(
            "open",
            [](Engine& e, const std::string& path, bool create, bool truncate, bool read_only, bool direct,
               bool refuse_direct, bool exclusive, int dir_fd) {
                OpenOptions o;
                o.dir_fd = dir_fd;
                o.create = create;
                o.exclusive = exclusive;
                o.truncate = truncate;
                o.read_only = read_only;
                o.direct = direct;
                o.refuse_direct = refuse_direct;
                Status st;
                std::shared_ptr<File> f;
                {
                    py::gil_scoped_release nogil;
                    f = e.open(path, o, &st);
                }
                return py::make_tuple(f, st.err, st.message);
            },
            py::arg("path"), py::arg("create"), py::arg("truncate"), py::arg("read_only"), py::arg("direct"),
            py::arg("refuse_direct"), py::arg("exclusive") = false, py::arg("dir_fd") = AT_FDCWD)
        .def(
            "submit",
            [](Engine& e, bool write, const std::shared_ptr<File>& f, uintptr_t address, uint64_t length,
               uint64_t offset) {
                return e.submit(write ? Op::kWrite : Op::kRead, f, reinterpret_cast<void*>(address), length,
                                offset);
            },
            py::arg("write"), py::arg("file"), py::arg("address"), py::arg("length"), py::arg("offset"),
            py::call_guard<py::gil_scoped_release>())
        .def("wait_all", &Engine::wait_all, py::arg("timeout_s") = -1.0, py::call_guard<py::gil_scoped_release>())
        .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
        .def("stats", [](const Engine& e) { return stats_dict(e.stats()); })
        .def(
            "inject_fault",
            [](Engine& e, int op, uint64_t nth, bool every, int err, bool short_io, const std::string& path_contains) {
                FaultRule r;
                r.op = op;
                r.nth = nth;
                r.every = every;
                r.err = err;
                r.short_io = short_io;
                r.path_contains = path_contains;
                e.inject_fault(r);
            },
            py::arg("op"), py::arg("nth"), py::arg("every"), py::arg("err"), py::arg("short_io"),
            py::arg("path_contains"))
        .def("clear_faults", &Engine::clear_faults);
}

}  // namespace mlp::python
