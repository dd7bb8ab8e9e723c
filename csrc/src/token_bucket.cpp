#include "mlp/token_bucket.h"

#include <algorithm>

namespace mlp {

TokenBucket::TokenBucket(uint64_t rate_bytes_per_s, uint64_t burst_bytes)
    : rate_(static_cast<double>(rate_bytes_per_s)),
      burst_(static_cast<double>(burst_bytes)),
      tokens_(0) {}

void TokenBucket::refill(double now_s) {
    if (last_s_ >= 0 && now_s > last_s_) tokens_ = std::min(burst_, tokens_ + (now_s - last_s_) * rate_);
    if (now_s > last_s_) last_s_ = now_s;
}

double TokenBucket::try_consume(double now_s, uint64_t bytes) {
    if (rate_ <= 0) return 0;
    refill(now_s);
    if (tokens_ >= 0) {
        tokens_ -= static_cast<double>(bytes);
        return 0;
    }
    return -tokens_ / rate_;
}

}  // namespace mlp
