#include "mlp/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace mlp {

FileDescriptors::~FileDescriptors() {
    if (direct_fd >= 0) ::close(direct_fd);
    if (buffered_fd >= 0) ::close(buffered_fd);
}

static int open_retry(int dir_fd, const char* path, int flags) {
    int fd;
    do {
        fd = ::openat(dir_fd, path, flags, 0600);
    } while (fd < 0 && errno == EINTR);
    return fd;
}

static bool same_inode(int a, int b) {
    struct stat sa, sb;
    return fstat(a, &sa) == 0 && fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// A second descriptor of the file open as `fd`, with O_DIRECT, without looking its name up again:
// through /proc/self/fd, which names the open inode itself, so a name swapped since (for a symlink,
// or for another file) cannot redirect it. Without /proc, the name is opened once more with
// O_NOFOLLOW (relative to the same directory descriptor) and accepted only if it is still the same inode.
static int reopen_direct(int fd, int dir_fd, const std::string& path, int flags, int* err) {
    const std::string self = "/proc/self/fd/" + std::to_string(fd);
    int direct = open_retry(AT_FDCWD, self.c_str(), flags | O_DIRECT);
    if (direct < 0 && (errno == ENOENT || errno == EACCES)) {
        direct = open_retry(dir_fd, path.c_str(), flags | O_DIRECT | O_NOFOLLOW);
    }
    if (direct < 0) {
        *err = errno;
        return -1;
    }
    if (!same_inode(fd, direct)) {
        ::close(direct);
        *err = ESTALE;
        return -1;
    }
    return direct;
}

std::shared_ptr<File> File::open(const std::string& path, const OpenOptions& o, Status* st) {
    *st = Status::Ok();
    int flags = (o.read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC;
    int first = flags | O_NOFOLLOW;
    if (o.create && !o.read_only) first |= O_CREAT | (o.exclusive ? O_EXCL : 0);
    if (o.truncate && !o.read_only) first |= O_TRUNC;

    auto fds = std::make_shared<FileDescriptors>();
    fds->buffered_fd = open_retry(o.dir_fd, path.c_str(), first);
    if (fds->buffered_fd < 0) {
        const int e = errno;
        std::string why = e == ELOOP ? " (it is a symlink, which is never followed)" : "";
        *st = Status::Error(e, "cannot open " + path + (o.read_only ? " for reading" : " for reading and writing") +
                                   why);
        return nullptr;
    }
    auto f = std::shared_ptr<File>(new File());
    f->path_ = path;
    f->read_only_ = o.read_only;
    if (o.direct) {
        int e = EINVAL;
        int fd = o.refuse_direct ? -1 : reopen_direct(fds->buffered_fd, o.dir_fd, path, flags, &e);
        if (fd >= 0) {
            fds->direct_fd = fd;
            f->direct_ = true;
        } else if (e == EINVAL) {
            // The file system does not support O_DIRECT (older tmpfs, some Lustre/FUSE mounts):
            // serve every transfer through the buffered descriptor.
            f->direct_refused_ = true;
        } else {
            std::string why = e == ESTALE ? " (the name was replaced while opening)" : "";
            *st = Status::Error(e, "cannot open " + path + " with O_DIRECT" + why);
            return nullptr;
        }
    }
    f->fds_ = std::move(fds);
    return f;
}

std::shared_ptr<FileDescriptors> File::descriptors() const {
    std::lock_guard<std::mutex> lk(mu_);
    return fds_;
}

void File::close() {
    std::lock_guard<std::mutex> lk(mu_);
    fds_.reset();  // descriptors close when the last in-flight request lets go of them
}

bool File::closed() const {
    std::lock_guard<std::mutex> lk(mu_);
    return fds_ == nullptr;
}

Status File::size(int64_t* out) const {
    auto fds = descriptors();
    if (!fds) return Status::Error(EBADF, "file handle is closed: " + path_);
    struct stat sb;
    if (fstat(fds->buffered_fd, &sb) != 0) return Status::Error(errno, "fstat failed: " + path_);
    *out = sb.st_size;
    return Status::Ok();
}

Status File::sync() const {
    auto fds = descriptors();
    if (!fds) return Status::Error(EBADF, "file handle is closed: " + path_);
    // One fsync covers both descriptors: they name the same inode.
    int r;
    do {
        r = fsync(fds->buffered_fd);
    } while (r != 0 && errno == EINTR);
    if (r != 0) return Status::Error(errno, "fsync failed: " + path_);
    return Status::Ok();
}

Status File::allocate(int64_t nbytes) const {
    auto fds = descriptors();
    if (!fds) return Status::Error(EBADF, "file handle is closed: " + path_);
    const int r = posix_fallocate(fds->buffered_fd, 0, nbytes);  // returns the error, sets no errno
    if (r != 0) return Status::Error(r, "cannot allocate " + std::to_string(nbytes) + " bytes: " + path_);
    return Status::Ok();
}

Status File::drop_page_cache() const {
    auto fds = descriptors();
    if (!fds) return Status::Error(EBADF, "file handle is closed: " + path_);
    const int r = posix_fadvise(fds->buffered_fd, 0, 0, POSIX_FADV_DONTNEED);
    if (r != 0) return Status::Error(r, "cannot drop the page cache of " + path_);
    return Status::Ok();
}

}  // namespace mlp
