"""``bench update``'s result: the ranks' timed steps aggregated into one frozen ``UpdateResult``.

Per step the slowest rank counts (the ranks of a node wait for each other); every median leaves
out the warm-up steps (``update_rank.WARMUP_STEPS``), on every side. ``to_json()`` writes it in
sections: what ran (``machine``, ``config``), each tier's bandwidth and bytes (``tiers``), each
side (``baseline``, ``mlp``, ``deepspeed``), the ratios (``speedup``), the step-by-step pairs
(``paired``), the yardsticks (``references``), the placement model's plan (``placement``), the
host-memory ``sweep``, the ``ablation`` and MLP-Offload's update per Adam moment dtype (``state_dtypes``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass

from megatron_mlp.bench.update_rank import (CHECKSUM_OFF, MLP_NAME, WHOLE_BUFFERS, run_config, state_dtype_name,
                                            steady_slice, sweep_name)
from megatron_mlp.bench.update_tiers import faster_of
from megatron_mlp.optim.placement.reference import fluid_update_seconds, tier_io_seconds


@dataclass(frozen=True)
class UpdateResult:
    """One ``bench update`` run. Seconds are per step (medians after the warm-up, slowest rank),
    bytes per step over all ranks unless a key says per rank.

    Sections (each a dict or a list of dicts, as written by ``to_json``):
        machine, config: what ran, with both sides' resources (host memory per rank, I/O geometry,
            Adam threads).
        tiers: per tier its bandwidth passes (before, ``after``), its read/write limit, MLP-Offload's
            bytes on it and its I/O reference; ``alongside_adam`` where measured.
        baseline: the ZeRO-3-style policy: ``seconds`` (min, max, per step), its backward gradient
            write, bytes per step, host bytes.
        mlp: MLP-Offload at the headline budget: ``seconds``, host limit and bytes, its pool, bytes
            the working buffers carry, the checksums' cost, its last step's statistics.
        speedup: ``update`` (baseline over MLP-Offload), ``paired`` (the same from alternating
            steps), ``with_backward_write``, ``reference`` (the baseline over the policy reference).
        paired: the step-by-step rounds: the baseline and MLP-Offload alternating; MLP-Offload and
            the engine alone replaying its bytes (``replay_s``), and what the pipeline costs.
        references: yardsticks, not bounds: ``io_s``, ``kernel_s``, ``step_s``, ``policy_s``, the
            placement model's ``predicted_s`` (with ``predicted_idle_s`` and ``predicted_beside_s``:
            every byte at the tiers' idle bandwidth, every byte beside the kernel), and the steps
            over each.
        faster_than_reference: every figure that came in below its reference.
    """

    machine: dict
    config: dict
    tiers: list
    baseline: dict
    mlp: dict
    speedup: dict
    paired: dict
    references: dict
    placement: dict
    sweep: list
    ablation: list
    deepspeed: dict | None
    faster_than_reference: list
    emulated_paths: list
    trace_files: list | None = None
    state_dtypes: list | None = None
    """MLP-Offload at the headline budget per ``--state-dtype``: fp32 moments (the headline, 12 bytes
    per param) first, then each further dtype (bf16: 8): seconds, speed-up over the baseline, bytes
    per param stored, bytes moved per step over all ranks."""

    def to_dict(self) -> dict:
        return {"benchmark": "update", **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def steady(values):
    """Median over the steps after the warm-up, with the spread: (median, min, max)."""
    vals = values[steady_slice(len(values))]
    return statistics.median(vals), min(vals), max(vals)


def per_step_max(results, pick):
    """Per step, the slowest rank (the ranks of a node wait for each other)."""
    per_rank = [pick(r) for r in results]
    return [max(v[i] for v in per_rank) for i in range(len(per_rank[0]))]


def _ratio(a, b):
    return a / b if a is not None and b else None


def _variants(results, baseline_s: float):
    """The ablation rows (baseline first, MLP-Offload last), the row without checksums, the sweep's
    rows by name, and the index of MLP-Offload's variant."""
    ablation = []
    extra, sweep_rows, mlp_index = {}, {}, None
    for i, variant in enumerate(results[0]["variants"]):
        med, lo, hi = steady(per_step_max(results, lambda r: r["variants"][i]["steps_s"]))
        row = {"name": variant["name"], "seconds": med, "min_s": lo, "max_s": hi,
               "speedup": baseline_s / med if med > 0 else None}
        if variant["name"] == CHECKSUM_OFF:
            extra = row
        elif variant["name"] == WHOLE_BUFFERS:
            sweep_rows[WHOLE_BUFFERS] = (i, row)
        elif variant["name"].startswith("MLP-Offload at ") or variant["name"].endswith(" moments"):
            sweep_rows[variant["name"]] = (i, row)
        else:
            ablation.append(row)
            if variant["name"] == MLP_NAME:
                mlp_index = i
    return ablation, extra, sweep_rows, mlp_index


def _tier_rows(bandwidth, reference_bw, bandwidth_after, mlp_stats, steps: int) -> list[dict]:
    """Per tier: its passes, the bytes MLP-Offload moved on it per step (all ranks, steady steps)
    and the I/O reference of those bytes at the faster pass's bandwidth."""
    rows = []
    for bw, ref, after in zip(bandwidth, reference_bw, bandwidth_after):
        rd = wr = 0.0
        hits = warm = 0
        for per_rank in mlp_stats:
            chosen = per_rank[steady_slice(steps)]
            for st in chosen:
                for t in st["tiers"]:
                    if t["path"] == bw["path"]:
                        rd += t["bytes_read"] / len(chosen)
                        wr += t["bytes_written"] / len(chosen)
                        hits += t["cache_hits"]
                        warm += t["warm_hits"]
        rows.append({**bw, "label": "emulated" if bw["emulated"] else "real", "after": after,
                     "mlp_bytes_read_per_step": rd, "mlp_bytes_written_per_step": wr,
                     "mlp_cache_hits": hits, "mlp_warm_hits": warm, "io_reference_s": tier_io_seconds(rd, wr, ref)})
    return rows


def _kernel_times(results, i: int) -> tuple[float, float]:
    """Variant ``i``'s kernels alone, beside I/O and without, over all ranks (its own reference)."""
    refs = [r["variants"][i]["kernel_reference"] for r in results]
    return max(k["seconds"] for k in refs), max(k["without_io_seconds"] for k in refs)


def _placement(args, tiers, budget=None, kernel_s: float = 0.0, kernel_without_io_s=None, bandwidth=None):
    """The placement model's plan for this shard, the bytes host memory carries between steps over
    all ranks (the cache and the working buffers' subgroups), and the predicted update time
    (``placement.model.update_seconds``, with the measured kernel time) at ``budget`` (default:
    the headline one), for the same layout three ways: the model's prediction (``predicted_s``:
    the I/O at each real tier's bandwidth beside the Adam kernel -- ``alongside_adam`` in
    ``bandwidth``, where measured -- while the kernels run, at the idle bandwidth otherwise), and
    its two ends: every byte at the idle bandwidths the run placed its subgroups with (what ``plan``
    and the optimizer's log say for these tiers; ``predicted_idle_s``), every byte beside the
    kernel (``predicted_beside_s``)."""
    from megatron_mlp.optim.placement import host_memory_for, plan_for, warm_subgroups
    from megatron_mlp.optim.placement.model import at_rates, update_seconds
    from megatron_mlp.optim.subgroups import SubgroupPlan

    plan = SubgroupPlan([(0, args.num_params // args.ranks)], args.subgroup_params)
    config = run_config(args, tiers, **({} if budget is None else {"host_memory_bytes": budget}))
    memory = host_memory_for(plan, config)
    placement = plan_for(plan, config, args.ranks, memory=memory)
    warm_bytes = warm_subgroups(config, memory) * plan.max_region_bytes * args.ranks
    idle_s = update_seconds(placement, memory, kernel_s, kernel_without_io_s)
    beside_tiers = [dataclasses.replace(t, read_bytes_per_s=t.read_bytes_per_s * bw["alongside_adam"]["read_vs_idle"],
                                        write_bytes_per_s=t.write_bytes_per_s * bw["alongside_adam"]["write_vs_idle"])
                    if bw.get("alongside_adam") else t
                    for t, bw in zip(placement.tiers, bandwidth or [{}] * len(tiers))]
    beside = at_rates(placement, beside_tiers)
    beside_s = update_seconds(beside, memory, kernel_s, kernel_without_io_s)
    predicted_s = update_seconds(placement, memory, kernel_s, kernel_without_io_s, beside=beside)
    held = memory.cache_bytes * args.ranks + warm_bytes
    return placement, warm_bytes, held, {"predicted_s": predicted_s, "predicted_idle_s": idle_s,
                                         "predicted_beside_s": beside_s}


def _paired(results, io_reference_s: float) -> dict:
    """The step-by-step rounds (``update_rank._paired_steps``) over all ranks."""
    mlp_steps = per_step_max(results, lambda r: r["paired"]["mlp_steps_s"])
    replay_steps = per_step_max(results, lambda r: r["paired"]["replay_steps_s"])
    moved = any(any(m) for r in results for m in r["paired"]["moves"])
    kept = steady_slice(len(replay_steps))
    diffs = [a - b for a, b in zip(mlp_steps[kept], replay_steps[kept])]
    replay_s = steady(replay_steps)[0] if moved else None
    mlp_s = steady(mlp_steps)[0]
    base_steps = per_step_max(results, lambda r: r["paired"]["baseline_steps_s"])
    beside_steps = per_step_max(results, lambda r: r["paired"]["mlp_beside_baseline_steps_s"])
    base_s, beside_s = steady(base_steps)[0], steady(beside_steps)[0]
    return {"baseline_s": base_s, "baseline_steps_s": base_steps,
            "mlp_beside_baseline_s": beside_s, "mlp_beside_baseline_steps_s": beside_steps,
            "mlp_s": mlp_s, "mlp_steps_s": mlp_steps, "replay_s": replay_s, "replay_steps_s": replay_steps,
            "mlp_vs_replay": mlp_s / replay_s if replay_s else None,
            "replay_vs_io_reference": replay_s / io_reference_s if replay_s and io_reference_s > 0 else None,
            "pipeline_overhead_s": statistics.mean(diffs) if replay_s else None,
            "pipeline_overhead_stderr_s": (statistics.stdev(diffs) / len(diffs) ** 0.5
                                           if replay_s and len(diffs) > 1 else None)}


def summarize(args, tiers, bandwidth, results, bandwidth_after=None) -> UpdateResult:
    """The ranks' results (``update_rank.run_rank``) and the tiers' passes as one ``UpdateResult``."""
    bandwidth_after = bandwidth_after or [None] * len(bandwidth)
    reference_bw = [faster_of(b, a) for b, a in zip(bandwidth, bandwidth_after)]
    base_steps = per_step_max(results, lambda r: r["baseline"]["steps_s"])
    back_steps = per_step_max(results, lambda r: r["baseline"]["backward_s"])
    baseline_s, base_min, base_max = steady(base_steps)
    backward_s = steady(back_steps)[0]
    rows, extra, sweep_rows, mlp_index = _variants(results, baseline_s)
    ablation = [{"name": "ZeRO-3 policy (baseline)", "seconds": baseline_s, "min_s": base_min,
                 "max_s": base_max, "speedup": 1.0}, *rows]
    mlp = ablation[-1]
    mlp_s = mlp["seconds"]
    mlp_stats = [r["variants"][mlp_index]["stats"] for r in results]
    mlp_variant = results[0]["variants"][mlp_index]
    tier_rows = _tier_rows(bandwidth, reference_bw, bandwidth_after, mlp_stats, args.steps)
    io_reference_s = max(row["io_reference_s"] for row in tier_rows)
    kernel_s = max(r["kernel_reference"]["seconds"] for r in results)
    kernel_without_io_s = max(r["kernel_reference"]["without_io_seconds"] for r in results)
    placement, warm_bytes, held_bytes, predicted = _placement(
        args, tiers, kernel_s=kernel_s, bandwidth=bandwidth, kernel_without_io_s=kernel_without_io_s)
    # Bytes of state over all ranks: fp32 params, exp_avg, exp_avg_sq.
    policy_s = fluid_update_seconds(12.0 * args.num_params, held_bytes, reference_bw)
    step_s = max(io_reference_s, kernel_s)
    base_last = results[0]["baseline"]["last"]
    mlp_last = mlp_stats[0][-1]
    # Host memory per rank, measured on the largest rank: MLP-Offload's pool peak, the baseline's
    # double buffers.
    mlp_host = max(r["variants"][mlp_index]["host_bytes"] for r in results)
    sweep = [{"host_memory_bytes": args.host_memory, "mlp_s": mlp_s, "speedup": mlp["speedup"],
              "mlp_host_bytes": mlp_host, "host_memory": mlp_variant["host_memory"], **predicted}]
    for budget in args.host_memory_list[1:]:
        i, row = sweep_rows[sweep_name(budget)]
        sweep.append({"host_memory_bytes": budget, "mlp_s": row["seconds"], "speedup": row["speedup"],
                      "mlp_host_bytes": max(r["variants"][i]["host_bytes"] for r in results),
                      "host_memory": results[0]["variants"][i]["host_memory"],
                      **_placement(args, tiers, budget, *_kernel_times(results, i), bandwidth)[3]})
    state_rows = [_state_dtype_row(results, mlp_index, mlp, "fp32")]
    for d in getattr(args, "state_dtypes", ["fp32"])[1:]:
        i, row = sweep_rows[state_dtype_name(d)]
        state_rows.append(_state_dtype_row(results, i, row, d))
    paired = _paired(results, io_reference_s)
    references = {"io_s": io_reference_s, "mlp_vs_io": _ratio(mlp_s, io_reference_s),
                  "kernel_s": kernel_s, "kernel_threads": results[0]["kernel_reference"]["threads"],
                  "kernel_without_io_s": kernel_without_io_s,
                  "step_s": step_s, "mlp_vs_step": _ratio(mlp_s, step_s),
                  "policy_s": policy_s, **predicted, "predicted_io_s": placement.total_seconds}
    result = UpdateResult(
        machine={"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        config={"paths": args.paths, "num_params": args.num_params, "subgroup_params": args.subgroup_params,
                "host_memory_bytes": args.host_memory, "host_memory_list": args.host_memory_list,
                "prefetch_depth": args.prefetch_depth, "flush_depth": args.flush_depth, "ranks": args.ranks,
                "steps": args.steps, "grad_dtype": args.grad_dtype, "backend": args.backend,
                "io_block_bytes": args.io_block_bytes, "io_queue_depth": args.io_queue_depth,
                "adam_threads": args.adam_threads},
        tiers=tier_rows,
        baseline={"seconds": baseline_s, "min_s": base_min, "max_s": base_max, "steps_s": base_steps,
                  "backward_grad_write_s": backward_s, "backward_steps_s": back_steps,
                  "bytes_read_per_step": base_last["bytes_read"] * args.ranks,
                  "bytes_written_per_step": base_last["bytes_written"] * args.ranks,
                  "compute_s": base_last["compute_s"],
                  "host_bytes": max(r["baseline"]["peak_host_bytes"] for r in results)},
        mlp={"seconds": mlp_s, "min_s": mlp["min_s"], "max_s": mlp["max_s"],
             "steps_s": per_step_max(results, lambda r: r["variants"][mlp_index]["steps_s"]),
             "tier_of": mlp_variant["tier_of"], "host_limit_bytes": mlp_variant["host_limit_bytes"],
             "host_bytes": mlp_host, "host_memory": mlp_variant["host_memory"], "warm_bytes": warm_bytes,
             "no_checksum_s": extra.get("seconds"),
             "whole_buffers_s": sweep_rows[WHOLE_BUFFERS][1]["seconds"] if WHOLE_BUFFERS in sweep_rows else None,
             "checksum_cost_s": mlp_s - extra["seconds"] if extra else None,
             "checksum_thread_s": sum(t["checksum_s"] for t in mlp_last["tiers"]),
             "last_step": mlp_last},
        speedup={"update": _ratio(baseline_s, mlp_s),
                 "paired": _ratio(paired["baseline_s"], paired["mlp_beside_baseline_s"]),
                 "with_backward_write": _ratio(baseline_s + backward_s, mlp_s),
                 "reference": _ratio(baseline_s, policy_s)},
        paired=paired, references=references, placement=placement.to_dict(), sweep=sweep, ablation=ablation,
        deepspeed=_deepspeed_summary(results, baseline_s, mlp_s) if args.vs_deepspeed else None,
        faster_than_reference=faster_than_reference(mlp_s, references, paired),
        emulated_paths=[row["path"] for row in tier_rows if row["emulated"]],
        state_dtypes=state_rows)
    return result


def _state_dtype_row(results, index: int, row: dict, dtype: str) -> dict:
    """MLP-Offload's update with its moments in ``dtype``: variant ``index`` of every rank."""
    kept = steady_slice(len(results[0]["variants"][index]["stats"]))
    per_rank = [[sum(t["bytes_read"] + t["bytes_written"] for t in st["tiers"])
                 for st in r["variants"][index]["stats"][kept]] for r in results]
    moved = [sum(step) for step in zip(*per_rank)]   # per step, over all ranks
    numel = sum(r["numel"] for r in results)
    state = sum(r["variants"][index].get("state_bytes", 12 * r["numel"]) for r in results)
    return {"state_dtype": dtype, "bytes_per_param": state / numel if numel else None, "mlp_s": row["seconds"],
            "min_s": row["min_s"], "max_s": row["max_s"], "speedup": row["speedup"],
            "bytes_moved_per_step": statistics.median(moved) if moved else 0}


def _deepspeed_summary(results, baseline_s: float, mlp_s: float) -> dict:
    """DeepSpeed's own update on the same subgroups, beside the baseline (``--vs-deepspeed``)."""
    reasons = [r["deepspeed"]["unavailable"] for r in results if "unavailable" in r["deepspeed"]]
    if reasons:
        return {"unavailable": reasons[0]}
    steps = per_step_max(results, lambda r: r["deepspeed"]["steps_s"])
    med, lo, hi = steady(steps)
    paired = {}
    if all("deepspeed_steps_s" in r["paired"] for r in results):
        # Its steps alternating with MLP-Offload's (``update_rank._paired_steps``, phase 3): the
        # ratio free of the drift between DeepSpeed's phase of the run and MLP-Offload's.
        ds_s = steady(per_step_max(results, lambda r: r["paired"]["deepspeed_steps_s"]))[0]
        beside = per_step_max(results, lambda r: r["paired"]["mlp_beside_deepspeed_steps_s"])
        beside_s = steady(beside)[0]
        paired = {"paired_s": ds_s, "mlp_beside_deepspeed_s": beside_s, "mlp_beside_deepspeed_steps_s": beside,
                  "paired_speedup_vs_deepspeed": ds_s / beside_s if beside_s > 0 else None}
    return {"seconds": med, "min_s": lo, "max_s": hi, "steps_s": steps, **paired,
            "backward_s": steady(per_step_max(results, lambda r: r["deepspeed"]["backward_s"]))[0],
            "host_bytes": max(r["deepspeed"]["host_bytes"] for r in results),
            "baseline_vs_deepspeed": baseline_s / med if med > 0 else None,
            # DeepSpeed's own update over MLP-Offload's at the headline budget (DeepSpeed's host
            # memory is its own double buffers, host_bytes above).
            "speedup_vs_deepspeed": med / mlp_s if mlp_s > 0 else None}


def faster_than_reference(mlp_s: float, references: dict, paired: dict) -> list[str]:
    """Every figure that came in below its reference: the reference is a yardstick from bandwidth
    passes (the faster of before and after the steps), not a bound, and these say where it missed."""
    out = []
    for ratio, what in ((references["mlp_vs_io"], "MLP-Offload's steps against the I/O reference"),
                        (references["mlp_vs_step"], "MLP-Offload's steps against the step reference"),
                        (paired["replay_vs_io_reference"], "the engine alone against the I/O reference")):
        if ratio is not None and ratio < 1.0:
            out.append(f"{what}: x{ratio:.2f}")
    if references["policy_s"] and mlp_s < references["policy_s"]:
        out.append(f"MLP-Offload's steps against the policy reference: x{mlp_s / references['policy_s']:.2f}")
    return out
