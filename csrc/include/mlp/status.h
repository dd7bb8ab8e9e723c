// Error values of the I/O core. The hot loop never throws: it returns -errno and a Status
// travels with each request to the binding layer, which turns it into a Python exception.
#pragma once

#include <cerrno>
#include <string>

namespace mlp {

struct Status {
    int err = 0;          // errno value, 0 = success
    std::string message;  // what failed and where (path, byte range)

    bool ok() const { return err == 0; }
    static Status Ok() { return {}; }
    static Status Error(int e, std::string msg) { return {e, std::move(msg)}; }
};

// strerror_r wrapper that is thread-safe and independent of the GNU/XSI variant.
std::string errno_name(int err);

}  // namespace mlp
