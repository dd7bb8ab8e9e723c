#include "mlp/aligned_buffer.h"

#include <sys/mman.h>

#include <cerrno>
#include <utility>

namespace mlp {

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
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
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
