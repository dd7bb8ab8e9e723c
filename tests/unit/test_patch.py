"""patches/megatron-lm and scripts/apply_megatron_patch.sh against synthetic checkouts.

A synthetic checkout is made from the patch itself: its pre-image (context and removed lines)
between lines of our own, plus a package_info.py with the version. No Megatron-LM code is needed.
"""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches" / "megatron-lm"
SCRIPT = REPO / "scripts" / "apply_megatron_patch.sh"
LINES = ["core_r0.13", "core_r0.14", "core_r0.15", "core_r0.16", "core_r0.17", "core_r0.18", "core_r0.19", "main"]
HOOK = "import megatron_mlp.launch as _mlp_offload_hooks"
EARLIER = "import megatron_mlp.megatron.hooks as _mlp_offload_hooks"

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")


def _hunk(line: str) -> tuple[int, list[str], list[str]]:
    """(start line, pre-image, added lines) of the single hunk of a line's patch."""
    text = (PATCHES / line / "pretrain_gpt.patch").read_text().splitlines()
    start = int(re.match(r"@@ -(\d+)", next(t for t in text if t.startswith("@@"))).group(1))
    body = text[next(i for i, t in enumerate(text) if t.startswith("@@")) + 1:]
    pre = [t[1:] for t in body if t[:1] in (" ", "-")]
    added = [t[1:] for t in body if t.startswith("+")]
    return start, pre, added


def _checkout(tmp_path: Path, line: str, minor: int | None = None) -> Path:
    root = tmp_path / f"Megatron-LM-{line}"
    (root / "megatron" / "core").mkdir(parents=True)
    if minor is None:
        minor = 20 if line == "main" else int(line.split(".")[1])
    (root / "megatron" / "core" / "package_info.py").write_text(
        f"MAJOR = 0\nMINOR = {minor}\nPATCH = 0\nPRE_RELEASE = ''\n")
    start, pre, _ = _hunk(line)
    body = [f"# synthetic line {i}" for i in range(1, start)] + pre + ["", "def main():", "    return 0", ""]
    (root / "pretrain_gpt.py").write_text("\n".join(body))
    return root


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("line", LINES)
def test_patch_adds_only_the_hook_line_with_minimal_context(line):
    _, pre, added = _hunk(line)
    assert len(added) == 1 and HOOK in added[0] and "install()" in added[0]
    assert len(pre) <= 6, "no more of Megatron's code than 3 lines of context on each side"
    assert (PATCHES / line / "README.md").is_file()


@pytest.mark.parametrize("line", LINES)
def test_apply_check_reverse_round_trip_restores_the_file_when_checkout_is_clean(tmp_path, line):
    root = _checkout(tmp_path, line)
    original = (root / "pretrain_gpt.py").read_text()
    assert _run(root, "--check").returncode == 1
    applied = _run(root)
    assert applied.returncode == 0 and f"line {line}" in applied.stdout, applied.stderr
    patched = (root / "pretrain_gpt.py").read_text()
    assert patched.count(HOOK) == 1
    ast.parse(patched)
    assert _run(root, "--check").returncode == 0
    reversed_ = _run(root, "--reverse")
    assert reversed_.returncode == 0, reversed_.stderr
    assert (root / "pretrain_gpt.py").read_text() == original
    assert not list(root.glob("*.orig")) and not list(root.glob("*.rej"))


def test_apply_says_already_patched_and_changes_nothing_when_run_twice(tmp_path):
    root = _checkout(tmp_path, "core_r0.16")
    assert _run(root).returncode == 0
    once = (root / "pretrain_gpt.py").read_text()
    again = _run(root)
    assert again.returncode == 0 and "already patched" in again.stdout
    assert (root / "pretrain_gpt.py").read_text() == once


def test_a_checkout_patched_with_the_earlier_line_is_brought_up_to_date_in_place(tmp_path):
    root = _checkout(tmp_path, "core_r0.16")
    assert _run(root).returncode == 0
    current = (root / "pretrain_gpt.py").read_text()
    (root / "pretrain_gpt.py").write_text(current.replace(HOOK, EARLIER))
    check = _run(root, "--check")
    assert check.returncode == 1 and "earlier line" in check.stdout
    upgraded = _run(root)
    assert upgraded.returncode == 0 and "up to date" in upgraded.stdout, upgraded.stderr
    assert (root / "pretrain_gpt.py").read_text() == current
    assert _run(root, "--check").returncode == 0


def test_reverse_removes_the_earlier_line_too(tmp_path):
    root = _checkout(tmp_path, "core_r0.16")
    original = (root / "pretrain_gpt.py").read_text()
    assert _run(root).returncode == 0
    patched = (root / "pretrain_gpt.py").read_text()
    (root / "pretrain_gpt.py").write_text(patched.replace(HOOK, EARLIER))
    result = _run(root, "--reverse")
    assert result.returncode == 0, result.stderr
    assert (root / "pretrain_gpt.py").read_text() == original


def test_apply_refuses_and_changes_nothing_when_context_was_edited_locally(tmp_path):
    root = _checkout(tmp_path, "core_r0.16")
    text = (root / "pretrain_gpt.py").read_text()
    _, pre, _ = _hunk("core_r0.16")
    edited = text.replace(pre[2], pre[2] + "  # a local edit")
    (root / "pretrain_gpt.py").write_text(edited)
    result = _run(root)
    assert result.returncode == 1 and "does not apply" in result.stderr and "Nothing was changed" in result.stderr
    assert (root / "pretrain_gpt.py").read_text() == edited


def test_unknown_old_version_is_refused_with_the_launcher_as_alternative(tmp_path):
    root = _checkout(tmp_path, "core_r0.13", minor=12)
    result = _run(root)
    assert result.returncode == 2 and "0.12 is not supported" in result.stderr
    assert "megatron_mlp.launch" in result.stderr


def test_newer_version_than_listed_uses_the_patch_for_main(tmp_path):
    root = _checkout(tmp_path, "main", minor=21)
    result = _run(root)
    assert result.returncode == 0 and "using the patch for main" in result.stdout, result.stderr


def test_line_override_selects_another_patch(tmp_path):
    root = _checkout(tmp_path, "core_r0.18", minor=17)  # a 0.17 label on a tree shaped like 0.18
    assert _run(root, "--line", "core_r0.18").returncode == 0


def test_directory_without_megatron_is_reported_as_not_a_checkout(tmp_path):
    result = _run(tmp_path)
    assert result.returncode == 2 and "is not a Megatron-LM checkout" in result.stderr


def test_reverse_is_a_no_op_when_not_patched(tmp_path):
    root = _checkout(tmp_path, "main")
    result = _run(root, "--reverse")
    assert result.returncode == 0 and "nothing to reverse" in result.stdout
