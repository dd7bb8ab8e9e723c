// The contract both I/O backends implement: execute single positional transfers and report
// each one as (tag, bytes or -errno). Splitting, re-queueing short transfers and EAGAIN,
// bounding requests in flight, bandwidth caps and errors are the engine's job, so the two
// backends stay small and interchangeable.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace mlp {

struct IOTask {
    int fd = -1;
    bool write = false;
    void* buf = nullptr;
    uint32_t len = 0;
    uint64_t offset = 0;
    uint64_t tag = 0;
};

struct IOCompletion {
    uint64_t tag = 0;
    int64_t result = 0;  // bytes transferred (possibly short) or -errno
};

// Called from a backend thread, never with a backend lock held.
using CompletionFn = std::function<void(const IOCompletion* completions, size_t n)>;

class IOBackend {
public:
    virtual ~IOBackend() = default;  // all submitted tasks must have completed
    virtual const char* name() const = 0;
    // Queue n tasks. Called by one thread at a time. Returns 0 or -errno (nothing queued).
    virtual int submit(const IOTask* tasks, size_t n) = 0;
};

// Thread pool of pread/pwrite workers; always available.
std::unique_ptr<IOBackend> make_thread_pool_backend(unsigned num_threads, CompletionFn on_complete);

// io_uring through raw syscalls (no liburing). Returns nullptr and a human-readable reason when
// the kernel refuses (ENOSYS, io_uring_disabled sysctl, seccomp, missing opcodes): the caller
// then selects the thread pool. simulate_error != 0 pretends io_uring_setup failed with it.
std::unique_ptr<IOBackend> make_io_uring_backend(unsigned entries, CompletionFn on_complete,
                                                 std::string* reason, int simulate_error = 0);

}  // namespace mlp
