// An open tier file: an O_DIRECT descriptor for the aligned body of each transfer plus a
// buffered descriptor for unaligned tails and offsets (and for file systems that refuse O_DIRECT).
#pragma once

#include <fcntl.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "mlp/status.h"

namespace mlp {

// Every open refuses to follow a symlink at the last component (O_NOFOLLOW): tier directories
// may be writable by others, and a name swapped for a symlink must never redirect our writes.
// With `dir_fd` the path is looked up relative to that directory descriptor (openat), so a file in
// a directory the caller created and checked is never reached through the directory's path again.
struct OpenOptions {
    int dir_fd = AT_FDCWD;       // the directory `path` is relative to (AT_FDCWD: the cwd, or absolute)
    bool create = true;
    bool exclusive = false;      // with create: fail with EEXIST unless this open creates the file
    bool truncate = false;
    bool read_only = false;
    bool direct = true;
    bool refuse_direct = false;  // tests: behave as if open(O_DIRECT) failed with EINVAL
};

// The descriptors; shared by the File and every request in flight so a close() never pulls
// a descriptor from under a transfer.
struct FileDescriptors {
    int direct_fd = -1;    // -1 when O_DIRECT is not in use
    int buffered_fd = -1;
    ~FileDescriptors();
};

class File {
public:
    static std::shared_ptr<File> open(const std::string& path, const OpenOptions& opts, Status* st);

    const std::string& path() const { return path_; }
    bool direct() const { return direct_; }
    bool direct_refused() const { return direct_refused_; }  // asked for O_DIRECT, FS said EINVAL
    bool read_only() const { return read_only_; }

    // nullptr once closed.
    std::shared_ptr<FileDescriptors> descriptors() const;
    void close();
    bool closed() const;
    Status size(int64_t* out) const;
    Status sync() const;
    // posix_fallocate(0, nbytes) and POSIX_FADV_DONTNEED through the open descriptor, so callers
    // never reopen the file by name to do either.
    Status allocate(int64_t nbytes) const;
    Status drop_page_cache() const;

private:
    std::string path_;
    bool direct_ = false;
    bool direct_refused_ = false;
    bool read_only_ = false;
    mutable std::mutex mu_;
    std::shared_ptr<FileDescriptors> fds_;
};

}  // namespace mlp
