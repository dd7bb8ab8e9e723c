#include "mlp/aligned_buffer.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <utility>

namespace mlp {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// Maps `bytes` (a multiple of 4096); from 2 MiB on, 2 MiB-aligned and marked for transparent
// huge pages. Why: an O_DIRECT request's pages become one block-layer segment per physically
// contiguous run, so a 1 MiB transfer from 4 KiB pages needs 256 segments (more than a virtio
// disk's 254: two requests) where a huge page needs one. Measured on a virtio disk: 2.2 -> 5.1
// GB/s writes, 1.05 -> 3.1 GB/s reads for the same file and queue depth. Where THP is off or
// refused the hint is ignored and the buffer works as before. Returns nullptr with errno set.
void* map_anonymous(size_t bytes) {
    if (bytes < kHugePage) {
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? nullptr : p;
    }
    const size_t over = bytes + kHugePage;
    void* raw = mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const auto base = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t start = (base + kHugePage - 1) & ~(uintptr_t{kHugePage} - 1);
    const size_t head = start - base;
    const size_t tail = over - head - bytes;
    if (head != 0) munmap(raw, head);
    if (tail != 0) munmap(reinterpret_cast<void*>(start + bytes), tail);
    void* p = reinterpret_cast<void*>(start);
    (void)madvise(p, bytes, MADV_HUGEPAGE);  // a hint: EINVAL where THP is compiled out
    return p;
}

}  // namespace

AlignedBuffer AlignedBuffer::allocate(size_t nbytes, bool try_lock, int* err) {
    AlignedBuffer b;
    *err = 0;
    if (nbytes == 0) {
        *err = EINVAL;
        return b;
    }
    const size_t mapped = round_up(nbytes, kAlignment);
    // An anonymous mapping is page-aligned and zero-filled; large ones come straight from the
    // kernel instead of fragmenting the malloc heap.
    void* p = map_anonymous(mapped);
    if (p == nullptr) {
        *err = errno;
        return b;
    }
    b.data_ = p;
    b.nbytes_ = nbytes;
    b.mapped_ = mapped;
    if (try_lock) {
        if (mlock(p, mapped) == 0) {
            b.locked_ = true;
        } else {
            b.lock_err_ = errno;  // ENOMEM / EPERM: RLIMIT_MEMLOCK; stays usable, unlocked
        }
    }
    return b;
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept { *this = std::move(o); }

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
        release();
        data_ = std::exchange(o.data_, nullptr);
        nbytes_ = std::exchange(o.nbytes_, 0);
        mapped_ = std::exchange(o.mapped_, 0);
        locked_ = std::exchange(o.locked_, false);
        lock_err_ = std::exchange(o.lock_err_, 0);
    }
    return *this;
}

AlignedBuffer::~AlignedBuffer() { release(); }

void AlignedBuffer::release() {
    if (data_ != nullptr) {
        if (locked_) munlock(data_, mapped_);
        munmap(data_, mapped_);
        data_ = nullptr;
    }
}

}  // namespace mlp
