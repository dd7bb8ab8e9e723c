// Minimal test harness for the sanitizer builds: CHECK aborts the test with file:line.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace mlp_test {

struct Case {
    const char* name;
    std::function<void()> fn;
};

inline std::vector<Case>& cases() {
    static std::vector<Case> c;  // test registry of this binary only
    return c;
}

struct Register {
    Register(const char* name, std::function<void()> fn) { cases().push_back({name, std::move(fn)}); }
};

// A failing CHECK aborts the process, so reaching the end means every case passed.
inline int run_all() {
    for (auto& c : cases()) {
        std::fprintf(stderr, "[ RUN  ] %s\n", c.name);
        c.fn();
        std::fprintf(stderr, "[  OK  ] %s\n", c.name);
    }
    std::fprintf(stderr, "%zu tests passed\n", cases().size());
    return 0;
}

}  // namespace mlp_test

#define MLP_CAT2(a, b) a##b
#define MLP_CAT(a, b) MLP_CAT2(a, b)
#define TEST(name)                                                              \
    static void name();                                                         \
    static mlp_test::Register MLP_CAT(reg_, name)(#name, name);                 \
    static void name()

#define CHECK(cond)                                                                         \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);   \
            std::abort();                                                                   \
        }                                                                                   \
    } while (0)

#define CHECK_EQ(a, b)                                                                           \
    do {                                                                                         \
        auto _va = (a);                                                                          \
        auto _vb = (b);                                                                          \
        if (!(_va == _vb)) {                                                                     \
            std::fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %s (%lld vs %lld)\n", __FILE__, \
                         __LINE__, #a, #b, (long long)_va, (long long)_vb);                      \
            std::abort();                                                                        \
        }                                                                                        \
    } while (0)
