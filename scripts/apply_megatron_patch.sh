#!/usr/bin/env bash
# Apply, check or reverse the one-line MLP-Offload patch on a Megatron-LM checkout.
#
#   scripts/apply_megatron_patch.sh <checkout>             detect the version, dry-run, apply, verify
#   scripts/apply_megatron_patch.sh <checkout> --check     report whether it is patched (exit 0) or not (1)
#   scripts/apply_megatron_patch.sh <checkout> --reverse   remove the patch (dry-run first)
#   ... [--line core_r0.16]                                 use that line's patch instead of detecting it
#
# The version comes from megatron/core/package_info.py (MAJOR, MINOR); core_r0.13 ... core_r0.19
# have their own patch, newer versions use the patch for main. Only pretrain_gpt.py changes: one
# import line that applies the same hooks as `python -m megatron_mlp.launch` (see the README of
# each patch). Exit status: 0 done / patched, 1 not patched (--check) or patch failed, 2 usage or
# unknown checkout.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PATCH_ROOT="${MLP_PATCH_ROOT:-$HERE/../patches/megatron-lm}"
MARKER="import megatron_mlp.launch as _mlp_offload_hooks"
# The line earlier patches added; it skips the CPU harness, so apply brings it up to date in place.
EARLIER="import megatron_mlp.megatron.hooks as _mlp_offload_hooks"
TARGET="pretrain_gpt.py"

usage() {
    sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
die() { echo "apply_megatron_patch: $1" >&2; exit "${2:-1}"; }

checkout=""
mode="apply"
line=""
while [ $# -gt 0 ]; do
    case "$1" in
        --check) mode="check" ;;
        --reverse) mode="reverse" ;;
        --line) shift; [ $# -gt 0 ] || usage; line="$1" ;;
        --line=*) line="${1#--line=}" ;;
        -h|--help) usage ;;
        -*) echo "apply_megatron_patch: unknown option $1" >&2; usage ;;
        *) [ -z "$checkout" ] || usage; checkout="$1" ;;
    esac
    shift
done
[ -n "$checkout" ] || usage
[ -d "$checkout" ] || die "$checkout: no such directory" 2
checkout="$(cd "$checkout" && pwd)"
info="$checkout/megatron/core/package_info.py"
[ -f "$checkout/$TARGET" ] && [ -f "$info" ] || die "$checkout is not a Megatron-LM checkout (needs $TARGET and megatron/core/package_info.py)" 2

major="$(sed -n -E 's/^MAJOR *= *([0-9]+).*/\1/p' "$info" | head -n 1)"
minor="$(sed -n -E 's/^MINOR *= *([0-9]+).*/\1/p' "$info" | head -n 1)"
[ -n "$major" ] && [ -n "$minor" ] || die "$info: cannot read MAJOR/MINOR; pass --line core_r0.NN or main" 2
version="$major.$minor"
if [ -z "$line" ]; then
    if [ "$major" -eq 0 ] && [ "$minor" -ge 13 ] && [ "$minor" -le 19 ]; then
        line="core_r0.$minor"
    elif [ "$major" -gt 0 ] || [ "$minor" -gt 19 ]; then
        line="main"
        echo "apply_megatron_patch: Megatron-Core $version is newer than core_r0.19: using the patch for main"
    else
        die "Megatron-Core $version is not supported (core_r0.13 ... core_r0.19 and main); use python -m megatron_mlp.launch, which needs no patch" 2
    fi
fi
patch_file="$PATCH_ROOT/$line/${TARGET%.py}.patch"
[ -f "$patch_file" ] || die "no patch for line '$line' (have: $(ls "$PATCH_ROOT" | grep -v README | tr '\n' ' '))" 2

patched=0
grep -q "$MARKER" "$checkout/$TARGET" && patched=1
earlier=0
grep -q "^$EARLIER" "$checkout/$TARGET" && earlier=1

verify() {
    # Patched file must carry the hook line exactly once and still be valid Python.
    [ "$(grep -c "$MARKER" "$checkout/$TARGET")" -eq 1 ] || die "verify: $TARGET does not carry the hook line exactly once"
    python3 -c "import ast, sys; ast.parse(open(sys.argv[1]).read())" "$checkout/$TARGET" \
        || die "verify: $TARGET is not valid Python after patching"
}

case "$mode" in
    check)
        if [ "$earlier" -eq 1 ]; then
            echo "patched with the earlier line: $checkout ($TARGET imports megatron_mlp.megatron.hooks); run $0 $checkout to bring it up to date"
            exit 1
        fi
        if [ "$patched" -eq 1 ]; then
            verify
            echo "patched: $checkout (Megatron-Core $version, line $line)"
            exit 0
        fi
        if (cd "$checkout" && patch -p1 --dry-run -N -s -f < "$patch_file" >/dev/null 2>&1); then
            echo "not patched: $checkout (Megatron-Core $version); the patch for $line applies cleanly"
        else
            echo "not patched: $checkout (Megatron-Core $version); the patch for $line does NOT apply (local edits to $TARGET?)"
        fi
        exit 1
        ;;
    apply)
        if [ "$earlier" -eq 1 ]; then
            # Our own line, not Megatron's: swap its import in place, nothing else of the file moves.
            tmp="$(mktemp "$checkout/.$TARGET.XXXXXX")"
            sed "s/^$EARLIER/$MARKER/" "$checkout/$TARGET" > "$tmp"
            chmod --reference="$checkout/$TARGET" "$tmp" 2>/dev/null || true
            mv "$tmp" "$checkout/$TARGET"
            verify
            echo "brought up to date: $checkout ($TARGET now imports megatron_mlp.launch)"
            exit 0
        fi
        if [ "$patched" -eq 1 ]; then
            echo "already patched: $checkout ($TARGET imports $MARKER); nothing to do"
            exit 0
        fi
        (cd "$checkout" && patch -p1 --dry-run -N -s -f < "$patch_file" >/dev/null 2>&1) \
            || die "the patch for $line does not apply to $checkout/$TARGET (Megatron-Core $version; local edits?). Nothing was changed. Try --line, or use python -m megatron_mlp.launch, which needs no patch"
        (cd "$checkout" && patch -p1 -N -s -f --no-backup-if-mismatch < "$patch_file")
        verify
        echo "patched: $checkout (Megatron-Core $version, line $line); reverse with: $0 $checkout --reverse"
        ;;
    reverse)
        if [ "$earlier" -eq 1 ]; then
            tmp="$(mktemp "$checkout/.$TARGET.XXXXXX")"
            grep -v "^$EARLIER" "$checkout/$TARGET" > "$tmp" || true
            chmod --reference="$checkout/$TARGET" "$tmp" 2>/dev/null || true
            mv "$tmp" "$checkout/$TARGET"
            echo "reversed the earlier line: $checkout"
            exit 0
        fi
        if [ "$patched" -eq 0 ]; then
            echo "not patched: $checkout; nothing to reverse"
            exit 0
        fi
        (cd "$checkout" && patch -p1 -R --dry-run -s -f < "$patch_file" >/dev/null 2>&1) \
            || die "the patch for $line cannot be reversed cleanly on $checkout/$TARGET (edited since?). Nothing was changed; remove the line importing $MARKER by hand"
        (cd "$checkout" && patch -p1 -R -s -f --no-backup-if-mismatch < "$patch_file")
        ! grep -q "$MARKER" "$checkout/$TARGET" || die "reverse: $TARGET still imports $MARKER"
        echo "reversed: $checkout (Megatron-Core $version, line $line)"
        ;;
esac
