#!/usr/bin/env bash
# Builds the C++ core (every csrc/src/**/*.cpp except the Python bindings) together with each
# tests/cpp/test_*.cpp under AddressSanitizer + UndefinedBehaviorSanitizer, and each
# tests/cpp/test_thread_pool*.cpp also under ThreadSanitizer; runs every binary; exits non-zero
# when a build or a test fails. Binaries go to tests/cpp/bin/.
#
#   tests/cpp/run_sanitizers.sh            # all
#   CXX=clang++ JOBS=4 tests/cpp/run_sanitizers.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
CXX="${CXX:-g++}"
JOBS="${JOBS:-$(nproc)}"
BIN="$ROOT/tests/cpp/bin"
COMMON=(-std=c++17 -O1 -g -fno-omit-frame-pointer -Wall -Wextra -pthread -I"$ROOT/csrc/include" -I"$ROOT/tests/cpp")
declare -A FLAGS=(
    [asan]="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
    [tsan]="-fsanitize=thread"
)

mapfile -t CORE < <(find csrc/src -name '*.cpp' -not -path 'csrc/src/python/*' | sort)
mapfile -t TESTS < <(find tests/cpp -maxdepth 1 -name 'test_*.cpp' | sort)
if [[ ${#TESTS[@]} -eq 0 ]]; then echo "run_sanitizers: no tests/cpp/test_*.cpp" >&2; exit 1; fi

newest_header=$(find csrc/include tests/cpp -name '*.h' -printf '%T@\n' | sort -n | tail -1)

# Compile the core once per sanitizer (objects are reused while sources and headers are unchanged).
compile_core() {
    local san=$1 out="$BIN/obj-$1" src obj
    mkdir -p "$out"
    for src in "${CORE[@]}"; do
        obj="$out/$(echo "${src#csrc/src/}" | tr '/' '_').o"
        if [[ -f "$obj" && "$obj" -nt "$src" ]] && \
           awk -v a="$(stat -c %Y "$obj")" -v b="$newest_header" 'BEGIN{exit !(a >= b)}'; then
            continue
        fi
        echo "$src $obj"
    done | xargs -r -P "$JOBS" -n 2 sh -c "$CXX ${COMMON[*]} ${FLAGS[$san]} -c \"\$0\" -o \"\$1\" || exit 255"
}

build_test() {
    local san=$1 test=$2 name
    name="$(basename "${test%.cpp}")-$san"
    $CXX "${COMMON[@]}" ${FLAGS[$san]} "$test" "$BIN"/obj-"$san"/*.o -o "$BIN/$name"
    echo "$BIN/$name"
}

tsan_tests=()
for t in "${TESTS[@]}"; do [[ "$(basename "$t")" == test_thread_pool* ]] && tsan_tests+=("$t"); done

echo "run_sanitizers: compiling ${#CORE[@]} core sources (asan+ubsan${tsan_tests:+, tsan}) with $CXX -j$JOBS"
compile_core asan
[[ ${#tsan_tests[@]} -gt 0 ]] && compile_core tsan
# Stale objects of deleted sources would be linked in: drop them.
for san in asan tsan; do
    [[ -d "$BIN/obj-$san" ]] || continue
    for obj in "$BIN/obj-$san"/*.o; do
        [[ -e "$obj" ]] || continue
        found=0
        for c in "${CORE[@]}"; do [[ "$(echo "${c#csrc/src/}" | tr '/' '_')" == "$(basename "${obj%.o}")" ]] && found=1; done
        [[ $found == 1 ]] || rm -f "$obj"
    done
done

binaries=()
for t in "${TESTS[@]}"; do binaries+=("$(build_test asan "$t")"); done
for t in "${tsan_tests[@]}"; do binaries+=("$(build_test tsan "$t")"); done

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"

failed=0
for b in "${binaries[@]}"; do
    runner=()
    # TSan cannot map its shadow with high-entropy ASLR on newer kernels: run without ASLR.
    if [[ "$b" == *-tsan ]] && command -v setarch >/dev/null; then runner=(setarch "$(uname -m)" -R); fi
    echo "run_sanitizers: running $(basename "$b")"
    if ! "${runner[@]}" "$b"; then
        echo "run_sanitizers: FAILED $(basename "$b")" >&2
        failed=1
    fi
done
if [[ $failed -ne 0 ]]; then exit 1; fi
echo "run_sanitizers: all ${#binaries[@]} sanitizer binaries passed"
