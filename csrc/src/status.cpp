#include "mlp/status.h"

#include <cstring>

namespace mlp {

std::string errno_name(int err) {
    char buf[128];
    buf[0] = '\0';
    // The GNU variant returns a pointer that may or may not be buf; the XSI one returns int.
    auto r = strerror_r(err, buf, sizeof(buf));
    if constexpr (std::is_same_v<decltype(r), char*>) {
        return std::string(r);
    } else {
        return std::string(buf);
    }
}

}  // namespace mlp
