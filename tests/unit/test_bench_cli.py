"""`megatron-mlp bench` keeps the node benchmarks; the research instruments run by path beside it."""
from __future__ import annotations

import ast
import os

import pytest
from benchmark_scripts import BENCHMARKS, REPO, run_script

from megatron_mlp.cli import BENCHMARKS as BENCH_COMMANDS
from megatron_mlp.cli import main as cli_main

INSTRUMENTS = ("faults", "interference", "contention")


def test_the_bench_command_offers_the_node_benchmarks_only():
    assert set(BENCH_COMMANDS) == {"io", "adam", "update"}


@pytest.mark.parametrize("name", INSTRUMENTS)
def test_a_research_instrument_is_no_bench_command(name, capsys):
    assert cli_main(["bench", name]) == 2
    assert f"unknown benchmark {name!r}" in capsys.readouterr().err


@pytest.mark.parametrize("name", INSTRUMENTS)
def test_each_research_instrument_answers_help_when_run_by_path(name):
    r = run_script(name, "--help", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"python benchmarks/{name}.py" in r.stdout


def test_the_package_never_imports_the_research_instruments():
    scripts = {f[:-3] for f in os.listdir(BENCHMARKS) if f.endswith(".py")} | {"benchmarks"}
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "megatron_mlp")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                found += [f"{os.path.relpath(path, REPO)}: {n}" for n in names if n.split(".")[0] in scripts]
    assert found == []
