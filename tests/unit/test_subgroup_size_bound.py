"""A subgroup size whose page padding outweighs the state is refused, by the optimizer's config and by
``megatron-mlp plan``, naming the flag and the smallest sensible size; and ``plan`` plans for a
compute node's memory and cores (``--node-memory``, ``--node-cores``) from any machine, while the
optimizer keeps checking the machine it runs on."""
from __future__ import annotations

import json
import os

import pytest

from megatron_mlp.config import (SUBGROUP_PADDING_BOUND, MLPOffloadConfig, smallest_sensible_subgroup_params,
                                 subgroup_padding_fraction)
from megatron_mlp.errors import ConfigError
from megatron_mlp.optim.placement.plan_cli import main as plan_main
from megatron_mlp.optim.subgroups import SubgroupPlan


@pytest.mark.parametrize("size", [1, 100, 700, 1025, 2500, 9309])
def test_config_refuses_a_subgroup_size_whose_padding_passes_the_bound_naming_the_flag_and_smallest_size(
        tmp_path, size):
    with pytest.raises(ConfigError) as e:
        MLPOffloadConfig.from_paths(str(tmp_path), subgroup_params=size)
    msg = str(e.value)
    assert msg.startswith(f"--mlp-offload-subgroup-size: {size:,} params")
    assert f"at least {smallest_sensible_subgroup_params():,}" in msg and "multiple of 1024" in msg


@pytest.mark.parametrize("size", [931, 1000, 1024, 3000, 9310, 10241, 25_000_000, 100_000_000])
def test_config_accepts_a_subgroup_size_whose_padding_stays_within_the_bound(tmp_path, size):
    assert MLPOffloadConfig.from_paths(str(tmp_path), subgroup_params=size).subgroup_params == size


def test_every_size_from_the_smallest_sensible_one_pads_within_the_bound_and_the_one_below_does_not():
    smallest = smallest_sensible_subgroup_params()
    assert all(subgroup_padding_fraction(s) <= SUBGROUP_PADDING_BOUND for s in range(smallest, 5 * smallest))
    assert subgroup_padding_fraction(smallest - 1) > SUBGROUP_PADDING_BOUND


@pytest.mark.parametrize("size", [1, 700, 1000, 1025, 4096, 9999])
def test_the_padding_rule_is_the_one_the_subgroups_are_stored_with(size):
    sg = SubgroupPlan([(0, size)], size)[0]
    assert (sg.region_bytes - sg.state_bytes) / sg.state_bytes == pytest.approx(subgroup_padding_fraction(size))


def test_plan_refuses_a_subgroup_size_that_pads_too_much_naming_its_own_flag(capsys, tmp_path):
    rc = plan_main(["--paths", f"{tmp_path}:bw=1GB/s", "--num-params", "2M", "--subgroup-params", "1",
                    "--ranks-per-node", "1", "--calibration", "off"])
    err = capsys.readouterr().err
    assert rc == 2 and "--subgroup-params: 1 params" in err and "9,310" in err
    assert not os.listdir(tmp_path)


def _physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _plan(tmp_path, *extra):
    return ["--paths", f"{tmp_path}:bw=1GB/s", "--num-params", "1B", "--ranks-per-node", "4",
            "--calibration", "off", "--no-probe", *extra]


def test_plan_plans_a_budget_larger_than_this_machine_for_a_node_that_has_the_memory(capsys, tmp_path):
    budget = 2 * _physical_memory()
    rc = plan_main(_plan(tmp_path, "--host-memory", str(budget), "--node-memory", str(4 * budget),
                         "--node-cores", "64", "--json"))
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["config"]["host_memory"]["budget_bytes"] == budget
    assert out["config"]["node_memory_bytes"] == 4 * budget
    assert out["config"]["node_cores"] == 64 and out["config"]["adam_threads_per_rank"] == 16


def test_plan_refuses_a_budget_larger_than_this_machine_without_node_memory(capsys, tmp_path):
    rc = plan_main(_plan(tmp_path, "--host-memory", str(2 * _physical_memory())))
    assert rc == 2 and "more than this machine's memory" in capsys.readouterr().err


def test_plan_refuses_budgets_the_node_memory_cannot_hold_for_all_its_ranks(capsys, tmp_path):
    rc = plan_main(_plan(tmp_path, "--host-memory", "4GB", "--node-memory", "15GB"))
    err = capsys.readouterr().err
    assert rc == 2 and "--node-memory" in err and "4 ranks" in err


@pytest.mark.parametrize("argv,flag", [(["--node-memory", "0"], "--node-memory"),
                                       (["--node-memory", "lots"], "--node-memory"),
                                       (["--node-cores", "0"], "--node-cores")])
def test_plan_refuses_a_node_description_that_makes_no_sense_naming_the_flag(capsys, tmp_path, argv, flag):
    rc = plan_main(_plan(tmp_path, *argv))
    assert rc == 2 and flag in capsys.readouterr().err


def test_the_optimizer_checks_the_machine_it_runs_on_whatever_node_it_was_planned_for(tmp_path):
    pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")
    from megatron_mlp.optim.offload_adam import OffloadAdam
    budget = 2 * _physical_memory()
    config = MLPOffloadConfig.from_paths(str(tmp_path), subgroup_params=1024, host_memory_bytes=budget,
                                         node_memory_bytes=4 * budget, calibration="off", use_tokens=False)
    with pytest.raises(ConfigError, match="more than this machine's memory"):
        OffloadAdam(config, [(0, 4096)], [{"lr": 1e-3}])
    assert not os.listdir(tmp_path)
