// Thread-pool backend: each worker performs one pread/pwrite per task. Works on every kernel
// and under any seccomp profile that allows pread/pwrite; it is the fallback for io_uring.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "mlp/io_backend.h"

namespace mlp {
namespace {

int64_t do_io(const IOTask& t) {
    for (;;) {
        ssize_t r = t.write ? ::pwrite(t.fd, t.buf, t.len, static_cast<off_t>(t.offset))
                            : ::pread(t.fd, t.buf, t.len, static_cast<off_t>(t.offset));
        if (r >= 0) return r;
        if (errno != EINTR) return -errno;
    }
}

class ThreadPoolBackend final : public IOBackend {
public:
    ThreadPoolBackend(unsigned n, CompletionFn fn) : on_complete_(std::move(fn)) {
        if (n == 0) n = 1;
        workers_.reserve(n);
        for (unsigned i = 0; i < n; ++i) workers_.emplace_back([this] { work(); });
    }

    ~ThreadPoolBackend() override {
        {
            std::lock_guard<std::mutex> lk(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& w : workers_) w.join();
    }

    const char* name() const override { return "threads"; }

    int submit(const IOTask* tasks, size_t n) override {
        {
            std::lock_guard<std::mutex> lk(mu_);
            for (size_t i = 0; i < n; ++i) queue_.push_back(tasks[i]);
        }
        if (n == 1) cv_.notify_one(); else cv_.notify_all();
        return 0;
    }

private:
    void work() {
        for (;;) {
            IOTask t;
            {
                std::unique_lock<std::mutex> lk(mu_);
                cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
                // Drain before stopping: the engine only destroys us with nothing in flight,
                // but never drop a task that was handed over.
                if (queue_.empty()) return;
                t = queue_.front();
                queue_.pop_front();
            }
            IOCompletion c{t.tag, do_io(t)};
            on_complete_(&c, 1);
        }
    }

    CompletionFn on_complete_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<IOTask> queue_;
    bool stop_ = false;
    std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IOBackend> make_thread_pool_backend(unsigned num_threads, CompletionFn on_complete) {
    return std::make_unique<ThreadPoolBackend>(num_threads, std::move(on_complete));
}

}  // namespace mlp
