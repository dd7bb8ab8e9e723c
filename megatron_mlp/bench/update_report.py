"""``bench update``'s report: the text it prints and the sweep's picture, from an ``UpdateResult``."""
from __future__ import annotations

from megatron_mlp.bench.update_result import UpdateResult

GB = 1e9


def _f(value, spec: str = ".2f") -> str:
    """A figure, or 'n/a' where the run has none (a ratio over a zero reference: no I/O at all when
    the whole state fits in host memory; a step with nothing to replay)."""
    return "n/a" if value is None else format(value, spec)


def _x(value) -> str:
    """A ratio as 'x1.23', or 'n/a'."""
    return "n/a" if value is None else f"x{value:.2f}"


def _header(c: dict) -> str:
    return (f"bench update: {c['num_params']:,} params, subgroups of {c['subgroup_params']:,}, "
            f"host memory per rank {c['host_memory_bytes'] / GB:.2f} GB for each side, "
            f"{c['ranks']} rank(s), grads {c['grad_dtype']}, "
            f"I/O tasks of {c['io_block_bytes'] / 2**20:g} MiB x{c['io_queue_depth']} "
            "in flight (every engine), Adam kernel on "
            + (f"{c['adam_threads']} thread(s)" if c.get('adam_threads') else "every core, one fewer beside I/O")
            + " (both sides)")


def _tier_lines(t: dict) -> list[str]:
    after = t.get("after")
    lines = [f"  tier {t['path']} ({t['label']}{', qos cap' if t['emulated'] else ''}): "
             f"read {t['read_bytes_per_s'] / GB:.2f} GB/s, write {t['write_bytes_per_s'] / GB:.2f} GB/s, "
             f"both at once {t['concurrent_bytes_per_s'] / GB:.2f} GB/s "
             f"({'shared' if t['shared_rw_limit'] else 'separate'} limit)"
             + (f"; after the steps read {after['read_bytes_per_s'] / GB:.2f}, write "
                f"{after['write_bytes_per_s'] / GB:.2f}, both {after['concurrent_bytes_per_s'] / GB:.2f} GB/s"
                if after else "")
             + f"; MLP moved {t['mlp_bytes_read_per_step'] / GB:.2f} GB read + "
             f"{t['mlp_bytes_written_per_step'] / GB:.2f} GB written per step -> reference "
             f"{_f(t['io_reference_s'])} s"]
    if t.get("alongside_adam"):
        a = t["alongside_adam"]
        lines.append(f"    alongside the Adam kernel on one core it reads at {_f(a['read_vs_idle'])}x and writes "
                     f"at {_f(a['write_vs_idle'])}x its idle rate; the reference assumes idle cores")
    return lines


def _error(predicted, measured) -> str:
    """`` (measured +12%)``: how far the measured time is from the prediction."""
    if not predicted or not measured:
        return ""
    return f" (measured {100 * (measured / predicted - 1):+.0f}%)"


def _deepspeed_line(ds: dict) -> str:
    if "unavailable" in ds:
        return f"DeepSpeed's own update (--vs-deepspeed): not measured ({ds['unavailable']})"
    return (f"DeepSpeed's own update (its aio handle + DeepSpeedCPUAdam, same subgroups and path): "
            f"{ds['seconds']:.2f} s (min {ds['min_s']:.2f}, max {ds['max_s']:.2f}); the baseline takes "
            f"{_x(ds['baseline_vs_deepspeed'])} its time; host memory {ds['host_bytes'] / GB:.2f} GB; "
            f"MLP-Offload is {_f(ds['speedup_vs_deepspeed'])}x faster than it"
            + (f"; alternating step by step with it: {ds['paired_s']:.2f} s against {ds['mlp_beside_deepspeed_s']:.2f} s "
               f"-> {_f(ds['paired_speedup_vs_deepspeed'])}x" if ds.get("paired_s") is not None else ""))


def format_text(r: UpdateResult) -> str:
    """What ``bench update`` prints without ``--json``."""
    c, base, mlp, ref, p, sp = r.config, r.baseline, r.mlp, r.references, r.paired, r.speedup
    lines = [_header(c)]
    for t in r.tiers:
        lines += _tier_lines(t)
    lines.append(f"ZeRO-3-style baseline: update {base['seconds']:.2f} s "
                 f"(+ {base['backward_grad_write_s']:.2f} s writing fp32 grads in backward)")
    if r.deepspeed is not None:
        lines.append(_deepspeed_line(r.deepspeed))
    for a in r.ablation:
        lines.append(f"  {a['name']:<42} {a['seconds']:7.2f} s  ({_f(a['speedup'])}x)")
    if mlp["no_checksum_s"] is not None:
        lines.append(f"  (MLP-Offload without checksums: {mlp['no_checksum_s']:.2f} s; crc32c threads "
                     f"busy {mlp['checksum_thread_s']:.2f} s per step, overlapped with I/O)")
    if mlp.get("whole_buffers_s"):
        lines.append(f"  (the same budget in whole-subgroup working buffers, as before the pool in pieces: "
                     f"{mlp['whole_buffers_s']:.2f} s, {base['seconds'] / mlp['whole_buffers_s']:.2f}x)")
    m = mlp["host_memory"]
    if m.get("stream_pieces"):
        lines.append(f"host pool in pieces: a stream of {m['stream_pieces']} pieces of "
                     f"{m['piece_bytes'] / 2**20:.1f} MiB beside the cache")
    lines.append(f"host memory per rank (limit {c['host_memory_bytes'] / GB:.2f} GB): baseline "
                 f"{base['host_bytes'] / GB:.2f} GB (double buffers), MLP-Offload "
                 f"{mlp['host_bytes'] / GB:.2f} GB measured ({m['working_buffers']} working buffers, prefetch "
                 f"{m['prefetch_depth']} / flush {m['flush_depth']}, + {m['cache_buffers']} cache buffers); gradients "
                 f"and params out, the device's side in training, counted on neither side")
    lines.append(f"MLP-Offload: {mlp['seconds']:.2f} s -> {_f(sp['update'])}x the baseline at that memory; "
                 f"alternating step by step with it: {p['baseline_s']:.2f} s against "
                 f"{p['mlp_beside_baseline_s']:.2f} s -> {_f(sp['paired'])}x")
    if len(r.sweep) > 1:
        lines.append("speed-up per host-memory budget (MLP-Offload's measured host bytes):")
        for row in r.sweep:
            lines.append(f"  {row['host_memory_bytes'] / GB:7.2f} GB  {row['mlp_s']:7.2f} s  {_f(row['speedup'])}x  "
                         f"({row['mlp_host_bytes'] / GB:.2f} GB used, {row['host_memory']['cache_buffers']} cache "
                         f"buffers; predicted {_f(row.get('predicted_s'))} s{_error(row.get('predicted_s'), row['mlp_s'])})")
    if r.state_dtypes and len(r.state_dtypes) > 1:
        lines.append("MLP-Offload's update per Adam moment dtype (fp32 master params; --state-dtype):")
        for row in r.state_dtypes:
            lines.append(f"  {row['state_dtype']:>5}  {row['bytes_per_param']:5.2f} B/param stored  "
                         f"{row['bytes_moved_per_step'] / GB:7.3f} GB moved/step  {row['mlp_s']:7.2f} s  "
                         f"{_f(row['speedup'])}x the baseline")
    lines.append(f"references (yardsticks from the bandwidth passes, not bounds): I/O {_f(ref['io_s'])} s "
                 f"(MLP-Offload {_x(ref['mlp_vs_io'])}); placement model predicted {_f(ref['predicted_s'])} s"
                 f"{_error(ref['predicted_s'], mlp['seconds'])}"
                 + (f" (the I/O at the tiers' bandwidth beside the Adam kernel while it runs; every byte at their "
                    f"idle bandwidth, what plan says: {_f(ref['predicted_idle_s'])} s{_error(ref['predicted_idle_s'], mlp['seconds'])}; "
                    f"every byte beside the kernel: {_f(ref.get('predicted_beside_s'))} s"
                    f"{_error(ref.get('predicted_beside_s'), mlp['seconds'])})"
                    if ref.get("predicted_idle_s") not in (None, ref["predicted_s"]) else ""))
    lines.append(f"the step's kernels alone on {ref['kernel_threads'] or 'every'} thread(s), no I/O: "
                 f"{ref['kernel_s']:.2f} s; step reference, the larger of that and the I/O reference: "
                 f"{ref['step_s']:.2f} s ({_x(ref['mlp_vs_step'])})")
    if p["replay_s"] is not None:
        err = p["pipeline_overhead_stderr_s"]
        lines.append(f"the same bytes moved by the engine alone (no kernel, no pipeline), after each of "
                     f"{len(p['replay_steps_s'])} more steps: {p['replay_s']:.2f} s = "
                     f"{_x(p['replay_vs_io_reference'])} the I/O reference, MLP-Offload's steps beside them "
                     f"{p['mlp_s']:.2f} s ({_x(p['mlp_vs_replay'])}); the pipeline costs "
                     f"{_f(p['pipeline_overhead_s'], '+.3f')} s a step" + (f" (standard error {err:.3f})" if err else ""))
    if sp["reference"] is not None:
        lines.append(f"policy reference: a fluid schedule under this byte policy on these bandwidths takes "
                     f"{ref['policy_s']:.2f} s ({_f(sp['reference'])}x the baseline)")
    for flag in r.faster_than_reference:
        lines.append(f"FASTER THAN ITS REFERENCE: {flag} (the device ran faster than its bandwidth passes)")
    if r.emulated_paths:
        lines.append(f"note: {', '.join(r.emulated_paths)} emulated (engine bandwidth cap), not a real tier")
    return "\n".join(lines)


def plot_sweep(r: UpdateResult, path: str) -> None:
    """The speed-up per host-memory budget as a PNG: how much host memory buys how much."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(r.sweep, key=lambda row: row["host_memory_bytes"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([row["host_memory_bytes"] / 1e9 for row in rows], [row["speedup"] for row in rows], marker="o")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("host memory per rank, GB (both sides within it)")
    ax.set_ylabel("update speed-up over the ZeRO-3 policy")
    c = r.config
    ax.set_title(f"bench update: {c['num_params'] / 1e6:g}M params, subgroups of {c['subgroup_params'] / 1e6:g}M",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
