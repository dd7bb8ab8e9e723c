"""A tier shared by the job's nodes (shared=job): each node's share, in plan and in the optimizer."""
from __future__ import annotations

import json

import pytest

from megatron_mlp.cli import main as cli_main
from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError
from megatron_mlp.megatron import arguments
from megatron_mlp.optim.placement import placement_tiers
from megatron_mlp.tier.shared import node_share, num_nodes_from_env
from megatron_mlp.tier.spec import parse_tier_paths

PATHS = "/local/nvme:bw=6GB/s,cap=3.5TB;/lustre/mlp:bw=200GB/s,cap=1600TB,shared=job,rw=separate"


def _plan(capsys, *argv):
    assert cli_main(["plan", "--paths", PATHS, "--num-params", "70B", "--subgroup-params", "20M",
                     "--ranks-per-node", "8", "--no-probe", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_shared_option_parses_and_a_bad_scope_names_the_flag():
    nvme, pfs = parse_tier_paths(PATHS)
    assert (nvme.shared_by_job, pfs.shared_by_job) == (False, True)
    with pytest.raises(ConfigError, match=r"--mlp-offload-paths: shared='cluster'"):
        parse_tier_paths("/x:shared=cluster")


def test_each_node_gets_its_share_of_a_job_shared_tier_and_node_local_tiers_stay_whole():
    nvme, pfs = parse_tier_paths(PATHS)
    assert node_share(nvme, 16) is nvme and node_share(pfs, 1) is pfs
    share = node_share(pfs, 16)
    assert (share.read_bytes_per_s, share.write_bytes_per_s, share.capacity_bytes) == (12.5e9, 12.5e9, 10**14)
    undeclared = node_share(parse_tier_paths("/pfs:shared=job")[0], 16)
    assert undeclared.read_bytes_per_s is None   # left to calibration or the (warned) default


def test_plan_for_several_nodes_shows_each_nodes_share_and_the_shared_tiers_total_load(capsys):
    d = _plan(capsys, "--nodes", "16")
    assert d["config"]["data_parallel_size"] == 128 and d["config"]["nodes"] == 16
    nvme, pfs = d["placement"]["tiers"]
    assert (nvme["read_bytes_per_s"], pfs["read_bytes_per_s"]) == (6e9, 12.5e9)
    assert pfs["capacity_bytes"] == 10**14 and "1/16 per node" in pfs["bandwidth_source"]
    (load,) = d["shared_tiers"]
    assert load["job_read_bytes_per_s"] == 200e9 and load["node_read_bytes_per_s"] == 12.5e9
    assert load["job_read_bytes_per_step"] == pfs["read_bytes"] * 8 * 16 > 0
    assert load["job_write_bytes_per_step"] == pfs["write_bytes"] * 8 * 16 > 0
    seconds = d["placement"]["predicted_seconds"]
    assert load["load_bytes_per_s"] == pytest.approx((pfs["read_bytes"] + pfs["write_bytes"]) * 128 / seconds)
    # The share is what one node would see of a node-local path of that bandwidth: same plan.
    assert cli_main(["plan", "--paths", "/local/nvme:bw=6GB/s,cap=3.5TB;/lustre/mlp:bw=12.5GB/s,cap=100TB,rw=separate",
                     "--num-params", "70B", "--subgroup-params", "20M", "--ranks-per-node", "8",
                     "--data-parallel-size", "128", "--no-probe", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["placement"]["tier_of"] == d["placement"]["tier_of"]
    assert alone["placement"]["predicted_seconds"] == pytest.approx(seconds)


def test_plan_table_names_the_share_and_the_load_when_a_tier_is_shared(capsys):
    assert cli_main(["plan", "--paths", PATHS, "--num-params", "70B", "--subgroup-params", "20M",
                     "--ranks-per-node", "8", "--nodes", "16", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "shared tier 1 (/lustre/mlp): 16 nodes share 200.00 GB/s read" in out
    assert "each node's share 12.50 / 12.50 GB/s" in out and "job-wide per step:" in out


def test_optimizer_places_state_with_the_nodes_share_when_the_launcher_says_how_many_nodes(monkeypatch):
    monkeypatch.setenv("GROUP_WORLD_SIZE", "16")
    args = arguments.add_mlp_offload_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--mlp-offload", "--mlp-offload-paths", PATHS, "--mlp-offload-calibration", "off"])
    args.use_distributed_optimizer, args.optimizer = True, "adam"
    config, notes = arguments.calibrated_config(arguments.config_from_args(args))
    assert isinstance(config, MLPOffloadConfig) and config.num_nodes == 16
    tiers = placement_tiers(config, ranks_per_node=8)
    assert (tiers[0].read_bytes_per_s, tiers[1].read_bytes_per_s) == (6e9, 12.5e9)
    assert tiers[1].capacity_bytes == 10**14
    assert any("shared by the job's 16 nodes: this node's share read 12.50 GB/s" in n for n in notes)


@pytest.mark.parametrize("env,nodes", [
    ({"GROUP_WORLD_SIZE": "4", "SLURM_JOB_NUM_NODES": "8"}, 4),   # torchrun's agents, one per node
    ({"SLURM_JOB_NUM_NODES": "8"}, 8), ({"NNODES": "3"}, 3),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 2), ({}, 1),
])
def test_node_count_comes_from_the_launcher_environment(env, nodes):
    assert num_nodes_from_env(env) == nodes
