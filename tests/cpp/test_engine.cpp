// The engine core under AddressSanitizer/UBSan: round trips on both backends, the alignment
// policy, retries, every error path, close with I/O in flight, caps and fault injection.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "check.h"
#include "engine_fixture.h"
#include "mlp/aligned_buffer.h"
#include "mlp/engine.h"
#include "mlp/fault_injection.h"
#include "mlp/token_bucket.h"

using namespace mlp;
using namespace mlp_test;

namespace {

std::shared_ptr<File> open_file(Engine& e, const std::string& path, bool refuse_direct = false) {
    OpenOptions o;
    o.refuse_direct = refuse_direct;
    Status st;
    auto f = e.open(path, o, &st);
    CHECK(st.ok());
    CHECK(f != nullptr);
    return f;
}

void round_trip(const std::string& backend, size_t size, uint64_t offset, size_t mem_shift, uint64_t block,
                unsigned qd, bool refuse_direct) {
    ScratchDir dir;
    Engine e(opts(backend, block, qd));
    CHECK(e.backend() == backend);
    auto f = open_file(e, dir.file("rt.bin"), refuse_direct);
    std::vector<uint8_t> src(size + mem_shift), dst(size + mem_shift + 3);
    fill(src.data() + mem_shift, size, static_cast<uint32_t>(size + offset));
    auto w = e.submit(Op::kWrite, f, src.data() + mem_shift, size, offset);
    CHECK(w->wait(-1));
    CHECK(w->status().ok());
    CHECK_EQ(w->bytes(), size);
    auto r = e.submit(Op::kRead, f, dst.data() + 3, size, offset);
    CHECK(r->wait(-1));
    CHECK(r->status().ok());
    CHECK(std::memcmp(src.data() + mem_shift, dst.data() + 3, size) == 0);
    int64_t fsize = 0;
    CHECK(f->size(&fsize).ok());
    CHECK_EQ(fsize, static_cast<int64_t>(offset + size));
}

}  // namespace

TEST(round_trips_over_sizes_offsets_blocks_and_depths) {
    for (const auto& b : backends()) {
        for (size_t size : {size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, size_t{(1 << 20) + 1}}) {
            for (uint64_t off : {uint64_t{0}, uint64_t{8192}, uint64_t{12345}}) {
                round_trip(b, size, off, 0, 64 << 10, 4, false);
            }
        }
        for (uint64_t block : {uint64_t{4096}, uint64_t{1 << 20}}) {
            for (unsigned qd : {1u, 7u}) round_trip(b, (3 << 20) + 17, 4096, 1, block, qd, false);
        }
        round_trip(b, (2 << 20) + 5, 4096, 0, 64 << 10, 4, /*refuse_direct=*/true);
    }
}

TEST(bounce_buffers_carry_unaligned_memory_through_o_direct) {
    for (const auto& b : backends()) {
        ScratchDir dir;
        Engine e(opts(b));
        auto f = open_file(e, dir.file("b.bin"));
        CHECK(f->direct());
        std::vector<uint8_t> src((1 << 20) + 1), dst((1 << 20) + 1);
        fill(src.data(), src.size(), 5);
        CHECK(e.submit(Op::kWrite, f, src.data() + 1, 1 << 20, 0)->wait(-1));
        auto r = e.submit(Op::kRead, f, dst.data() + 1, 1 << 20, 0);
        r->wait(-1);
        CHECK(r->status().ok());
        CHECK(std::memcmp(src.data() + 1, dst.data() + 1, 1 << 20) == 0);
        CHECK(e.stats().bounced_tasks > 0);
    }
}

TEST(short_read_at_end_of_file_fails_with_enodata) {
    for (const auto& b : backends()) {
        ScratchDir dir;
        Engine e(opts(b));
        auto f = open_file(e, dir.file("s.bin"));
        std::vector<uint8_t> buf(3 * 4096);
        CHECK(e.submit(Op::kWrite, f, buf.data(), 5000, 0)->wait(-1));
        auto r = e.submit(Op::kRead, f, buf.data(), 3 * 4096, 0);
        r->wait(-1);
        CHECK_EQ(r->status().err, ENODATA);
        CHECK(r->status().message.find("short read") != std::string::npos);
    }
}

TEST(closed_and_read_only_handles_fail_with_ebadf) {
    for (const auto& b : backends()) {
        ScratchDir dir;
        Engine e(opts(b));
        auto path = dir.file("c.bin");
        auto f = open_file(e, path);
        std::vector<uint8_t> buf(4096);
        f->close();
        auto r = e.submit(Op::kRead, f, buf.data(), 4096, 0);
        CHECK(r->done());
        CHECK_EQ(r->status().err, EBADF);
        OpenOptions ro;
        ro.read_only = true;
        Status st;
        auto g = e.open(path, ro, &st);
        CHECK(st.ok());
        auto w = e.submit(Op::kWrite, g, buf.data(), 4096, 0);
        CHECK_EQ(w->status().err, EBADF);
        OpenOptions nocreate;
        nocreate.create = false;
        CHECK(e.open(dir.file("missing.bin"), nocreate, &st) == nullptr);
        CHECK_EQ(st.err, ENOENT);
    }
}

TEST(open_never_follows_a_symlink_and_exclusive_never_opens_an_existing_file) {
    ScratchDir dir;
    Engine e(opts(backends()[0]));
    auto victim = dir.file("victim.bin");
    open_file(e, victim)->close();
    auto link = dir.file("link.bin");
    CHECK(::symlink(victim.c_str(), link.c_str()) == 0);
    Status st;
    CHECK(e.open(link, OpenOptions{}, &st) == nullptr);
    CHECK_EQ(st.err, ELOOP);
    OpenOptions excl;
    excl.exclusive = true;
    CHECK(e.open(victim, excl, &st) == nullptr);
    CHECK_EQ(st.err, EEXIST);
    auto fresh = e.open(dir.file("fresh.bin"), excl, &st);
    CHECK(st.ok() && fresh != nullptr);
    CHECK(fresh->allocate(8192).ok());
    int64_t n = 0;
    CHECK(fresh->size(&n).ok());
    CHECK_EQ(n, 8192);
    CHECK(fresh->drop_page_cache().ok());
}

TEST(open_relative_to_a_directory_descriptor_reaches_that_directory_and_never_follows_a_symlink) {
    ScratchDir dir;
    Engine e(opts(backends()[0]));
    auto victim = dir.file("victim.bin");
    open_file(e, victim)->close();
    const std::string dir_path = victim.substr(0, victim.rfind('/'));
    const int dfd = ::open(dir_path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    CHECK(dfd >= 0);
    CHECK(::symlinkat(victim.c_str(), dfd, "rel-link.bin") == 0);
    dir.file("rel-link.bin");
    dir.file("rel.bin");
    OpenOptions at;
    at.dir_fd = dfd;
    at.exclusive = true;
    Status st;
    auto f = e.open("rel.bin", at, &st);  // made in the directory of `dfd`, not in the cwd
    CHECK(st.ok() && f != nullptr);
    CHECK(::faccessat(dfd, "rel.bin", F_OK, 0) == 0);
    CHECK(e.open("rel-link.bin", at, &st) == nullptr);
    CHECK_EQ(st.err, EEXIST);
    at.exclusive = false;
    at.create = false;
    CHECK(e.open("rel-link.bin", at, &st) == nullptr);
    CHECK_EQ(st.err, ELOOP);
    f->close();
    ::close(dfd);
}

TEST(injected_faults_fail_retry_or_shorten_the_chosen_request) {
    for (const auto& b : backends()) {
        ScratchDir dir;
        Engine e(opts(b));
        auto f = open_file(e, dir.file("f.bin"));
        std::vector<uint8_t> src(1 << 20), dst(1 << 20);
        fill(src.data(), src.size(), 9);
        FaultRule nospc;
        nospc.op = 1;
        nospc.err = ENOSPC;
        e.inject_fault(nospc);
        auto w = e.submit(Op::kWrite, f, src.data(), src.size(), 0);
        w->wait(-1);
        CHECK_EQ(w->status().err, ENOSPC);
        e.clear_faults();
        FaultRule again;
        again.err = EAGAIN;
        again.every = true;
        e.inject_fault(again);
        FaultRule shorter;
        shorter.short_io = true;
        shorter.every = true;
        e.inject_fault(shorter);
        auto w2 = e.submit(Op::kWrite, f, src.data(), src.size(), 0);
        w2->wait(-1);
        CHECK(w2->status().ok());
        auto r = e.submit(Op::kRead, f, dst.data(), dst.size(), 0);
        r->wait(-1);
        CHECK(r->status().ok());
        CHECK(std::memcmp(src.data(), dst.data(), src.size()) == 0);
        CHECK(e.stats().retries >= 2);
        CHECK_EQ(e.stats().failed_requests, 1u);
    }
}

TEST(close_waits_for_queued_and_in_flight_io) {
    for (const auto& b : backends()) {
        ScratchDir dir;
        std::vector<std::shared_ptr<Request>> reqs;
        std::vector<uint8_t> src(4 << 20);
        fill(src.data(), src.size(), 3);
        auto path = dir.file("close.bin");
        {
            EngineOptions o = opts(b);
            o.write_limit_bytes_per_s = 40 << 20;
            Engine e(o);
            auto f = open_file(e, path);
            for (int i = 0; i < 4; ++i) reqs.push_back(e.submit(Op::kWrite, f, src.data() + (i << 20), 1 << 20, i << 20));
            CHECK(!reqs.back()->done());
            e.close();
            auto late = e.submit(Op::kWrite, f, src.data(), 4096, 0);
            CHECK_EQ(late->status().err, ESHUTDOWN);
        }  // engine destroyed; the requests outlive it
        for (auto& r : reqs) {
            CHECK(r->done());
            CHECK(r->status().ok());
        }
        int fd = ::open(path.c_str(), O_RDONLY);
        std::vector<uint8_t> back(src.size());
        CHECK_EQ(::pread(fd, back.data(), back.size(), 0), static_cast<ssize_t>(back.size()));
        ::close(fd);
        CHECK(back == src);
    }
}

TEST(destroying_an_engine_with_io_in_flight_is_clean) {
    for (const auto& b : backends()) {
        ScratchDir dir;
        std::vector<uint8_t> src(2 << 20);
        Engine* e = new Engine(opts(b, 4096, 2));
        auto f = open_file(*e, dir.file("d.bin"));
        auto r = e->submit(Op::kWrite, f, src.data(), src.size(), 0);
        delete e;
        CHECK(r->done());
    }
}

TEST(token_bucket_paces_to_its_rate) {
    TokenBucket tb(1000, 100);
    CHECK(!TokenBucket().enabled());
    CHECK(tb.try_consume(0.0, 500) == 0);      // a zero balance allows a start: balance -500
    const double w = tb.try_consume(0.0, 500);
    CHECK(w > 0.49 && w < 0.51);
    CHECK(tb.try_consume(0.51, 500) == 0);     // balance +10 -> -490
    CHECK(tb.try_consume(100.0, 50) == 0);     // idle: credit capped at the burst of 100 -> +50
    CHECK(tb.try_consume(100.0, 50) == 0);     // +50 -> 0
    CHECK(tb.try_consume(100.0, 1) == 0);      // 0 -> -1
    CHECK(tb.try_consume(100.0, 1) > 0);
    // over a long run the consumed bytes track the rate
    TokenBucket t2(1 << 20, 4096);
    double now = 0;
    uint64_t sent = 0;
    while (now < 10.0) {
        const double d = t2.try_consume(now, 65536);
        if (d == 0) sent += 65536; else now += d;
    }
    const double rate = sent / now;
    CHECK(rate > 0.98 * (1 << 20) && rate < 1.02 * (1 << 20));
}

TEST(fault_injector_counts_matching_requests_only) {
    FaultInjector fi;
    FaultRule r;
    r.op = 0;
    r.nth = 2;
    r.err = EIO;
    r.path_contains = "x";
    fi.add(r);
    CHECK(!fi.on_request(Op::kRead, "/a/x").any());
    CHECK(!fi.on_request(Op::kWrite, "/a/x").any());
    CHECK(!fi.on_request(Op::kRead, "/a/y").any());
    CHECK_EQ(fi.on_request(Op::kRead, "/a/x").err, EIO);
    CHECK(!fi.on_request(Op::kRead, "/a/x").any());
}

TEST(aligned_buffers_are_page_aligned_and_movable) {
    int err = 0;
    AlignedBuffer a = AlignedBuffer::allocate(5000, true, &err);
    CHECK_EQ(err, 0);
    CHECK(is_aligned(reinterpret_cast<uintptr_t>(a.data())));
    CHECK_EQ(a.nbytes(), 5000u);
    CHECK_EQ(a.mapped_bytes(), 8192u);
    static_cast<char*>(a.data())[8191] = 1;
    AlignedBuffer b = std::move(a);
    CHECK(a.data() == nullptr && b.data() != nullptr);
    AlignedBuffer z = AlignedBuffer::allocate(0, false, &err);
    CHECK_EQ(err, EINVAL);
}

TEST(invalid_options_are_rejected) {
    for (auto mutate : std::vector<std::function<void(EngineOptions&)>>{
             [](EngineOptions& o) { o.block_bytes = 1000; }, [](EngineOptions& o) { o.queue_depth = 0; },
             [](EngineOptions& o) { o.backend = "aio"; }}) {
        EngineOptions o;
        mutate(o);
        bool threw = false;
        try {
            Engine e(o);
        } catch (const std::invalid_argument&) {
            threw = true;
        }
        CHECK(threw);
    }
    EngineOptions o;
    o.backend = "auto";
    o.simulate_io_uring_error = EPERM;
    Engine e(o);
    CHECK(e.backend() == "threads");
    CHECK(e.fallback_reason().find("io_uring_disabled") != std::string::npos);
}

int main() { return mlp_test::run_all(); }
