"""`megatron-mlp plan`: table and JSON output, errors."""
from __future__ import annotations

import json

import pytest

from megatron_mlp.cli import main as cli_main
from megatron_mlp.optim.subgroups import SubgroupPlan

# A subgroup of 100M params as the optimizer stores it: 1.2 GB of state in three 4096-aligned arrays.
REGION = SubgroupPlan([(0, 100_000_000)], 100_000_000)[0].region_bytes
CACHE_2 = str(2 * REGION + 10**8)   # a host cache of two such buffers (and a part of a third)

def run(capsys, *argv):
    rc = cli_main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_plan_splits_state_by_declared_bandwidth_when_calibration_off(capsys, tmp_path):
    (tmp_path / "fast").mkdir(), (tmp_path / "slow").mkdir()   # plan creates nothing
    paths = f"{tmp_path}/fast:bw=6GB/s,rw=separate;{tmp_path}/slow:bw=3GB/s,rw=separate"
    rc, out, err = run(capsys, "--paths", paths, "--num-params", "300M", "--subgroup-params", "10M",
                       "--ranks-per-node", "1", "--calibration", "off", "--working-buffers", "0", "--json")
    assert rc == 0, err
    d = json.loads(out)  # stdout is exactly one JSON object
    tiers = d["placement"]["tiers"]
    assert [t["num_subgroups"] for t in tiers] == [20, 10]
    assert tiers[0]["stored_bytes"] == 2 * tiers[1]["stored_bytes"]
    assert d["config"]["state_bytes_per_rank"] == 300_000_000 * 12
    assert all(t["bandwidth_source"] == "declared" for t in tiers)
    # both paths are on one device here: the warning says so
    assert any("same device" in w for w in d["warnings"])


def test_table_lists_every_tier_with_predicted_time_and_lower_bound(capsys, tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    rc, out, _ = run(capsys, "--paths", f"{tmp_path}/a;{tmp_path}/b:bw=2GB/s", "--num-params", "1B",
                     "--subgroup-params", "100M", "--ranks-per-node", "4", "--host-cache-bytes", CACHE_2,
                     "--calibration", "off")
    assert rc == 0
    for text in (f"{tmp_path}/a", f"{tmp_path}/b", "default (assumed 1 GB/s)", "declared", "lower bound",
                 "predicted update I/O per step", "2.40 GB of a 2.40 GB budget", "alternating order: 3 subgroups", "ranks per node: 4"):
        assert text in out, text


def test_resident_cache_model_keeps_cached_subgroups_still(capsys, tmp_path):
    argv = ["--paths", f"{tmp_path}:bw=1GB/s,rw=shared", "--num-params", "1B", "--subgroup-params", "100M",
            "--ranks-per-node", "1", "--host-cache-bytes", CACHE_2, "--calibration", "off", "--json"]
    rc, out, _ = run(capsys, *argv, "--cache-model", "resident")
    resident = json.loads(out)["placement"]
    rc, out, _ = run(capsys, *argv, "--working-buffers", "0")
    alternate = json.loads(out)["placement"]
    assert resident["cached_subgroups"] == [8, 9] and resident["tiers"][0]["read_bytes"] == 8 * REGION
    assert alternate["cached_subgroups"] == [0, 1, 8, 9] and alternate["tiers"][0]["read_bytes"] == 8 * REGION
    assert resident["predicted_seconds"] == pytest.approx(alternate["predicted_seconds"])


def test_working_buffers_carry_subgroups_over_as_the_optimizer_does(capsys, tmp_path):
    # 10 subgroups of 1.2 GB, 2 cached and (by default) 5 carried by the optimizer's working
    # buffers: each iteration reads 3 and writes 3, as OffloadAdam does.
    argv = ["--paths", f"{tmp_path}:bw=1GB/s,rw=shared", "--num-params", "1B", "--subgroup-params", "100M",
            "--ranks-per-node", "1", "--host-cache-bytes", CACHE_2, "--calibration", "off"]
    rc, out, _ = run(capsys, *argv, "--json")
    d = json.loads(out)
    assert d["config"]["working_buffers"] == 5
    tier = d["placement"]["tiers"][0]
    assert tier["read_bytes"] == tier["write_bytes"] == 3 * REGION
    assert d["placement"]["predicted_seconds"] == pytest.approx(6 * REGION / 1e9)
    rc, out, _ = run(capsys, *argv)
    assert "working buffers: 5 more subgroups" in out
    rc, out, _ = run(capsys, *argv, "--cache-model", "resident", "--json")
    assert json.loads(out)["config"]["working_buffers"] == 0, "only the alternating order carries them over"
    rc, _, err = run(capsys, *argv, "--working-buffers", "-1")
    assert rc == 2 and "--working-buffers" in err and "-1" in err


def test_shard_per_rank_follows_data_parallel_size(capsys, tmp_path):
    rc, out, _ = run(capsys, "--paths", f"{tmp_path}:bw=1GB/s", "--num-params", "1B", "--subgroup-params", "30M",
                     "--ranks-per-node", "2", "--data-parallel-size", "8", "--calibration", "off", "--json")
    d = json.loads(out)
    assert d["config"]["params_per_rank"] == 125_000_000 and d["config"]["num_subgroups"] == 5


def test_capacity_error_exits_2_and_says_bytes_missing(capsys, tmp_path):
    rc, out, err = run(capsys, "--paths", f"{tmp_path}:bw=1GB/s,cap=1GB", "--num-params", "1B",
                       "--ranks-per-node", "1", "--calibration", "off")
    assert rc == 2 and out == ""
    assert "bytes missing" in err and str(tmp_path) in err


def test_no_probe_plans_paths_that_do_not_exist_here(capsys, tmp_path):
    ghost = tmp_path / "only-on-compute-nodes"
    rc, out, _ = run(capsys, "--paths", f"{ghost}:bw=6GB/s,rw=separate", "--num-params", "7B",
                     "--ranks-per-node", "4", "--no-probe", "--working-buffers", "0", "--json")
    assert rc == 0 and not ghost.exists()
    stored = sum(sg.region_bytes for sg in SubgroupPlan([(0, 7 * 10**9 // 4)], 100_000_000))
    assert json.loads(out)["placement"]["predicted_seconds"] == pytest.approx(stored * 4 / 6e9)


def test_bad_count_rejected_with_flag(capsys, tmp_path):
    rc, _, err = run(capsys, "--paths", str(tmp_path), "--num-params", "lots", "--ranks-per-node", "1",
                     "--calibration", "off")
    assert rc == 2 and "--num-params" in err and "lots" in err


def test_counts_use_the_one_grammar_and_subgroups_are_the_optimizers(capsys, tmp_path):
    rc, out, err = run(capsys, "--paths", f"{tmp_path}:bw=1GB/s", "--num-params", "2.5e4", "--subgroup-params", "1e4",
                       "--ranks-per-node", "1", "--calibration", "off", "--json")
    assert rc == 0, err
    d = json.loads(out)
    plan = SubgroupPlan([(0, 25_000)], 10_000)
    assert d["config"]["num_subgroups"] == len(plan) == 3
    assert d["placement"]["tiers"][0]["stored_bytes"] == sum(sg.region_bytes for sg in plan)
    assert d["config"]["state_bytes_per_rank"] == 12 * 25_000
    rc, _, err = run(capsys, "--paths", str(tmp_path), "--num-params", "1.5", "--ranks-per-node", "1")
    assert rc == 2 and "--num-params: '1.5' is not a whole count" in err, err


def test_plan_creates_nothing_and_says_the_path_does_not_exist_when_a_tier_path_is_missing(capsys, tmp_path):
    rc, out, err = run(capsys, "--paths", f"{tmp_path}/nope/deeper", "--num-params", "1M", "--ranks-per-node", "1",
                       "--calibration", "off")
    assert rc == 2 and f"--paths: {tmp_path}/nope/deeper does not exist" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,flag", [
    (["--num-params", "1e30"], "--num-params"),
    (["--num-params", "10M", "--subgroup-params", "1"], "--subgroup-params"),
    (["--num-params", "10M", "--subgroup-params", "0.5"], "--subgroup-params"),
])
def test_plan_refuses_sizes_beyond_planning_naming_the_flag_when_counts_are_absurd(capsys, tmp_path, argv, flag):
    import time
    t0 = time.monotonic()
    rc, out, err = run(capsys, "--paths", str(tmp_path), "--ranks-per-node", "1", "--calibration", "off", *argv)
    assert rc == 2 and err.startswith(f"megatron-mlp plan: error: {flag}:"), err
    assert time.monotonic() - t0 < 5


def test_plan_names_the_cache_flag_when_the_calibration_cache_is_under_a_file(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, out, err = run(capsys, "--paths", f"{tmp_path}:bw=1GB/s", "--num-params", "1M", "--ranks-per-node", "1",
                       "--calibration-cache", f"{blocker}/cal.json")
    assert rc == 2 and f"--calibration-cache: cannot use {blocker}/cal.json as the calibration cache" in err, err


def test_host_memory_is_spent_as_the_optimizer_spends_it_when_given(capsys, tmp_path):
    # 1B params on one rank: 4 GB of bf16 staging, then the pool in pieces: a stream of 16 pieces
    # (24 MiB: one 8 MiB I/O block of each array) and 1.2 GB subgroup buffers of cache beside it.
    from megatron_mlp.optim.host_memory import STREAM_PIECES, piece_buffer_bytes, stream_piece_params
    piece = piece_buffer_bytes(stream_piece_params(8 << 20))
    argv = ["--paths", f"{tmp_path}:bw=1GB/s,rw=shared", "--num-params", "1B", "--subgroup-params", "100M",
            "--ranks-per-node", "1", "--calibration", "off"]
    rc, out, err = run(capsys, *argv, "--host-memory", str(4 * 10**9 + 6 * REGION + STREAM_PIECES * piece + 5),
                       "--json")
    assert rc == 0, err
    d = json.loads(out)
    m = d["config"]["host_memory"]
    assert m["staging_bytes"] == 4 * 10**9 and (m["working_buffers"], m["cache_buffers"]) == (0, 6)
    assert m["stream_pieces"] == STREAM_PIECES and m["piece_bytes"] == piece
    assert d["config"]["working_buffers"] == 0 and d["config"]["host_cache_bytes"] == 6 * REGION
    tier = d["placement"]["tiers"][0]
    assert tier["read_bytes"] == tier["write_bytes"] == 4 * REGION, "the same as a cache of 6 buffers"
    rc, _, err = run(capsys, *argv, "--host-memory", str(4 * 10**9 + 3 * piece))
    assert rc == 2 and "--mlp-offload-host-memory" in err and "minimum pipeline" in err


def test_the_optimizer_predicts_the_update_time_plan_prints_when_given_the_same_tiers_and_budget(capsys, disk_dir):
    # One function (placement.model.update_seconds) for plan, bench update and the optimizer's
    # start-up log: the same tiers and budget give the same figure.
    import os
    from megatron_mlp.config import MLPOffloadConfig
    from megatron_mlp.optim.offload_adam import OffloadAdam
    from megatron_mlp.optim.placement.plan_cli import STAGING_BYTES_PER_PARAM
    fast, slow = os.path.join(disk_dir, "fast"), os.path.join(disk_dir, "slow")
    os.mkdir(fast)
    os.mkdir(slow)
    paths, numel, budget = f"{fast}:bw=2GB/s;{slow}:bw=500MB/s", 4_000_000, 64 * 10**6
    rc, out, err = run(capsys, "--paths", paths, "--num-params", str(numel), "--subgroup-params", "250000",
                       "--ranks-per-node", "1", "--calibration", "off", "--host-memory", str(budget), "--json")
    assert rc == 0, err
    planned = json.loads(out)["predicted_update_seconds"]
    config = MLPOffloadConfig.from_paths(paths, subgroup_params=250_000, calibration="off",
                                         host_memory_bytes=budget, use_tokens=False)
    with OffloadAdam(config, [(0, numel)], [{"lr": 1e-3}], staging_bytes=STAGING_BYTES_PER_PARAM * numel) as opt:
        assert planned > 0 and opt.predicted_update_s == pytest.approx(planned, rel=1e-9)
