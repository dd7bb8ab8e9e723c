"""Smoke test of `megatron-mlp bench update` with tiny sizes (figures are not asserted, structure is).

`--json` prints the run's `UpdateResult` in sections (baseline, mlp, speedup, paired, references, ...)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import pytest

from megatron_mlp.bench import update, update_rank, update_report, update_result, update_tiers
from megatron_mlp.errors import ConfigError
from megatron_mlp.optim.placement.reference import fluid_update_seconds, tier_io_seconds
from megatron_mlp.tier.calibration import classify_shared_rw


REGION = 3 * (-(-50000 * 4 // 4096) * 4096)   # p, m, v of 50000 params, each 4096-aligned


def run_json(capsys, *argv) -> dict:
    assert update.main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, "--json must print exactly one JSON object on stdout"
    s = json.loads(out)
    sections = {f.name for f in dataclasses.fields(update_result.UpdateResult)}
    assert set(s) == {"benchmark"} | sections, "--json prints the UpdateResult's sections"
    return s


@pytest.mark.parametrize("ranks", [1, 2])
def test_bench_update_reports_baseline_mlp_ablation_and_references_when_run_tiny(capsys, disk_dir, shm_dir, ranks):
    # 12 subgroups per rank: a budget of seven buffers (2 cached, 5 carried by the working buffers)
    # cannot hold them all, so every step reads and writes back five.
    # The two-rank run also shows that --no-interference skips the measurement alongside the kernel.
    skip_interference = ["--no-interference"] if ranks == 2 else []
    budget = 7 * REGION + 1000
    s = run_json(capsys, "--paths", f"{disk_dir};{shm_dir}:qos=1GB/s", "--num-params", str(600000 * ranks),
                 "--subgroup-params", "50000", "--host-memory", str(budget), "--calib-bytes", "8MB",
                 "--steps", "3", "--ranks", str(ranks), *skip_interference)
    for section, key in (("baseline", "seconds"), ("mlp", "seconds"), ("speedup", "update"),
                         ("references", "io_s"), ("references", "predicted_s"), ("baseline", "backward_grad_write_s"),
                         ("references", "policy_s"), ("speedup", "reference")):
        assert s[section][key] > 0, (section, key)
    assert s["speedup"]["reference"] == pytest.approx(s["baseline"]["seconds"] / s["references"]["policy_s"])
    # Both sides within the one stated budget per rank, measured.
    assert s["config"]["host_memory_bytes"] == budget
    assert 0 < s["baseline"]["host_bytes"] <= budget and 0 < s["mlp"]["host_bytes"] <= budget
    assert s["mlp"]["host_memory"]["cache_buffers"] == 2 and s["mlp"]["host_memory"]["working_buffers"] == 5
    assert [row["host_memory_bytes"] for row in s["sweep"]] == [budget]
    assert all(t["after"]["read_bytes_per_s"] > 0 for t in s["tiers"]), "bandwidth measured after the steps too"
    assert isinstance(s["faster_than_reference"], list)
    names = [a["name"] for a in s["ablation"]]
    assert names[0].startswith("ZeRO-3") and names[-1].endswith("(= MLP-Offload)") and len(names) == 7
    assert s["ablation"][-1]["seconds"] == s["mlp"]["seconds"]
    assert s["mlp"]["no_checksum_s"] > 0 and s["mlp"]["checksum_cost_s"] is not None
    assert [t["label"] for t in s["tiers"]] == ["real", "emulated"]
    for t in s["tiers"]:   # the read/write limit by calibration's rule, as `megatron-mlp calibrate` labels it
        n = t["measured_bytes"]
        mixed_s = 2 * n / t["concurrent_bytes_per_s"]
        assert t["shared_rw_limit"] == classify_shared_rw(n, t["read_bytes_per_s"], t["write_bytes_per_s"], mixed_s)
    assert s["emulated_paths"] == [shm_dir]
    assert "alongside_adam" not in s["tiers"][1], "an emulated tier runs at its cap: nothing to measure"
    if skip_interference:
        assert "alongside_adam" not in s["tiers"][0]
    else:
        alongside = s["tiers"][0]["alongside_adam"]
        assert alongside["write_bytes_per_s"] > 0 and alongside["read_bytes_per_s"] > 0
        assert alongside["write_vs_idle"] > 0 and alongside["read_vs_idle"] > 0
    # The prediction (the I/O beside the kernel while it runs, where measured) lies between its two
    # ends, every byte at the idle bandwidth plan uses and every byte beside the kernel; all three
    # are the same where nothing was measured beside the kernel.
    ref = s["references"]
    assert ref["predicted_idle_s"] > 0
    assert s["sweep"][0]["predicted_idle_s"] == ref["predicted_idle_s"]
    assert s["sweep"][0]["predicted_s"] == ref["predicted_s"]
    ends = sorted((ref["predicted_idle_s"], ref["predicted_beside_s"]))
    assert ends[0] - 1e-9 <= ref["predicted_s"] <= ends[1] + 1e-9
    if skip_interference:
        assert ref["predicted_s"] == ref["predicted_idle_s"] == ref["predicted_beside_s"]
    # What must hold whatever the timing: MLP-Offload moves fewer bytes than the baseline (no
    # gradients, the pool carries 7 of 12 subgroups over) on the tiers its placement chose.
    mlp_moved = sum(t["mlp_bytes_read_per_step"] + t["mlp_bytes_written_per_step"] for t in s["tiers"])
    assert mlp_moved < s["baseline"]["bytes_read_per_step"] + s["baseline"]["bytes_written_per_step"]
    region = REGION
    reads = sum(t["mlp_bytes_read_per_step"] for t in s["tiers"])
    writes = sum(t["mlp_bytes_written_per_step"] for t in s["tiers"])
    assert reads == writes == 5 * region * ranks, "each step reads and writes back what the pool cannot hold"
    for j, t in enumerate(s["tiers"]):
        if t["mlp_bytes_written_per_step"]:
            assert j in s["mlp"]["tier_of"], "bytes moved on a tier the placement left empty"
    assert sum(t["mlp_cache_hits"] for t in s["tiers"]) > 0
    assert sum(t["mlp_warm_hits"] for t in s["tiers"]) > 0
    assert s["mlp"]["warm_bytes"] > 0 and s["baseline"]["host_bytes"] > 0
    assert s["mlp"]["host_bytes"] <= s["mlp"]["host_limit_bytes"] <= budget
    assert s["config"]["ranks"] == ranks
    # As many more MLP-Offload steps, each paired with the engine alone moving the same bytes; then
    # as many rounds of a baseline step and an MLP-Offload step.
    assert len(s["paired"]["replay_steps_s"]) == len(s["paired"]["mlp_steps_s"]) == 3 and s["paired"]["replay_s"] > 0
    assert len(s["paired"]["baseline_steps_s"]) == len(s["paired"]["mlp_beside_baseline_steps_s"]) == 3
    assert s["paired"]["baseline_s"] == s["paired"]["baseline_steps_s"][2], "the median after the two warm-up rounds"
    assert s["paired"]["mlp_beside_baseline_s"] == s["paired"]["mlp_beside_baseline_steps_s"][2]
    assert s["speedup"]["paired"] == pytest.approx(s["paired"]["baseline_s"] / s["paired"]["mlp_beside_baseline_s"])
    assert s["paired"]["mlp_vs_replay"] == pytest.approx(s["paired"]["mlp_s"] / s["paired"]["replay_s"])
    assert s["paired"]["replay_vs_io_reference"] == pytest.approx(s["paired"]["replay_s"] / s["references"]["io_s"])
    # After the two warm-up pairs, as every median: one pair here, so no standard error.
    assert s["paired"]["pipeline_overhead_s"] == pytest.approx(s["paired"]["mlp_steps_s"][2] - s["paired"]["replay_steps_s"][2])
    assert s["paired"]["pipeline_overhead_stderr_s"] is None
    # The step's CPU reference: its kernels alone, and the larger of that and the I/O reference.
    assert s["references"]["kernel_s"] > 0
    assert s["references"]["step_s"] == max(s["references"]["io_s"], s["references"]["kernel_s"])
    assert s["references"]["mlp_vs_step"] == pytest.approx(s["mlp"]["seconds"] / s["references"]["step_s"])
    leftovers = [n for d in (disk_dir, shm_dir) for n in os.listdir(d)]
    assert leftovers == [], f"bench left files behind: {leftovers}"


def test_every_engine_of_a_bench_update_run_uses_the_io_geometry_of_its_flags(capsys, monkeypatch, disk_dir):
    # The bound is only a bound for the step if the bandwidth pass drives the tier as the step
    # does, and the baseline only comparable if it gets the same engine.
    from megatron_mlp.engine.engine import Engine

    built = []
    original = Engine.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append((self.block_bytes, self.queue_depth))

    monkeypatch.setattr(Engine, "__init__", recording_init)
    s = run_json(capsys, "--paths", disk_dir, "--num-params", "300000", "--subgroup-params", "50000",
                 "--calib-bytes", "4MB", "--steps", "2", "--no-ablation", "--no-interference",
                 "--io-block-size", "64KiB", "--io-queue-depth", "4")
    assert s["config"]["io_block_bytes"] == 64 << 10 and s["config"]["io_queue_depth"] == 4
    assert len(built) >= 4, "bandwidth pass (2), baseline (1) and MLP-Offload (1 or more)"
    assert set(built) == {(64 << 10, 4)}


def test_adam_threads_of_a_bench_update_run_reach_both_sides(capsys, disk_dir, kernel_threads_used):
    # A kernel thread count that helps or hurts must do so to the baseline as well.
    threads = kernel_threads_used
    s = run_json(capsys, "--paths", disk_dir, "--num-params", "300000", "--subgroup-params", "50000",
                 "--calib-bytes", "4MB", "--steps", "2", "--no-ablation", "--no-interference", "--adam-threads", "1")
    assert s["config"]["adam_threads"] == 1
    subgroups = 300000 // 50000
    assert len(threads) == 5 * 2 * subgroups + 2 * 3 * subgroups, \
        "two steps of the baseline, two of MLP-Offload, two more paired with the replay, two rounds of " \
        "both paired, and three passes of the kernels alone beside I/O (the step's CPU floor) and three without"
    assert set(threads) == {1}


@pytest.mark.parametrize("flag, value", [("--io-block-size", "5000"), ("--io-block-size", "2GiB"),
                                         ("--io-queue-depth", "0"), ("--adam-threads", "-1")])
def test_bench_update_rejects_a_bad_io_geometry_or_thread_count_naming_the_flag(disk_dir, flag, value):
    with pytest.raises(ConfigError, match=flag):
        update.main(["--paths", disk_dir, "--num-params", "1000", flag, value])


def test_bench_update_refuses_a_bandwidth_pass_that_does_not_fit_naming_the_flag(disk_dir):
    with pytest.raises(ConfigError, match="--calib-bytes"):
        update.main(["--paths", disk_dir, "--num-params", "1000", "--calib-bytes", "1000TB"])


def test_an_emulated_tier_is_measured_for_one_second_of_its_cap_and_a_real_one_for_the_whole_pass():
    from megatron_mlp.tier.spec import parse_tier_paths

    real, emulated = parse_tier_paths("/r;/e:qos=1GB/s", flag="--paths")
    assert update_tiers.calib_bytes(real, 4 * 10**9) == 4 * 10**9
    assert update_tiers.calib_bytes(emulated, 4 * 10**9) == 10**9
    assert update_tiers.calib_bytes(emulated, 8 << 20) == 8 << 20


def test_bench_update_rejects_a_missing_path_naming_the_flag(disk_dir):
    with pytest.raises(ConfigError, match="--paths"):
        update.main(["--paths", os.path.join(disk_dir, "nope"), "--num-params", "1000"])


def test_the_io_reference_adds_reads_and_writes_on_a_shared_limit_and_overlaps_them_otherwise():
    disk = {"read_bytes_per_s": 1.0, "write_bytes_per_s": 2.0, "concurrent_bytes_per_s": 1.0}
    duplex = {"read_bytes_per_s": 1.0, "write_bytes_per_s": 1.0, "concurrent_bytes_per_s": 2.0}
    assert tier_io_seconds(4, 4, disk) == pytest.approx(4 / 1 + 4 / 2)
    assert tier_io_seconds(4, 4, duplex) == pytest.approx(4)


def test_the_fluid_reference_splits_the_uncached_bytes_so_every_tier_finishes_together():
    disk = {"read_bytes_per_s": 1.0, "write_bytes_per_s": 2.0, "concurrent_bytes_per_s": 1.0}   # 1.5 s per byte
    duplex = {"read_bytes_per_s": 1.0, "write_bytes_per_s": 1.0, "concurrent_bytes_per_s": 2.0}  # 1 s per byte
    # 10 bytes of state, 4 cached: 6 bytes each way at 1/1.5 + 1/1 bytes/s together.
    assert fluid_update_seconds(10, 4, [disk, duplex]) == pytest.approx(6 / (1 / 1.5 + 1))
    assert fluid_update_seconds(10, 4, [disk]) == pytest.approx(6 * 1.5)
    assert fluid_update_seconds(10, 12, [disk]) == 0.0   # all of it in host memory


def test_zero3_baseline_computes_the_same_adamw_as_torch(disk_dir):
    """The baseline must be a fair opponent: the same update, only the data path differs."""
    import torch

    from megatron_mlp.engine import Engine
    from megatron_mlp.bench.zero_style import ZeroStyleOffload
    from megatron_mlp.optim.reference_adam import ReferenceAdamW

    n = 5000
    init = torch.randn(n)
    eng = Engine()
    base = ZeroStyleOffload(disk_dir, n, 1500, eng, lr=1e-2, weight_decay=0.1, initial_params=init)
    ref = ReferenceAdamW([(0, n)], [{"lr": 1e-2, "weight_decay": 0.1}], init)
    out = torch.empty(n, dtype=torch.bfloat16)
    try:
        for step in range(5):
            g = torch.randn(n, generator=torch.Generator().manual_seed(step)).bfloat16()
            base.backward_write_grads(g)
            base.step(out)
            ref.step(g)
        assert torch.equal(base.read_param(0, n), ref.state("param"))
        assert base.last["bytes_read"] > base.last["bytes_written"], "the baseline reads gradients back"
    finally:
        base.close()
        eng.close()
    assert os.listdir(disk_dir) == []


def test_an_open_baselines_scratch_dir_is_live_to_the_stale_scratch_sweep(disk_dir):
    """The bench keeps the baseline open while MLP-Offload starts on the same path and sweeps it
    for stale scratch: the baseline's dir must read as live (left alone, nothing reported), and a
    closed baseline leaves nothing behind."""
    from megatron_mlp.engine import Engine
    from megatron_mlp.bench.zero_style import ZeroStyleOffload
    from megatron_mlp.tier.scratch import clean_stale_scratch

    eng = Engine()
    base = ZeroStyleOffload(disk_dir, 5000, 1500, eng)
    try:
        scan = clean_stale_scratch(disk_dir)
        assert scan.removed == [] and scan.reported == []
        assert os.path.isdir(base.dir) and os.path.basename(base.dir).startswith("mlp-offload-zero3-")
    finally:
        base.close()
        eng.close()
    assert os.listdir(disk_dir) == []


def test_kernel_reference_runs_every_subgroups_kernel_with_a_steady_steps_checksums_beside_io(monkeypatch):
    """The reference times the kernels a steady step runs: one per subgroup, on the threads a kernel
    gets while I/O is in flight, checksumming as many written-back and read subgroups as the step
    did (medians over the steady steps), without the warm-up steps' counts."""
    import torch

    import megatron_mlp.optim.fused_adam as fused_adam

    calls = []
    monkeypatch.setattr(fused_adam, "fused_adam_step",
                        lambda p, *a, num_threads, checksums, input_checksums, **k:
                        calls.append((p.numel(), num_threads, checksums, input_checksums)))
    monkeypatch.setattr(fused_adam, "threads_beside_io", lambda busy, requested: 7 if busy else 99)

    def stats(flushes, fetches):
        return {"tiers": [{"flushes": flushes, "fetches": fetches - 1}, {"flushes": 0, "fetches": 1}]}

    steps = [stats(9, 9), stats(9, 9), stats(2, 3), stats(2, 3), stats(2, 3)]
    args = argparse.Namespace(subgroup_params=1000, adam_threads=0)
    numel = 5500                     # six subgroups, the last one of 500
    out = update_rank.kernel_reference(args, numel, torch.zeros(numel, dtype=torch.bfloat16),
                                   torch.zeros(numel, dtype=torch.bfloat16), steps, passes=2)
    assert out["seconds"] >= 0 and out["threads"] == 7
    assert (out["written"], out["fetched"]) == (2, 3)
    one_pass = [(1000, 7, True, False), (1000, 7, True, False), (1000, 7, False, False),
                (1000, 7, False, True), (1000, 7, False, True), (500, 7, False, True)]
    # Then on every core with no checksum: a step whose whole state stays in host memory moves nothing.
    without_io = [(1000, 99, False, False)] * 5 + [(500, 99, False, False)]
    assert calls == one_pass * 2 + without_io * 2
    assert out["without_io_threads"] == 99 and out["without_io_seconds"] >= 0


def test_medians_leave_out_the_two_warm_up_steps_when_there_are_more():
    # The first step fills the host pool; the second writes one end's second slots for the first
    # time (fresh extents). Neither recurs, so neither counts, on any side.
    assert update_rank.WARMUP_STEPS == 2
    assert update_result.steady([9.0, 5.0, 1.0, 2.0, 3.0]) == (2.0, 1.0, 3.0)
    assert update_result.steady([9.0, 5.0, 1.0]) == (1.0, 1.0, 1.0)
    assert update_result.steady([9.0, 5.0]) == (5.0, 5.0, 5.0)   # too few: only the first is left out
    assert update_result.steady([9.0]) == (9.0, 9.0, 9.0)


def test_a_replay_moves_the_bytes_asked_on_each_tier_and_reads_back_the_last_steps_writes(disk_dir, shm_dir,
                                                                                        monkeypatch):
    """The device-alone yardstick: per step, on each tier, the write-backs then the reads of the
    given byte counts, in requests of at most one region; writes alternate between two areas and
    the reads take what the step before wrote first (as the optimizer reads what it wrote back);
    a tier with separate read and write budgets (qos=) runs the two directions at once. Its files
    are removed."""
    import megatron_mlp.engine as engine_module
    from megatron_mlp.bench.replay import IOReplay
    from megatron_mlp.tier.spec import parse_tier_paths

    log = []
    real = engine_module.Engine

    class Logged(real):
        def read(self, f, buffer, file_offset=0, nbytes=None, buffer_offset=0):
            log.append(("read", f.path, file_offset, nbytes))
            return super().read(f, buffer, file_offset, nbytes, buffer_offset)

        def write(self, f, buffer, file_offset=0, nbytes=None, buffer_offset=0):
            log.append(("write", f.path, file_offset, nbytes))
            return super().write(f, buffer, file_offset, nbytes, buffer_offset)

    monkeypatch.setattr(engine_module, "Engine", Logged)
    region = 3 * 4096 * 4
    tiers = parse_tier_paths(f"{disk_dir};{shm_dir}:qos=1GB/s")
    with IOReplay(tiers, [(2 * region, 3 * region), (region, 0)], region, backend="auto", block_bytes=4096,
                  queue_depth=4) as replay:
        for step in range(3):
            log.clear()
            assert replay.step() > 0
            disk = [(op, off, n) for op, path, off, n in log if path.startswith(disk_dir)]
            shm = [(op, off, n) for op, path, off, n in log if path.startswith(shm_dir)]
            here, before = (step % 2) * 2 * region, ((step + 1) % 2) * 2 * region
            assert disk == [("write", here, region), ("write", here + region, region),
                            ("read", before, region), ("read", before + region, region),
                            ("read", 4 * region, region)], "one lane: write-backs, then reads"
            assert shm == [("write", (step % 2) * region, region)]
    assert [n for d in (disk_dir, shm_dir) for n in os.listdir(d)] == []


def test_replay_moves_a_step_of_less_than_one_region(disk_dir):
    """A step whose bytes are not whole regions (a median over steps that moved different amounts,
    for instance): every request, the first whole-file write included, fits the replay's buffer."""
    from megatron_mlp.bench.replay import IOReplay
    from megatron_mlp.tier.spec import parse_tier_paths

    region = 4 * 4096
    with IOReplay(parse_tier_paths(disk_dir), [(region // 2, region // 4)], region, backend="auto",
                  block_bytes=4096, queue_depth=4) as replay:
        assert replay._ops("both", region // 2, region // 4, 1) == [("write", region // 2, region // 2),
                                                                  ("read", 0, region // 4)]
        for _ in range(3):
            assert replay.step() > 0
    assert os.listdir(disk_dir) == []



def test_bench_update_sweeps_host_memory_and_reports_speedup_per_budget_when_given_a_list(capsys, disk_dir):
    # The first budget is the headline; the others rerun MLP-Offload alone, each within its budget.
    small, large = 3 * REGION + 10, 9 * REGION + 10
    s = run_json(capsys, "--paths", disk_dir, "--num-params", "600000", "--subgroup-params", "50000",
                 "--calib-bytes", "4MB", "--steps", "2", "--no-ablation", "--no-interference",
                 "--host-memory", f"{small},{large}")
    assert [row["host_memory_bytes"] for row in s["sweep"]] == [small, large]
    assert s["sweep"][0]["speedup"] == s["speedup"]["update"]
    for row in s["sweep"]:
        assert 0 < row["mlp_host_bytes"] <= row["host_memory_bytes"] and row["speedup"] > 0
    assert (s["sweep"][0]["host_memory"]["prefetch_depth"], s["sweep"][0]["host_memory"]["flush_depth"]) == (1, 1)
    assert s["sweep"][1]["host_memory"]["cache_buffers"] == 4


def test_bench_update_defaults_to_the_baselines_own_memory_for_both_sides(capsys, disk_dir):
    s = run_json(capsys, "--paths", disk_dir, "--num-params", "300000", "--subgroup-params", "50000",
                 "--calib-bytes", "4MB", "--steps", "2", "--no-ablation", "--no-interference")
    assert s["config"]["host_memory_bytes"] == s["baseline"]["host_bytes"]
    assert s["mlp"]["host_bytes"] <= s["baseline"]["host_bytes"]


@pytest.mark.parametrize("budget, message", [("1000", "less than the ZeRO-3-style baseline"),
                                             ("lots", "--host-memory")])
def test_bench_update_refuses_a_budget_that_cannot_hold_both_sides_naming_the_flag(disk_dir, budget, message):
    with pytest.raises(ConfigError, match=message):
        update.main(["--paths", disk_dir, "--num-params", "300000", "--subgroup-params", "50000",
                     "--host-memory", budget])


def test_bench_update_refuses_plot_naming_matplotlib_when_it_is_absent(disk_dir, monkeypatch):
    import sys

    # Absent as both the import and the check before measuring (which finds it without importing it) see it.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match="--plot: .*matplotlib"):
        update.main(["--paths", disk_dir, "--num-params", "300000", "--plot", os.path.join(disk_dir, "x.png")])


def test_plot_draws_the_speedup_per_budget_as_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is an optional dependency (the [plot] extra)")
    result = argparse.Namespace(config={"num_params": 10**8, "subgroup_params": 10**7},
                                sweep=[{"host_memory_bytes": 2e9, "speedup": 3.0},
                                       {"host_memory_bytes": 1e9, "speedup": 2.0}])
    update_report.plot_sweep(result, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figures_below_their_reference_are_flagged_and_others_are_not():
    references = {"mlp_vs_io": 0.9, "mlp_vs_step": 1.1, "policy_s": 2.0}
    paired = {"replay_vs_io_reference": None}
    flags = update_result.faster_than_reference(1.5, references, paired)
    assert len(flags) == 2 and "I/O reference: x0.90" in flags[0] and "policy reference: x0.75" in flags[1]
    assert update_result.faster_than_reference(2.0, {**references, "mlp_vs_io": 1.0}, paired) == []


def test_vs_deepspeed_says_why_it_did_not_measure_when_deepspeed_is_absent(capsys, disk_dir, monkeypatch):
    from megatron_mlp.bench import deepspeed_update
    monkeypatch.setattr(deepspeed_update, "deepspeed_unavailable_reason", lambda: "deepspeed is not importable (test)")
    s = run_json(capsys, "--paths", disk_dir, "--num-params", "300000", "--subgroup-params", "50000",
                 "--calib-bytes", "4MB", "--steps", "2", "--no-ablation", "--no-interference", "--vs-deepspeed")
    assert s["deepspeed"] == {"unavailable": "deepspeed is not importable (test)"}


def test_vs_deepspeed_runs_deepspeeds_own_update_on_the_same_subgroups(capfd, disk_dir):
    # capfd, not capsys: DeepSpeed's op check needs a real stderr file descriptor.
    capsys = capfd
    from megatron_mlp.bench import deepspeed_update
    reason = deepspeed_update.deepspeed_unavailable_reason()
    if reason is not None:
        pytest.skip(f"--vs-deepspeed needs deepspeed: {reason}")
    s = run_json(capsys, "--paths", disk_dir, "--num-params", "300000", "--subgroup-params", "50000",
                 "--calib-bytes", "4MB", "--steps", "3", "--no-ablation", "--no-interference", "--vs-deepspeed")
    ds = s["deepspeed"]
    assert "unavailable" not in ds, ds
    assert ds["seconds"] > 0 and len(ds["steps_s"]) == 3 and ds["host_bytes"] > 0
    assert ds["baseline_vs_deepspeed"] == pytest.approx(s["baseline"]["seconds"] / ds["seconds"])
    assert ds["speedup_vs_deepspeed"] == pytest.approx(ds["seconds"] / s["mlp"]["seconds"])
    assert ds["paired_speedup_vs_deepspeed"] == pytest.approx(ds["paired_s"] / ds["mlp_beside_deepspeed_s"])


def test_vs_deepspeed_alternates_deepspeeds_steps_with_mlp_offloads_for_a_ratio_free_of_drift(capsys, disk_dir,
                                                                                                  monkeypatch):
    # DeepSpeed's update stands for itself (its own phase) and, like the baseline, alternates step
    # by step with MLP-Offload's; it gives its host memory back before the sweep's budgets run.
    from megatron_mlp.bench import deepspeed_update
    from megatron_mlp.optim import offload_adam
    events = []

    class FakeDeepSpeed:
        host_bytes = 1234

        def __init__(self, path, numel, subgroup_params, *, block_bytes, queue_depth):
            assert path == disk_dir and numel == 300_000 and subgroup_params == 50_000
            events.append("start")

        def backward_write_grads(self, grads):
            events.append("ds backward")
            return 0.5

        def step(self):
            events.append("ds step")
            return 7.0

        def close(self):
            events.append("ds close")

    real_step = offload_adam.OffloadAdam.step

    def step(self, *a, **k):
        events.append("mlp step")
        return real_step(self, *a, **k)

    monkeypatch.setattr(deepspeed_update, "deepspeed_unavailable_reason", lambda: None)
    monkeypatch.setattr(deepspeed_update, "DeepSpeedZero3Update", FakeDeepSpeed)
    monkeypatch.setattr(offload_adam.OffloadAdam, "step", step)
    s = run_json(capsys, "--paths", disk_dir, "--num-params", "300000", "--subgroup-params", "50000",
                 "--calib-bytes", "4MB", "--steps", "3", "--no-ablation", "--no-interference", "--vs-deepspeed",
                 "--host-memory", "2MB,4MB")
    ds = s["deepspeed"]
    assert ds["seconds"] == ds["paired_s"] == 7.0 and ds["host_bytes"] == 1234
    assert ds["paired_speedup_vs_deepspeed"] == pytest.approx(7.0 / ds["mlp_beside_deepspeed_s"])
    assert len(ds["mlp_beside_deepspeed_steps_s"]) == 3
    # Its own phase (3 steps, each after its backward), then three rounds of its step and one of
    # MLP-Offload's right after it, then it closes before the sweep's budget runs.
    first_paired = events.index("ds step", events.index("mlp step"))
    assert events[:7] == ["start"] + ["ds backward", "ds step"] * 3
    assert events[first_paired - 1:first_paired + 8] == ["ds backward", "ds step", "mlp step"] * 3
    close = events.index("ds close")
    assert close == first_paired + 8 and events.count("ds close") == 1
    assert events[close + 1:].count("mlp step") == 3, "the sweep's budget runs after DeepSpeed closed"


def test_deepspeeds_own_update_computes_adamw_over_every_subgroup(disk_dir):
    """The DeepSpeed side is a measurement of DeepSpeed only if it does the update: its state after
    three steps matches AdamW (its own kernel, so to float tolerance, not bits)."""
    import torch

    from megatron_mlp.bench import deepspeed_update
    from megatron_mlp.optim.reference_adam import ReferenceAdamW
    reason = deepspeed_update.deepspeed_unavailable_reason()
    if reason is not None:
        pytest.skip(f"needs deepspeed: {reason}")
    n = 10_000
    ds = deepspeed_update.DeepSpeedZero3Update(disk_dir, n, 3000, block_bytes=1 << 20, queue_depth=4, lr=1e-2)
    ref = ReferenceAdamW([(0, n)], [{"lr": 1e-2}], torch.zeros(n))
    try:
        for step in range(3):
            g = torch.randn(n, generator=torch.Generator().manual_seed(step)).bfloat16()
            ds.backward_write_grads(g)
            ds.step()
            ref.step(g)
        got = torch.cat([_read_ds_state(ds, i)[:b - a] for i, (a, b) in enumerate(ds.bounds)])
        assert torch.allclose(got, ref.state("param"), rtol=1e-4, atol=1e-6)
    finally:
        ds.close()
    assert os.listdir(disk_dir) == []


def _read_ds_state(ds, i):
    buf = ds.state_bufs[0][:3 * ds.padded[i]]
    ds._sync(False, buf, ds._file(i, "state"))
    return buf.clone()


def test_the_text_report_says_n_a_for_ratios_without_a_reference_when_the_state_fits_in_host_memory(disk_dir):
    # One subgroup of 1M params under the default 25M: the state never leaves host memory, so the
    # I/O reference is zero and the ratios over it have no value.
    result, _ = update.run(["--paths", disk_dir, "--num-params", "1000000", "--calib-bytes", "8MB", "--steps", "3",
                            "--no-ablation", "--no-interference"])
    assert result.references["mlp_vs_io"] is None
    text = update_report.format_text(result)
    assert "I/O 0.00 s (MLP-Offload n/a)" in text and "None" not in text


def test_bench_update_reports_the_update_at_each_state_dtype_when_given_fp32_bf16_and_fp16(capsys, disk_dir):
    # 49152 = 24 pages of 2048 params: no padding at any dtype, so the bytes are exactly 12 and 8 per param.
    s = run_json(capsys, "--paths", disk_dir, "--num-params", str(6 * 49152), "--subgroup-params", "49152",
                 "--calib-bytes", "4MB", "--steps", "3", "--no-ablation", "--no-interference",
                 "--state-dtype", "fp32,bf16,fp16")
    rows = s["state_dtypes"]
    assert [r["state_dtype"] for r in rows] == ["fp32", "bf16", "fp16"]
    assert [r["bytes_per_param"] for r in rows] == [12.0, 8.0, 8.0]
    assert rows[0]["mlp_s"] == s["mlp"]["seconds"] and rows[0]["speedup"] == s["speedup"]["update"]
    assert all(r["mlp_s"] > 0 and r["speedup"] > 0 for r in rows)
    assert 0 < rows[1]["bytes_moved_per_step"] * 12 <= rows[0]["bytes_moved_per_step"] * 8 * 1.01
    # fp16 moments move bf16's bytes plus the absmax pass's reads of what the host does not keep.
    assert rows[1]["bytes_moved_per_step"] < rows[2]["bytes_moved_per_step"] <= rows[1]["bytes_moved_per_step"] * 2
    assert update.main(["--paths", disk_dir, "--num-params", str(6 * 49152), "--subgroup-params", "49152",
                        "--calib-bytes", "4MB", "--steps", "2", "--no-ablation", "--no-interference",
                        "--state-dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "per Adam moment dtype" in text and "bf16" in text and "8.00 B/param" in text


@pytest.mark.parametrize("value, message", [("fp8", "--state-dtype: 'fp8'"), (",", "--state-dtype")])
def test_bench_update_refuses_a_state_dtype_it_cannot_run_naming_the_flag(disk_dir, value, message):
    with pytest.raises(ConfigError, match=message):
        update.main(["--paths", disk_dir, "--num-params", "300000", "--subgroup-params", "50000",
                     "--state-dtype", value])
