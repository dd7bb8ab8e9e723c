// Per-engine fault injection, for tests: make the Nth matching request (or every matching one)
// fail with a chosen errno, or come back short (the engine must then re-queue the remainder).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace mlp {

enum class Op : uint8_t { kRead = 0, kWrite = 1 };

struct FaultRule {
    int op = -1;              // -1 any, 0 read, 1 write
    uint64_t nth = 1;         // 1-based index among matching requests counted from injection
    bool every = false;       // every matching request from the nth on
    int err = 0;              // errno to fail with (EAGAIN: transient, the engine retries)
    bool short_io = false;    // first transfer of the request moves only part of its bytes
    std::string path_contains;  // empty = any path
};

struct FaultAction {
    int err = 0;
    bool short_io = false;
    bool any() const { return err != 0 || short_io; }
};

// Not thread-safe by itself: the engine calls it under its own lock.
class FaultInjector {
public:
    void add(FaultRule rule);
    void clear();
    // Called once per submitted request; returns what to do to it (usually nothing).
    FaultAction on_request(Op op, const std::string& path);

private:
    struct Entry {
        FaultRule rule;
        uint64_t seen = 0;
    };
    std::vector<Entry> rules_;
};

}  // namespace mlp
