#include "mlp/engine.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace mlp {

// ---------------------------------------------------------------------------------------------
// Request

bool Request::done() const {
    std::lock_guard<std::mutex> lk(mu_);
    return done_;
}

bool Request::wait(double timeout_s) const {
    std::unique_lock<std::mutex> lk(mu_);
    if (timeout_s < 0) {
        cv_.wait(lk, [this] { return done_; });
        return true;
    }
    return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [this] { return done_; });
}

uint64_t Request::bytes() const {
    std::lock_guard<std::mutex> lk(mu_);
    return bytes_final_;
}

Status Request::status() const {
    std::lock_guard<std::mutex> lk(mu_);
    return status_;
}

void Request::finish(Status st, uint64_t bytes) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        status_ = std::move(st);
        bytes_final_ = bytes;
        done_ = true;
    }
    cv_.notify_all();
}

// ---------------------------------------------------------------------------------------------
// Engine

namespace {

unsigned next_pow2(unsigned v) {
    unsigned p = 1;
    while (p < v) p <<= 1;
    return p;
}

const char* op_name(Op op) { return op == Op::kRead ? "read" : "write"; }

// A transfer the kernel keeps refusing with EAGAIN is failed rather than retried forever.
constexpr int kMaxAttempts = 10000;

}  // namespace

Engine::Engine(const EngineOptions& opts) : opts_(opts), t0_(std::chrono::steady_clock::now()) {
    if (opts_.block_bytes == 0 || !is_aligned(opts_.block_bytes) || opts_.block_bytes > (1ull << 30)) {
        throw std::invalid_argument("block_bytes must be a positive multiple of 4096 and at most 1 GiB, got " +
                                    std::to_string(opts_.block_bytes));
    }
    if (opts_.queue_depth == 0 || opts_.queue_depth > 4096) {
        throw std::invalid_argument("queue_depth must be in [1, 4096], got " + std::to_string(opts_.queue_depth));
    }
    if (opts_.num_threads == 0 || opts_.num_threads > 1024) {
        throw std::invalid_argument("num_threads must be in [1, 1024], got " + std::to_string(opts_.num_threads));
    }
    const std::string& want = opts_.backend;
    if (want != "auto" && want != "io_uring" && want != "threads") {
        throw std::invalid_argument("backend must be 'auto', 'io_uring' or 'threads', got '" + want + "'");
    }
    CompletionFn cb = [this](const IOCompletion* c, size_t n) { on_complete(c, n); };
    if (want == "auto" || want == "io_uring") {
        std::string reason;
        backend_ = make_io_uring_backend(next_pow2(opts_.queue_depth + 1), cb, &reason,
                                         opts_.simulate_io_uring_error);
        if (!backend_) {
            if (want == "io_uring") throw std::runtime_error("io_uring backend unavailable: " + reason);
            fallback_reason_ = reason;
        }
    }
    if (!backend_) backend_ = make_thread_pool_backend(opts_.num_threads, cb);
    backend_name_ = backend_->name();

    for (int d = 0; d < 2; ++d) {
        const uint64_t rate = d == 0 ? opts_.read_limit_bytes_per_s : opts_.write_limit_bytes_per_s;
        // At most 50 ms of credit: absorbs a late timer wake-up on a loaded machine, yet stays
        // small against the second-long transfers a capped tier serves.
        caps_[d] = TokenBucket(rate, std::max<uint64_t>(rate / 20, kAlignment));
    }
    slots_.resize(opts_.queue_depth);
    bounce_.resize(opts_.queue_depth);
    for (size_t i = opts_.queue_depth; i-- > 0;) free_slots_.push_back(i);
    timer_ = std::thread([this] { run(); });
}

Engine::~Engine() { close(); }

double Engine::now_s() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

bool Engine::closed() const {
    std::lock_guard<std::mutex> lk(mu_);
    return stop_;
}

std::shared_ptr<Request> Engine::submit(Op op, const std::shared_ptr<File>& file, void* buf,
                                        uint64_t length, uint64_t offset) {
    auto req = std::make_shared<Request>();
    req->op_ = op;
    req->offset_ = offset;
    req->length_ = length;
    if (!file) {
        req->finish(Status::Error(EBADF, std::string(op_name(op)) + " on a null file handle"), 0);
        return req;
    }
    req->path_ = file->path();
    auto fds = file->descriptors();
    if (!fds) {
        req->finish(Status::Error(EBADF, std::string(op_name(op)) + " on a closed file handle"), 0);
        return req;
    }
    if (op == Op::kWrite && file->read_only()) {
        req->finish(Status::Error(EBADF, "write to a file opened read-only"), 0);
        return req;
    }
    if (buf == nullptr && length > 0) {
        req->finish(Status::Error(EINVAL, "null buffer"), 0);
        return req;
    }
    if (length == 0) {
        req->finish(Status::Ok(), 0);
        return req;
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
        req->finish(Status::Error(ESHUTDOWN, std::string(op_name(op)) + " submitted to a closed engine"), 0);
        return req;
    }
    req->buf_ = static_cast<char*>(buf);
    req->fds_ = std::move(fds);
    req->direct_ = req->fds_->direct_fd >= 0;
    req->fault_ = faults_.on_request(op, req->path_);

    // Tasks of block_bytes; when O_DIRECT is in use, a final piece that is not a multiple of
    // 4096 is split into its aligned body (O_DIRECT) and a tail of < 4096 bytes (buffered fd).
    auto& q = pending_[static_cast<int>(op)];
    const uint64_t block = opts_.block_bytes;
    uint64_t pos = 0;
    size_t n = 0;
    while (pos < length) {
        uint64_t len = std::min(block, length - pos);
        if (req->direct_ && pos + len == length && len > kAlignment && !is_aligned(len)) {
            const uint64_t body = len - len % kAlignment;
            q.push_back(Task{req, pos, body, 0, n == 0, 0});
            ++n;
            pos += body;
            len -= body;
        }
        q.push_back(Task{req, pos, len, 0, n == 0, 0});
        ++n;
        pos += len;
    }
    req->tasks_left_ = n;
    ++active_requests_;
    pump_locked();
    return req;
}

char* Engine::bounce_slot(size_t i) {
    if (bounce_[i].data() == nullptr) {
        int err = 0;
        bounce_[i] = AlignedBuffer::allocate(opts_.block_bytes, false, &err);
    }
    return static_cast<char*>(bounce_[i].data());
}

double Engine::fill_locked(std::vector<IOTask>* batch) {
    double wait = 0;
    bool progress = true;
    while (progress && !free_slots_.empty()) {
        progress = false;
        for (int d = 0; d < 2 && !free_slots_.empty(); ++d) {
            auto& q = pending_[d];
            // Tasks of a request that already failed are dropped, not issued.
            while (!q.empty() && !q.front().req->first_error_.ok()) {
                auto r = std::move(q.front().req);
                q.pop_front();
                task_finished_locked(r);
            }
            if (q.empty()) continue;
            const double now = now_s();
            const double d_wait = caps_[d].try_consume(now, q.front().len - q.front().done);
            if (d_wait > 0) {
                wait = wait == 0 ? d_wait : std::min(wait, d_wait);
                continue;
            }
            Task task = std::move(q.front());
            q.pop_front();
            progress = true;

            const size_t s = free_slots_.back();
            free_slots_.pop_back();
            Request& r = *task.req;
            uint64_t off = r.offset_ + task.rel + task.done;
            uint64_t len = task.len - task.done;
            char* ptr = r.buf_ + task.rel + task.done;
            bool direct = r.direct_ && is_aligned(off) && is_aligned(len);
            int injected = 0;
            if (task.first && task.attempts == 0 && r.fault_.any()) {
                if (r.fault_.err != 0) {
                    injected = r.fault_.err;
                } else if (r.fault_.short_io && len >= 2) {
                    uint64_t shorter = direct ? (len / 2) / kAlignment * kAlignment : len / 2;
                    if (shorter == 0) {  // cannot shorten an aligned transfer: take the buffered fd
                        shorter = len / 2;
                        direct = false;
                    }
                    len = shorter;
                }
            }
            bool bounced = false;
            if (direct && !is_aligned(reinterpret_cast<uintptr_t>(ptr))) {
                // Unaligned user memory: O_DIRECT through this slot's aligned bounce block.
                char* b = bounce_slot(s);
                if (b == nullptr) {
                    injected = ENOMEM;
                } else {
                    if (r.op_ == Op::kWrite) std::memcpy(b, ptr, len);
                    ptr = b;
                    bounced = true;
                }
            }
            task.attempts++;
            Slot& sl = slots_[s];
            sl.busy = true;
            sl.issued_len = len;
            sl.bounced = bounced;
            sl.direct = direct;
            sl.injected = injected;
            const int fd = direct ? r.fds_->direct_fd : r.fds_->buffered_fd;
            const bool write = r.op_ == Op::kWrite;
            sl.task = std::move(task);
            if (inflight_++ == 0) busy_since_ = now;
            if (injected != 0) {
                completions_.push_back(IOCompletion{s, -static_cast<int64_t>(injected)});
                continue;
            }
            stats_.tasks++;
            if (bounced) stats_.bounced_tasks++;
            if (direct) stats_.direct_tasks++; else stats_.buffered_tasks++;
            batch->push_back(IOTask{fd, write, ptr, static_cast<uint32_t>(len), off, s});
        }
    }
    return wait;
}

void Engine::on_complete(const IOCompletion* c, size_t n) {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < n; ++i) handle_completion_locked(c[i]);
    pump_locked();
}

void Engine::pump_locked() {
    for (;;) {
        while (!completions_.empty()) {
            local_.swap(completions_);
            for (const auto& c : local_) handle_completion_locked(c);
            local_.clear();
        }
        batch_.clear();
        const double wait = fill_locked(&batch_);
        if (!batch_.empty()) {
            const int r = backend_->submit(batch_.data(), batch_.size());
            if (r < 0) {
                for (const auto& t : batch_) completions_.push_back(IOCompletion{t.tag, r});
            }
        }
        if (completions_.empty()) {
            // Wake the timer when it is idle or sleeping longer than this cap now needs.
            if (wait > 0 && (throttle_wait_s_ == 0 || wait < throttle_wait_s_)) cv_.notify_one();
            throttle_wait_s_ = wait;
            return;
        }
    }
}

void Engine::fail_locked(const std::shared_ptr<Request>& req, int err, const std::string& what, uint64_t at) {
    if (req->first_error_.ok()) {
        req->first_error_ = Status::Error(err, what + " at file offset " + std::to_string(at));
    }
}

void Engine::task_finished_locked(const std::shared_ptr<Request>& req) {
    if (--req->tasks_left_ > 0) return;
    if (req->op_ == Op::kRead) stats_.read_requests++; else stats_.write_requests++;
    if (!req->first_error_.ok()) stats_.failed_requests++;
    req->fds_.reset();
    req->buf_ = nullptr;
    req->finish(req->first_error_, req->bytes_done_);
    if (--active_requests_ == 0) idle_cv_.notify_all();
}

void Engine::handle_completion_locked(const IOCompletion& c) {
    Slot& sl = slots_[c.tag];
    Task task = std::move(sl.task);
    sl.busy = false;
    free_slots_.push_back(c.tag);
    if (--inflight_ == 0) stats_.busy_s += now_s() - busy_since_;

    auto req = task.req;
    Request& r = *req;
    const int d = static_cast<int>(r.op_);
    const uint64_t off = r.offset_ + task.rel + task.done;
    const int64_t res = c.result;
    const bool read = r.op_ == Op::kRead;

    if ((res == -EAGAIN || res == -EINTR) && task.attempts < kMaxAttempts) {
        stats_.retries++;
        pending_[d].push_front(std::move(task));
        return;
    }
    if (res < 0) {
        fail_locked(req, static_cast<int>(-res),
                    std::string(read ? "read" : "write") + " of " + std::to_string(sl.issued_len) +
                        " bytes failed" + (sl.injected ? " (injected fault)" : ""),
                    off);
        task_finished_locked(req);
        return;
    }
    if (res == 0) {
        if (read) {
            fail_locked(req, ENODATA,
                        "short read: end of file after " + std::to_string(r.bytes_done_) + " of " +
                            std::to_string(r.length_) + " bytes were read; the file ends",
                        off);
        } else {
            fail_locked(req, EIO, "write made no progress", off);
        }
        task_finished_locked(req);
        return;
    }
    if (!r.first_error_.ok()) {  // another task of this request failed: finish quietly
        task_finished_locked(req);
        return;
    }
    if (read && sl.bounced) std::memcpy(r.buf_ + task.rel + task.done, bounce_[c.tag].data(), res);
    task.done += res;
    r.bytes_done_ += res;
    if (read) stats_.bytes_read += res; else stats_.bytes_written += res;
    if (task.done < task.len) {  // short transfer: the remainder goes first
        stats_.retries++;
        pending_[d].push_front(std::move(task));
        return;
    }
    task_finished_locked(req);
}

void Engine::run() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
        if (exit_) return;
        if (throttle_wait_s_ > 0) {
            const double t = now_s();
            cv_.wait_for(lk, std::chrono::duration<double>(throttle_wait_s_));
            stats_.throttle_s += now_s() - t;
            pump_locked();
        } else {
            cv_.wait(lk);
        }
    }
}

bool Engine::wait_all(double timeout_s) {
    std::unique_lock<std::mutex> lk(mu_);
    auto idle = [this] { return active_requests_ == 0; };
    if (timeout_s < 0) {
        idle_cv_.wait(lk, idle);
        return true;
    }
    return idle_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), idle);
}

void Engine::close() {
    std::lock_guard<std::mutex> guard(close_mu_);
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (closed_) return;
        stop_ = true;  // refuse new requests; queued and in-flight ones run to completion
    }
    wait_all(-1);
    {
        std::lock_guard<std::mutex> lk(mu_);
        exit_ = true;
    }
    cv_.notify_all();
    if (timer_.joinable()) timer_.join();
    backend_.reset();  // joins the backend's threads; nothing is in flight any more
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
    bounce_.clear();
}

EngineStats Engine::stats() const {
    std::lock_guard<std::mutex> lk(mu_);
    EngineStats s = stats_;
    if (inflight_ > 0) s.busy_s += now_s() - busy_since_;
    return s;
}

void Engine::inject_fault(const FaultRule& rule) {
    std::lock_guard<std::mutex> lk(mu_);
    faults_.add(rule);
}

void Engine::clear_faults() {
    std::lock_guard<std::mutex> lk(mu_);
    faults_.clear();
}

}  // namespace mlp
