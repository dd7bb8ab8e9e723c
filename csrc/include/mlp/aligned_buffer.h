// Host memory for O_DIRECT I/O: page-aligned (4096), zero-filled, mlock'ed when permitted.
#pragma once

#include <cstddef>

namespace mlp {

constexpr size_t kAlignment = 4096;  // O_DIRECT alignment of buffers, offsets and lengths

inline bool is_aligned(unsigned long long v) { return (v % kAlignment) == 0; }
inline size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Move-only owner of one anonymous mapping. nbytes() is what was asked for; the mapping is
// rounded up to a whole page so an O_DIRECT tail never touches memory we do not own.
class AlignedBuffer {
public:
    // Returns an empty buffer (data() == nullptr) and sets *err when the mapping fails.
    // try_lock: call mlock; when refused (RLIMIT_MEMLOCK), the buffer stays usable, unlocked,
    // and lock_error() tells why.
    static AlignedBuffer allocate(size_t nbytes, bool try_lock, int* err);

    AlignedBuffer() = default;
    AlignedBuffer(const AlignedBuffer&) = delete;
    AlignedBuffer& operator=(const AlignedBuffer&) = delete;
    AlignedBuffer(AlignedBuffer&& o) noexcept;
    AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
    ~AlignedBuffer();

    void* data() const { return data_; }
    size_t nbytes() const { return nbytes_; }
    size_t mapped_bytes() const { return mapped_; }
    bool locked() const { return locked_; }
    int lock_error() const { return lock_err_; }

private:
    void release();
    void* data_ = nullptr;
    size_t nbytes_ = 0;
    size_t mapped_ = 0;
    bool locked_ = false;
    int lock_err_ = 0;
};

}  // namespace mlp
