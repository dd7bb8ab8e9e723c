// Shared helpers of the engine sanitizer tests: a scratch directory and byte patterns.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "mlp/engine.h"

namespace mlp_test {

class ScratchDir {
public:
    ScratchDir() {
        const char* base = std::getenv("MLP_TEST_DISK_DIR");
        std::string tmpl = std::string(base ? base : "/var/tmp") + "/mlp-cpp-test-XXXXXX";
        std::vector<char> buf(tmpl.begin(), tmpl.end());
        buf.push_back('\0');
        if (mkdtemp(buf.data()) == nullptr) std::abort();
        path_ = buf.data();
    }
    ~ScratchDir() {
        for (auto& f : files_) ::unlink(f.c_str());
        ::rmdir(path_.c_str());
    }
    std::string file(const std::string& name) {
        files_.push_back(path_ + "/" + name);
        return files_.back();
    }

private:
    std::string path_;
    std::vector<std::string> files_;
};

inline void fill(uint8_t* p, size_t n, uint32_t seed) {
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; ++i) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        p[i] = static_cast<uint8_t>(x);
    }
}

inline std::vector<std::string> backends() {
    std::vector<std::string> b{"threads"};
    std::string reason;
    if (mlp::make_io_uring_backend(4, [](const mlp::IOCompletion*, size_t) {}, &reason)) b.push_back("io_uring");
    return b;
}

inline mlp::EngineOptions opts(const std::string& backend, uint64_t block = 64 << 10, unsigned qd = 4) {
    mlp::EngineOptions o;
    o.backend = backend;
    o.block_bytes = block;
    o.queue_depth = qd;
    o.num_threads = 3;
    return o;
}

}  // namespace mlp_test
