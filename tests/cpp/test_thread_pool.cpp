// Concurrency of the engine on the thread-pool backend, built under ThreadSanitizer (and
// ASan/UBSan): many submitting threads, caps, faults and close racing with completions.
#include <atomic>
#include <cstring>
#include <thread>

#include "check.h"
#include "engine_fixture.h"
#include "mlp/engine.h"

using namespace mlp;
using namespace mlp_test;

TEST(many_threads_submit_and_wait_concurrently) {
    ScratchDir dir;
    Engine e(opts("threads", 16 << 10, 8));
    constexpr int kThreads = 4, kPerThread = 24, kChunk = (32 << 10) + 100;
    std::vector<std::shared_ptr<File>> files;
    for (int t = 0; t < kThreads; ++t) {
        Status st;
        files.push_back(e.open(dir.file("t" + std::to_string(t) + ".bin"), OpenOptions{}, &st));
        CHECK(st.ok());
    }
    std::atomic<int> errors{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            std::vector<uint8_t> src(kChunk * kPerThread), dst(src.size());
            fill(src.data(), src.size(), t + 1);
            std::vector<std::shared_ptr<Request>> reqs;
            for (int i = 0; i < kPerThread; ++i) {
                reqs.push_back(e.submit(Op::kWrite, files[t], src.data() + i * kChunk, kChunk,
                                        static_cast<uint64_t>(i) * kChunk));
            }
            for (auto& r : reqs) {
                r->wait(-1);
                if (!r->status().ok()) errors++;
            }
            reqs.clear();
            for (int i = kPerThread; i-- > 0;) {
                reqs.push_back(e.submit(Op::kRead, files[t], dst.data() + i * kChunk, kChunk,
                                        static_cast<uint64_t>(i) * kChunk));
            }
            while (!reqs.empty()) {
                if (reqs.back()->wait(0.001)) {
                    if (!reqs.back()->status().ok()) errors++;
                    reqs.pop_back();
                }
            }
            if (src != dst) errors++;
        });
    }
    for (auto& th : threads) th.join();
    CHECK_EQ(errors.load(), 0);
    auto s = e.stats();
    CHECK_EQ(s.read_requests + s.write_requests, static_cast<uint64_t>(2 * kThreads * kPerThread));
}

TEST(close_races_with_completions_caps_and_faults) {
    for (int round = 0; round < 5; ++round) {
        ScratchDir dir;
        EngineOptions o = opts("threads", 8 << 10, 4);
        o.read_limit_bytes_per_s = 64 << 20;
        o.write_limit_bytes_per_s = 64 << 20;
        Engine e(o);
        Status st;
        auto f = e.open(dir.file("r.bin"), OpenOptions{}, &st);
        FaultRule fr;
        fr.nth = 3;
        fr.every = true;
        fr.err = EAGAIN;
        e.inject_fault(fr);
        std::vector<uint8_t> buf(256 << 10);
        std::vector<std::shared_ptr<Request>> reqs;
        std::thread poller([&] {
            for (int i = 0; i < 50; ++i) {
                (void)e.stats();
                std::this_thread::sleep_for(std::chrono::microseconds(200));
            }
        });
        for (int i = 0; i < 8; ++i) reqs.push_back(e.submit(Op::kWrite, f, buf.data(), buf.size(), i * buf.size()));
        std::thread waiter([&] { e.wait_all(-1); });
        e.close();
        waiter.join();
        poller.join();
        for (auto& r : reqs) CHECK(r->done() && r->status().ok());
    }
}

int main() { return mlp_test::run_all(); }
