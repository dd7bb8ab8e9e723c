#include "mlp/fault_injection.h"

namespace mlp {

void FaultInjector::add(FaultRule rule) { rules_.push_back({std::move(rule), 0}); }

void FaultInjector::clear() { rules_.clear(); }

FaultAction FaultInjector::on_request(Op op, const std::string& path) {
    FaultAction action;
    for (auto& e : rules_) {
        const FaultRule& r = e.rule;
        if (r.op >= 0 && r.op != static_cast<int>(op)) continue;
        if (!r.path_contains.empty() && path.find(r.path_contains) == std::string::npos) continue;
        e.seen++;
        const bool hit = r.every ? e.seen >= r.nth : e.seen == r.nth;
        if (hit && !action.any()) {
            action.err = r.err;
            action.short_io = r.short_io;
        }
    }
    return action;
}

}  // namespace mlp
