// mlp::Engine: asynchronous reads and writes of host memory to files at offsets.
//
// One Engine owns its backend (io_uring ring or thread pool), its timer thread, its bounce
// buffers, its bandwidth caps and its fault injector: no global state. A request is split into
// tasks of block_bytes; at most queue_depth tasks are in flight. Completions are handled and new
// tasks are issued under the engine lock by whichever thread holds it; a timer thread resumes
// issuing when a bandwidth cap held tasks back.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mlp/aligned_buffer.h"
#include "mlp/fault_injection.h"
#include "mlp/file.h"
#include "mlp/io_backend.h"
#include "mlp/status.h"
#include "mlp/token_bucket.h"

namespace mlp {

struct EngineOptions {
    std::string backend = "auto";  // "auto" | "io_uring" | "threads"
    // The I/O geometry of megatron_mlp.engine.defaults (why these values: see there); the Python
    // face always passes its own, tests/unit/test_engine_defaults.py keeps the two equal.
    uint64_t block_bytes = 8u << 20;
    unsigned queue_depth = 32;
    unsigned num_threads = 4;
    uint64_t read_limit_bytes_per_s = 0;   // 0 = uncapped
    uint64_t write_limit_bytes_per_s = 0;
    int simulate_io_uring_error = 0;       // tests: pretend io_uring_setup failed with this errno
};

struct EngineStats {
    uint64_t bytes_read = 0;
    uint64_t bytes_written = 0;
    uint64_t read_requests = 0;    // completed (successfully or not)
    uint64_t write_requests = 0;
    uint64_t failed_requests = 0;
    uint64_t tasks = 0;            // transfers issued to the backend (incl. retries)
    uint64_t direct_tasks = 0;     // ... through the O_DIRECT descriptor
    uint64_t buffered_tasks = 0;   // ... through the buffered descriptor (tails, unaligned, no O_DIRECT)
    uint64_t bounced_tasks = 0;    // ... O_DIRECT through a bounce buffer (unaligned user memory)
    uint64_t retries = 0;          // short transfers and EAGAIN re-queued
    double busy_s = 0;             // wall time with at least one transfer in flight
    double throttle_s = 0;         // wall time tasks waited for a bandwidth cap
};

class Engine;

// Handle of one submitted read or write. Outlives the engine safely.
class Request {
public:
    Op op() const { return op_; }
    const std::string& path() const { return path_; }
    uint64_t offset() const { return offset_; }
    uint64_t length() const { return length_; }

    bool done() const;
    // timeout_s < 0 waits forever. Returns whether the request is done.
    bool wait(double timeout_s) const;
    // Valid once done(): bytes transferred (== length on success) and the status.
    uint64_t bytes() const;
    Status status() const;

private:
    friend class Engine;
    void finish(Status st, uint64_t bytes);

    Op op_ = Op::kRead;
    std::string path_;
    uint64_t offset_ = 0;
    uint64_t length_ = 0;
    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
    bool done_ = false;
    uint64_t bytes_final_ = 0;
    Status status_;

    // Engine bookkeeping, guarded by Engine::mu_.
    char* buf_ = nullptr;
    std::shared_ptr<FileDescriptors> fds_;
    bool direct_ = false;
    size_t tasks_left_ = 0;
    uint64_t bytes_done_ = 0;
    Status first_error_;
    FaultAction fault_;
};

class Engine {
public:
    // Throws std::invalid_argument for bad options and std::runtime_error when an explicitly
    // requested backend is unavailable (these run once, at construction, not in the hot loop).
    explicit Engine(const EngineOptions& opts);
    ~Engine();  // close()
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    const std::string& backend() const { return backend_name_; }
    const std::string& fallback_reason() const { return fallback_reason_; }
    const EngineOptions& options() const { return opts_; }

    std::shared_ptr<File> open(const std::string& path, const OpenOptions& o, Status* st) {
        return File::open(path, o, st);
    }

    // Never throws. A request that cannot start (closed file, engine closed, read-only file)
    // is returned already finished with its error.
    std::shared_ptr<Request> submit(Op op, const std::shared_ptr<File>& file, void* buf,
                                    uint64_t length, uint64_t offset);

    // Waits until every submitted request has finished. timeout_s < 0: forever.
    bool wait_all(double timeout_s = -1);
    // Lets in-flight and queued I/O finish, then stops the threads. Idempotent.
    void close();
    bool closed() const;

    EngineStats stats() const;
    void inject_fault(const FaultRule& rule);
    void clear_faults();

private:
    struct Task {
        std::shared_ptr<Request> req;
        uint64_t rel = 0;      // offset of the task within the request
        uint64_t len = 0;
        uint64_t done = 0;     // bytes already transferred (short transfers)
        bool first = false;    // the request's first task: where injected faults land
        int attempts = 0;
    };
    struct Slot {
        bool busy = false;
        Task task;
        uint64_t issued_len = 0;
        bool bounced = false;
        bool direct = false;
        int injected = 0;      // errno injected instead of issuing a transfer
    };

    void run();  // the timer thread: resumes issuing when a bandwidth cap allows it again
    // Handles pending completions and issues whatever depth and caps allow, from whichever thread
    // holds mu_ (submitter, backend completion thread, timer), so a completion refills the queue
    // without a thread hop.
    void pump_locked();
    double now_s() const;
    // Issues as many pending tasks as queue depth and caps allow; returns seconds until a
    // capped direction may go again (0 when nothing waits on a cap).
    double fill_locked(std::vector<IOTask>* batch);
    void on_complete(const IOCompletion* c, size_t n);
    void handle_completion_locked(const IOCompletion& c);
    void task_finished_locked(const std::shared_ptr<Request>& req);
    void fail_locked(const std::shared_ptr<Request>& req, int err, const std::string& what,
                     uint64_t at);
    char* bounce_slot(size_t i);

    EngineOptions opts_;
    std::string backend_name_;
    std::string fallback_reason_;
    std::unique_ptr<IOBackend> backend_;

    mutable std::mutex mu_;
    std::condition_variable cv_;       // wakes the timer thread
    std::condition_variable idle_cv_;  // wakes wait_all()
    std::deque<Task> pending_[2];      // per direction, FIFO; retries go to the front
    std::vector<Slot> slots_;          // queue_depth slots; index == tag
    std::vector<size_t> free_slots_;
    std::vector<IOCompletion> completions_;  // injected faults and refused submissions
    std::vector<IOCompletion> local_;
    std::vector<IOTask> batch_;
    double throttle_wait_s_ = 0;  // > 0: a capped direction has work; the timer thread retries
    std::vector<AlignedBuffer> bounce_;  // one block per slot, allocated on first use
    TokenBucket caps_[2];
    FaultInjector faults_;
    size_t inflight_ = 0;
    size_t active_requests_ = 0;
    bool stop_ = false;   // no new requests
    bool exit_ = false;   // timer thread leaves
    bool closed_ = false;
    EngineStats stats_;
    double busy_since_ = 0;
    std::chrono::steady_clock::time_point t0_;
    std::thread timer_;
    std::mutex close_mu_;
};

}  // namespace mlp
