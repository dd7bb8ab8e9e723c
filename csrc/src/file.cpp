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

static int open_retry(const std::string& path, int flags) {
    int fd;
    do {
        fd = ::open(path.c_str(), flags, 0644);
    } while (fd < 0 && errno == EINTR);
    return fd;
}

std::shared_ptr<File> File::open(const std::string& path, const OpenOptions& o, Status* st) {
    *st = Status::Ok();
    int flags = (o.read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC;
    int first = flags;
    if (o.create && !o.read_only) first |= O_CREAT;
    if (o.truncate && !o.read_only) first |= O_TRUNC;

    auto fds = std::make_shared<FileDescriptors>();
    fds->buffered_fd = open_retry(path, first);
    if (fds->buffered_fd < 0) {
        const int e = errno;
        *st = Status::Error(e, "cannot open " + path + (o.read_only ? " for reading" : " for reading and writing"));
        return nullptr;
    }
    auto f = std::shared_ptr<File>(new File());
    f->path_ = path;
    f->read_only_ = o.read_only;
    if (o.direct) {
        int fd = o.refuse_direct ? (errno = EINVAL, -1) : open_retry(path, flags | O_DIRECT);
        if (fd >= 0) {
            fds->direct_fd = fd;
            f->direct_ = true;
        } else if (errno == EINVAL) {
            // The file system does not support O_DIRECT (older tmpfs, some Lustre/FUSE mounts):
            // serve every transfer through the buffered descriptor.
            f->direct_refused_ = true;
        } else {
            const int e = errno;
            *st = Status::Error(e, "cannot open " + path + " with O_DIRECT");
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

}  // namespace mlp
