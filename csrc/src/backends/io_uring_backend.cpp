// io_uring backend through raw syscalls against <linux/io_uring.h> (no liburing).
//
// One ring per engine. Entries are produced under the engine lock (one producer at a time);
// a reaper thread blocks in io_uring_enter(GETEVENTS) and hands completions back. Shutdown
// posts a NOP whose tag tells the reaper to leave.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "mlp/io_backend.h"
#include "mlp/status.h"

namespace mlp {
namespace {

constexpr uint64_t kWakeTag = ~0ull;

int sys_setup(unsigned entries, io_uring_params* p) {
    return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}
int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}
int sys_register(int fd, unsigned op, void* arg, unsigned nr) {
    return static_cast<int>(syscall(__NR_io_uring_register, fd, op, arg, nr));
}

template <typename T>
T load_acquire(const T* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
template <typename T>
void store_release(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

class IoUringBackend final : public IOBackend {
public:
    IoUringBackend(CompletionFn fn) : on_complete_(std::move(fn)) {}

    // Returns 0 or -errno with *reason filled in.
    int init(unsigned entries, std::string* reason, int simulate_error) {
        io_uring_params p;
        std::memset(&p, 0, sizeof(p));
        ring_fd_ = simulate_error ? (errno = simulate_error, -1) : sys_setup(entries, &p);
        if (ring_fd_ < 0) {
            const int e = errno;
            *reason = "io_uring_setup failed: " + errno_name(e) +
                      (e == EPERM || e == ENOSYS
                           ? " (io_uring disabled by the kernel.io_uring_disabled sysctl, seccomp or an old kernel)"
                           : "");
            return -e;
        }
        if (!(p.features & IORING_FEAT_SINGLE_MMAP)) {
            *reason = "io_uring lacks IORING_FEAT_SINGLE_MMAP (kernel older than 5.4)";
            return -EOPNOTSUPP;
        }
        // Probe the opcodes we use (IORING_OP_READ/WRITE appeared in 5.6).
        {
            const size_t sz = sizeof(io_uring_probe) + 256 * sizeof(io_uring_probe_op);
            std::vector<char> mem(sz, 0);
            auto* probe = reinterpret_cast<io_uring_probe*>(mem.data());
            if (sys_register(ring_fd_, IORING_REGISTER_PROBE, probe, 256) < 0) {
                *reason = "io_uring opcode probe failed: " + errno_name(errno) + " (kernel older than 5.6)";
                return -EOPNOTSUPP;
            }
            for (int op : {IORING_OP_READ, IORING_OP_WRITE, IORING_OP_NOP}) {
                if (op > probe->last_op || !(probe->ops[op].flags & IO_URING_OP_SUPPORTED)) {
                    *reason = "io_uring does not support opcode " + std::to_string(op);
                    return -EOPNOTSUPP;
                }
            }
        }
        sq_entries_ = p.sq_entries;
        ring_sz_ = std::max(p.sq_off.array + p.sq_entries * sizeof(unsigned),
                            p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe));
        ring_ = mmap(nullptr, ring_sz_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd_,
                     IORING_OFF_SQ_RING);
        if (ring_ == MAP_FAILED) {
            ring_ = nullptr;
            *reason = "io_uring ring mmap failed: " + errno_name(errno);
            return -ENOMEM;
        }
        sqes_sz_ = p.sq_entries * sizeof(io_uring_sqe);
        void* sq = mmap(nullptr, sqes_sz_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd_,
                        IORING_OFF_SQES);
        if (sq == MAP_FAILED) {
            *reason = "io_uring SQE mmap failed: " + errno_name(errno);
            return -ENOMEM;
        }
        sqes_ = static_cast<io_uring_sqe*>(sq);
        char* base = static_cast<char*>(ring_);
        sq_tail_ = reinterpret_cast<unsigned*>(base + p.sq_off.tail);
        sq_mask_ = *reinterpret_cast<unsigned*>(base + p.sq_off.ring_mask);
        sq_array_ = reinterpret_cast<unsigned*>(base + p.sq_off.array);
        cq_head_ = reinterpret_cast<unsigned*>(base + p.cq_off.head);
        cq_tail_ = reinterpret_cast<unsigned*>(base + p.cq_off.tail);
        cq_mask_ = *reinterpret_cast<unsigned*>(base + p.cq_off.ring_mask);
        cqes_ = reinterpret_cast<io_uring_cqe*>(base + p.cq_off.cqes);
        reaper_ = std::thread([this] { reap(); });
        return 0;
    }

    ~IoUringBackend() override {
        if (reaper_.joinable()) {
            IOTask wake;
            wake.tag = kWakeTag;
            push(wake, /*nop=*/true);
            enter_all(1);
            reaper_.join();
        }
        if (sqes_) munmap(sqes_, sqes_sz_);
        if (ring_) munmap(ring_, ring_sz_);
        if (ring_fd_ >= 0) ::close(ring_fd_);
    }

    const char* name() const override { return "io_uring"; }

    int submit(const IOTask* tasks, size_t n) override {
        size_t i = 0;
        while (i < n) {
            // The engine bounds tasks in flight below the ring size, so the SQ has room; chunk anyway.
            const size_t chunk = std::min<size_t>(n - i, sq_entries_);
            for (size_t k = 0; k < chunk; ++k) push(tasks[i + k], false);
            const int r = enter_all(static_cast<unsigned>(chunk));
            if (r < 0) return r;
            i += chunk;
        }
        return 0;
    }

private:
    void push(const IOTask& t, bool nop) {
        const unsigned tail = *sq_tail_;  // we are the only producer
        const unsigned idx = tail & sq_mask_;
        io_uring_sqe* sqe = &sqes_[idx];
        std::memset(sqe, 0, sizeof(*sqe));
        if (nop) {
            sqe->opcode = IORING_OP_NOP;
        } else {
            sqe->opcode = t.write ? IORING_OP_WRITE : IORING_OP_READ;
            sqe->fd = t.fd;
            sqe->addr = reinterpret_cast<uint64_t>(t.buf);
            sqe->len = t.len;
            sqe->off = t.offset;
        }
        sqe->user_data = t.tag;
        sq_array_[idx] = idx;
        store_release(sq_tail_, tail + 1);
    }

    // Hands `n` new entries to the kernel, retrying transient refusals.
    int enter_all(unsigned n) {
        while (n > 0) {
            const int r = sys_enter(ring_fd_, n, 0, 0);
            if (r < 0) {
                if (errno == EINTR || errno == EAGAIN || errno == EBUSY) {
                    std::this_thread::yield();
                    continue;
                }
                return -errno;
            }
            n -= static_cast<unsigned>(r);
        }
        return 0;
    }

    void reap() {
        std::vector<IOCompletion> batch;
        bool stop = false;
        while (!stop) {
            const int r = sys_enter(ring_fd_, 0, 1, IORING_ENTER_GETEVENTS);
            if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) {
                // Not expected on a ring we own; back off and keep reaping, since giving up would
                // leave every request in flight unfinished.
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            unsigned head = *cq_head_;
            const unsigned tail = load_acquire(cq_tail_);
            batch.clear();
            while (head != tail) {
                const io_uring_cqe& cqe = cqes_[head & cq_mask_];
                if (cqe.user_data == kWakeTag) {
                    stop = true;
                } else {
                    batch.push_back(IOCompletion{cqe.user_data, cqe.res});
                }
                ++head;
            }
            store_release(cq_head_, head);
            if (!batch.empty()) on_complete_(batch.data(), batch.size());
        }
    }

    CompletionFn on_complete_;
    int ring_fd_ = -1;
    void* ring_ = nullptr;
    size_t ring_sz_ = 0;
    io_uring_sqe* sqes_ = nullptr;
    size_t sqes_sz_ = 0;
    unsigned sq_entries_ = 0;
    unsigned* sq_tail_ = nullptr;
    unsigned sq_mask_ = 0;
    unsigned* sq_array_ = nullptr;
    unsigned* cq_head_ = nullptr;
    unsigned* cq_tail_ = nullptr;
    unsigned cq_mask_ = 0;
    io_uring_cqe* cqes_ = nullptr;
    std::thread reaper_;
};

}  // namespace

std::unique_ptr<IOBackend> make_io_uring_backend(unsigned entries, CompletionFn on_complete,
                                                 std::string* reason, int simulate_error) {
    auto b = std::make_unique<IoUringBackend>(std::move(on_complete));
    if (b->init(entries, reason, simulate_error) != 0) return nullptr;
    return b;
}

}  // namespace mlp
