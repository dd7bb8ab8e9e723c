// Bandwidth cap (bytes/s) for one direction of one engine: a QoS limit on a shared tier or an
// emulated slower tier in benchmarks. Debt-based: a transfer may start while the balance is
// non-negative and drives it negative, so any transfer size is allowed and the long-run rate
// converges to `rate`. The balance starts at zero, so a fresh bucket exceeds the rate by at
// most one transfer; while idle it accumulates up to `burst` bytes of credit, which also
// absorbs a late wake-up of the thread that issues the next transfer on a busy machine.
#pragma once

#include <cstdint>

namespace mlp {

class TokenBucket {
public:
    // rate_bytes_per_s == 0 disables the cap. burst_bytes: the most credit that can accumulate.
    TokenBucket(uint64_t rate_bytes_per_s = 0, uint64_t burst_bytes = 0);

    bool enabled() const { return rate_ > 0; }
    uint64_t rate() const { return static_cast<uint64_t>(rate_); }

    // now_s: a monotonic time in seconds. Returns 0 and charges `bytes` when the transfer may
    // start now; otherwise charges nothing and returns the seconds to wait before asking again.
    double try_consume(double now_s, uint64_t bytes);

private:
    void refill(double now_s);
    double rate_;
    double burst_;
    double tokens_;
    double last_s_ = -1.0;
};

}  // namespace mlp
