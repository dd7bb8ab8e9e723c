"""Smoke test of `python benchmarks/faults.py --json` at tiny sizes, run by path: every kind
injected, detected, recovered, nothing lost, and the final state bit-equal to the fault-free
reference."""
from __future__ import annotations

import json
import os

import pytest
from benchmark_scripts import load, run_script

pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")
faults = load("faults")


def _campaign(disk_dir, *flags: str) -> dict:
    """A 5-step campaign, one fault per kind, a checkpoint every 2 steps, on ``disk_dir``: its JSON
    report (one object, nothing else on stdout), the run having ended with rc 0."""
    r = run_script("faults", "--json", "--steps", "5", "--faults-per-kind", "1", "--checkpoint-every", "2",
                   "--dir", disk_dir, *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_bench_faults_json_reports_zero_lost_and_bit_equal_for_every_kind(disk_dir):
    report = _campaign(disk_dir, "--num-params", "60000", "--subgroup-params", "10000")
    assert set(report["kinds"]) == set(faults.KINDS)
    for kind, k in report["kinds"].items():
        assert k["injected"] == 1, (kind, k)
        assert k["detected"] == k["injected"] and k["recovered"] == k["injected"], (kind, k)
        assert k["lost"] == 0 and k["bit_equal"], (kind, k)
    assert report["checksum"]["step_s_on"] > 0 and report["checksum"]["step_s_off"] > 0
    assert not [n for n in os.listdir(disk_dir) if n.startswith("mlp-faultbench-")]


def test_bench_faults_rejects_an_unknown_kind_naming_the_flag():
    from megatron_mlp.errors import ConfigError
    with pytest.raises(ConfigError, match="--kinds: unknown kind 'meteor'"):
        faults.main(["--kinds", "eio,meteor"])


def test_bench_faults_names_the_kind_that_did_not_finish_and_why_and_still_reports_the_others(disk_dir, monkeypatch,
                                                                                             capsys):
    real_run = faults._Campaign.run

    def run(self):
        if self.kind == "eio":   # e.g. a bound a busy machine could not meet
            raise RuntimeError("the device was too slow for this campaign")
        return real_run(self)

    monkeypatch.setattr(faults._Campaign, "run", run)
    rc = faults.main(["--json", "--steps", "4", "--faults-per-kind", "1", "--num-params", "60000",
                      "--subgroup-params", "10000", "--checkpoint-every", "2", "--dir", disk_dir,
                      "--kinds", "eio,short_write"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert report["failed_kinds"] == {"eio": "RuntimeError: the device was too slow for this campaign"}
    assert report["kinds"]["eio"]["lost"] is None and not report["kinds"]["eio"]["bit_equal"]
    assert report["kinds"]["short_write"]["lost"] == 0 and report["kinds"]["short_write"]["bit_equal"]


def test_bench_faults_on_the_moe_layout_loses_nothing_when_faults_land_on_either_shard(disk_dir):
    # A dense and an expert optimizer with their own scratch on the same two tiers (an MoE rank):
    # every kind is injected into one of them, detected, recovered, and the state of both is
    # bit-equal to the fault-free run of the same layout.
    report = _campaign(disk_dir, "--layout", "moe", "--num-params", "160000", "--subgroup-params", "10000")
    assert report["layout"] == "moe" and report["num_subgroups"] == 16
    for kind, k in report["kinds"].items():
        assert k["injected"] == 1 and k["detected"] == 1 and k["recovered"] == 1, (kind, k)
        assert k["lost"] == 0 and k["bit_equal"], (kind, k)


def test_bench_faults_under_a_host_budget_streams_pieces_and_loses_nothing(disk_dir):
    # --host-memory: the pool in pieces (a budget smaller than one subgroup) under every fault kind.
    report = _campaign(disk_dir, "--num-params", "640000", "--subgroup-params", "160000", "--host-memory", "1MB")
    assert report["host_memory_bytes"] == 1_000_000
    for kind, k in report["kinds"].items():
        assert k["lost"] == 0 and k["bit_equal"], (kind, k)
        assert k["detected"] == k["injected"] == 1, (kind, k)


def test_bench_faults_with_one_cached_subgroup_beside_a_short_stream_neither_hangs_nor_loses_anything(disk_dir):
    # One cached subgroup beside a stream of fewer pieces than a subgroup has: when a tier's writes
    # fail, the failed write-back keeps its whole buffer (the only copy of its new state), and the
    # subgroup the step keeps could not be fetched within the budget -- the step spun for good. It
    # now goes over the budget by that buffer, as the whole-buffer pipeline does.
    from megatron_mlp.config import MLPOffloadConfig
    from megatron_mlp.optim.host_memory import plan_host_memory
    config = MLPOffloadConfig.from_paths(disk_dir, subgroup_params=160000, host_memory_bytes=3_800_000,
                                         block_bytes=faults.PIECE_BLOCK_BYTES, calibration="off")
    memory = plan_host_memory(config, 12 * 163840)
    assert memory.cache_buffers == 1 and memory.stream_pieces < 10, memory   # a subgroup has 10 pieces
    r = run_script("faults", "--json", "--steps", "8", "--faults-per-kind", "1", "--checkpoint-every", "2",
                   "--dir", disk_dir, "--num-params", "640000", "--subgroup-params", "160000",
                   "--host-memory", "3.8MB", "--kinds", "enospc,tier_vanish", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    for kind, k in json.loads(r.stdout)["kinds"].items():
        assert k["lost"] == 0 and k["bit_equal"], (kind, k)
        assert k["detected"] == k["injected"] == 1, (kind, k)
