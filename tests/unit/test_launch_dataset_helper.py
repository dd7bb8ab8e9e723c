"""The launcher builds Megatron-LM's dataset index helper (``megatron/core/datasets/helpers_cpp``) for
the interpreter that runs it, or stops before Megatron starts with one line saying what to run.

Megatron-LM's own compile step runs ``make`` there, and its Makefile asks ``python3-config`` for the
extension suffix: in a venv without one, or under a pyenv shim that answers for the checkout's
``.python-version``, the helper is built for another Python and rank 0 dies at its import. The
checkouts here are made in the test: a stand-in ``helpers.cpp`` (a pybind11 module of one function),
a Makefile the launcher never runs, a build for another Python, and a ``compile_helpers`` that fails
as that wrong build does.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from megatron_mlp import launch
from tests.unit.test_launch import FAKE_FILES

REPO = Path(__file__).resolve().parents[2]
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
OTHER_BUILD = "helpers_cpp.cpython-312-x86_64-linux-gnu.so"
HELPER_CPP = """
#include <pybind11/pybind11.h>
PYBIND11_MODULE(helpers_cpp, m) { m.def("answer", []() { return 42; }); }
"""

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pybind11") is None,
                                reason="pybind11 is not installed: the helper cannot be built here")


def _datasets_dir(root: Path) -> Path:
    d = root / "megatron" / "core" / "datasets"
    d.mkdir(parents=True, exist_ok=True)
    (d / "helpers.cpp").write_text(HELPER_CPP)
    (d / "Makefile").write_text("# stands for Megatron-LM's dataset Makefile (never run by the launcher)\n")
    (d / OTHER_BUILD).write_bytes(b"built for another Python")
    return d


def _import_helper(path: str):
    spec = importlib.util.spec_from_file_location("helpers_cpp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_helper_is_built_for_this_interpreter_when_only_another_pythons_build_is_there(tmp_path):
    d = _datasets_dir(tmp_path)
    logged = []
    built = launch.build_dataset_helper(str(d), log=logged.append)
    assert built == str(d / f"helpers_cpp{SUFFIX}")
    assert _import_helper(built).answer() == 42
    assert len(logged) == 1 and OTHER_BUILD in logged[0] and sys.executable in logged[0]
    assert sorted(os.listdir(d)) == sorted(["Makefile", "helpers.cpp", OTHER_BUILD, f"helpers_cpp{SUFFIX}"])
    # Up to date now: nothing to build, until the source is newer than the build.
    assert launch.build_dataset_helper(str(d)) is None
    old = os.path.getmtime(d / "helpers.cpp") - 60
    os.utime(d / f"helpers_cpp{SUFFIX}", (old, old))
    assert launch.helper_needs_build(str(d))


def test_helper_is_left_alone_when_no_makefile_builds_it_there(tmp_path):
    # An installed megatron-core ships helpers.cpp beside its build and no Makefile: not ours to touch.
    d = _datasets_dir(tmp_path)
    (d / "Makefile").unlink()
    assert not launch.helper_needs_build(str(d))
    assert launch.build_dataset_helper(str(d)) is None


def test_a_failed_build_names_the_command_to_run_and_leaves_no_partial_file(tmp_path, monkeypatch):
    d = _datasets_dir(tmp_path)
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(launch.DatasetHelperError) as info:
        launch.build_dataset_helper(str(d))
    message = str(info.value)
    assert "\n" not in message and f"run `false -O3" in message and f"helpers_cpp{SUFFIX}`" in message
    assert sorted(os.listdir(d)) == sorted(["Makefile", "helpers.cpp", OTHER_BUILD])


def _checkout(tmp_path: Path) -> Path:
    """test_launch's fake checkout, plus the helper's directory and a stock compile step that fails
    as Megatron's make does when python3-config answers for another Python."""
    root = tmp_path / "Megatron-LM"
    for rel, text in FAKE_FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (root / "megatron" / "core" / "__init__.py").parent.mkdir(parents=True, exist_ok=True)
    (root / "megatron" / "core" / "__init__.py").write_text("")
    d = _datasets_dir(root)
    (d / "__init__.py").write_text("")
    (d / "utils.py").write_text(
        "def compile_helpers():\n"
        "    raise SystemExit('stock make: helpers_cpp built for another Python')\n")
    (root / "pretrain_gpt.py").write_text(textwrap.dedent("""
        import json, os
        from megatron.core.datasets.utils import compile_helpers   # as initialize.py does, on rank 0
        compile_helpers()
        from megatron.core.datasets import helpers_cpp
        json.dump({'answer': helpers_cpp.answer(), 'file': helpers_cpp.__file__}, open(os.environ['FAKE_OUT'], 'w'))
    """))
    return root


def _launch(root: Path, pythonpath: list[str]):
    out = root.parent / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath + [str(REPO)]), FAKE_OUT=str(out))
    env.pop("MLP_OFFLOAD_CPU", None)
    proc = subprocess.run([sys.executable, "-m", "megatron_mlp.launch", str(root / "pretrain_gpt.py")],
                          env=env, cwd=root.parent, capture_output=True, text=True, timeout=300)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_megatrons_compile_step_builds_the_helper_for_this_interpreter_under_the_launcher(tmp_path):
    root = _checkout(tmp_path)
    proc, out = _launch(root, [])
    assert proc.returncode == 0, proc.stderr
    d = root / "megatron" / "core" / "datasets"
    assert out == {"answer": 42, "file": str(d / f"helpers_cpp{SUFFIX}")}
    assert f"building Megatron's dataset helper for {sys.executable}" in proc.stdout


def test_launcher_stops_before_megatron_with_one_line_when_pybind11_is_missing(tmp_path):
    root = _checkout(tmp_path)
    hidden = tmp_path / "no-pybind11" / "pybind11"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('pybind11 hidden by the test')\n")
    proc, out = _launch(root, [str(hidden.parent)])
    assert proc.returncode == 2 and out is None, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron_mlp.launch: ")
    assert f"`{sys.executable} -m pip install pybind11`" in lines[0] and f"helpers_cpp{SUFFIX}" in lines[0]
