"""`megatron-mlp demo`: train a small Megatron-Core GPT with MLP-Offload, then with the ZeRO-3-style
policy, and print the per-iteration loss, then the update phase's speed-up (with each side's host
memory), the iteration's speed-up and the update's share of the iteration, and the phase breakdown.

The update phase is what MLP-Offload changes, so it leads: on a CPU the model's forward and
backward dominate the iteration, on a GPU they run 10-100x faster and the update decides it.
Sized to finish in a few minutes on a 2-core laptop (16-bit matmuls in fp32 where the CPU has
no native 16-bit dot products: the CPU harness's choice).

What runs is Megatron-Core's own GPTModel, DistributedDataParallel and DistributedOptimizer
(replaced by MLPOffloadDistributedOptimizer through the factory hook); on a machine without a GPU
the CPU harness maps CUDA onto the CPU. The optimizer state (12 bytes/param) lives on two tier
directories under the work dir.

The baseline is DeepSpeed ZeRO-3 NVMe offload's policy (``megatron_mlp.bench.zero_style``, same
engine and Adam kernel): one path, gradients upcast to fp32 and written to the path (what ZeRO-3
does during backward; here timed inside the step and reported as ``backward-grad-write``), then
every subgroup's fp32 params, m, v *and* gradient read back, updated and written, in ascending
order, with no host cache. Both runs must reach the same loss: the policy changes where bytes go,
never the arithmetic. (A few dozen iterations on a 32k vocabulary leave the loss near ln(vocab):
the demo measures the update, not convergence.)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings


DEMO_LR = 1e-4  # small enough that the loss falls steadily from the first iterations
DEMO_HEADS = 8
DEMO_SEQ_LENGTH = 128
HOST_BYTES_PER_PARAM = 6
"""Host memory each parameter takes at the least: its new bf16 value and its fp32 gradient pass
through host buffers on every step (on a machine without a GPU the whole model lives there too)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-mlp demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=12, help="training iterations per run (default 12)")
    p.add_argument("--workdir", default=None,
                   help="directory for the two tier paths (default: a temporary dir under /var/tmp, removed)")
    p.add_argument("--hidden-size", type=int, default=512, help="GPT hidden size (default 512)")
    p.add_argument("--num-layers", type=int, default=4, help="GPT layers (default 4)")
    p.add_argument("--vocab-size", type=int, default=32768, help="vocabulary (default 32768)")
    p.add_argument("--paths", default=None,
                   help="tier paths as for --mlp-offload-paths, e.g. '/local/nvme/x;/lustre/x' "
                        "(default: two directories under the work dir)")
    p.add_argument("--subgroup-size", type=int, default=2_000_000, help="elements per subgroup (default 2M)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout and nothing else")
    return p


def _check_args(args) -> None:
    """Every flag, before torch starts and before anything is created; ``--workdir`` made absolute.

    Raises:
        ConfigError: naming the flag the user typed and its value.
    """
    from megatron_mlp.bench.common import check_fits_in_memory
    from megatron_mlp.config import check_subgroup_size
    from megatron_mlp.errors import ConfigError
    from megatron_mlp.testing.gpt import TinyGPT
    from megatron_mlp.tier.spec import check_tier_path, parse_tier_paths
    from megatron_mlp.tier.validation import validate_tier_paths

    for flag, value in (("--iters", args.iters), ("--num-layers", args.num_layers), ("--vocab-size", args.vocab_size),
                        ("--subgroup-size", args.subgroup_size)):
        if value < 1:
            raise ConfigError(f"{flag}: {value} must be at least 1")
    if args.hidden_size < DEMO_HEADS or args.hidden_size % DEMO_HEADS:
        raise ConfigError(f"--hidden-size: {args.hidden_size} must be a positive multiple of {DEMO_HEADS} "
                          f"(the demo GPT's attention heads)")
    check_subgroup_size(args.subgroup_size, flag="--subgroup-size")
    params = TinyGPT(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                     num_attention_heads=DEMO_HEADS, seq_length=DEMO_SEQ_LENGTH).num_params_estimate
    check_fits_in_memory("--hidden-size, --num-layers, --vocab-size", params * HOST_BYTES_PER_PARAM,
                         f"a GPT of {params:,} params (at least {HOST_BYTES_PER_PARAM} bytes each)")
    if args.paths:
        # The user's tier paths are used as they are: the demo makes none of them.
        validate_tier_paths(parse_tier_paths(args.paths, flag="--paths"), flag="--paths", create=False)
    elif args.workdir is not None:
        args.workdir = os.path.abspath(args.workdir)
        for name in ("tier-a", "tier-b"):
            check_tier_path(os.path.join(args.workdir, name), "--workdir")
        if not os.path.isdir(args.workdir):
            raise ConfigError(f"--workdir: {args.workdir} is not a directory (the demo makes its two tier "
                              "directories inside an existing one)")


def _init_single_process():
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)


class ZeroStyleAdam:
    """The ZeRO-3-style policy as an offload optimizer (``optim.protocol.OffloadOptimizer``): one
    ZeroStyleOffload per param group, so no-weight-decay groups keep their hyper-parameters; its
    subgroups in ascending order. Demo-only: it does not checkpoint."""

    def __init__(self, config, group_ranges, param_groups, initial_params, staging_bytes=0):
        # staging_bytes: the host budget is MLP-Offload's; this policy keeps its own double buffers.
        from megatron_mlp.bench.zero_style import ZeroStyleOffload
        from megatron_mlp.engine import Engine
        from megatron_mlp.optim.subgroups import SubgroupPlan

        self.param_groups = param_groups
        self.group_ranges = list(group_ranges)
        self.numel = self.group_ranges[-1][1] if self.group_ranges else 0
        # The parts' subgroups, as one plan over the shard (each part splits its group the same way).
        self.plan = SubgroupPlan(self.group_ranges, config.subgroup_params)
        self.trace = None
        self.engine = Engine(backend=config.backend, block_bytes=config.block_bytes,
                             queue_depth=config.queue_depth, num_threads=config.io_threads)
        self.parts = []
        for (s, e), g in zip(self.group_ranges, param_groups):
            b1, b2 = g.get("betas", (0.9, 0.999))
            self.parts.append(ZeroStyleOffload(
                config.tiers[0].path, e - s, config.subgroup_params, self.engine, lr=g["lr"], betas=(b1, b2),
                eps=g.get("eps", 1e-8), weight_decay=g.get("weight_decay", 0.0),
                initial_params=initial_params(s, e)))
        self.last_step_stats = {}

    def next_order(self) -> list[int]:
        return list(range(len(self.plan)))

    @property
    def policy_host_bytes(self) -> int:
        """Host memory of the policy: each part's two state and two fp32 gradient buffers."""
        return sum(part.peak_host_bytes for part in self.parts)

    def step(self, grads, params_out=None, *, inv_loss_scale=1.0, clip_coef=1.0, on_subgroup_done=None,
             grads_ready=None):
        import torch

        if grads_ready is not None:
            grads_ready(0, self.numel)   # ZeRO-3 writes the whole gradient before the update
        if inv_loss_scale != 1.0 or clip_coef != 1.0:
            # The kernel's arithmetic (g * inv, then * clip, in fp32), done before the fp32 write.
            grads = grads.float()
            if inv_loss_scale != 1.0:
                grads.mul_(torch.tensor(inv_loss_scale, dtype=torch.float32))
            if clip_coef != 1.0:
                grads = grads * clip_coef
        bwd = compute = 0.0
        read = written = 0
        for (s, e), g, part in zip(self.group_ranges, self.param_groups, self.parts):
            part.hyper.update(lr=float(g["lr"]), weight_decay=float(g.get("weight_decay", 0.0)))
            bwd += part.backward_write_grads(grads[s:e])
            part.step(params_out[s:e] if params_out is not None else None)
            compute += part.last["compute_s"]
            read += part.last["bytes_read"]
            written += part.last["bytes_written"] + (e - s) * 4
            if on_subgroup_done is not None:
                on_subgroup_done(s, e)
        self.last_step_stats = {"compute_s": compute, "backward_grad_write_s": bwd,
                                "tiers": [{"bytes_read": read, "bytes_written": written}]}

    def read_range(self, start, end):
        raise NotImplementedError("the ZeRO-3-style demo baseline does not checkpoint")

    def write_range(self, start, end, param=None, exp_avg=None, exp_avg_sq=None):
        raise NotImplementedError("the ZeRO-3-style demo baseline does not checkpoint")

    def set_completed_steps(self, steps):
        for part in self.parts:
            part.step_count = int(steps)

    def close(self):
        for part in self.parts:
            part.close()
        self.engine.close()


def _run(label, spec, mlp_config, iters, log, inner_factory=None):
    import torch
    from megatron.core import parallel_state

    from megatron_mlp.megatron.timers import byte_counts, phase_seconds
    from megatron_mlp.testing import gpt
    from megatron_mlp.testing.runs import build, inner_optimizers

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    model, opt = build(spec, 1, mlp_config, inner_factory=inner_factory, opt_overrides={"lr": DEMO_LR})
    dopt = inner_optimizers(opt)[0]
    numel = dopt.optimizer.offload.numel
    tiers = mlp_config.tiers[:1] if inner_factory is not None else mlp_config.tiers
    log(f"[{label}] {sum(p.numel() for p in model[0].parameters()) / 1e6:.1f}M params, optimizer state "
        f"{numel * 12 / 2**20:.0f} MiB on {', '.join(t.path for t in tiers)}")
    losses, iter_s, phases = [], [], []
    for i in range(iters):
        t0 = time.perf_counter()
        loss = gpt.train_step(spec, model, opt, i)
        iter_s.append(time.perf_counter() - t0)
        losses.append(loss)
        ph = phase_seconds(dopt.optimizer)
        ph.update({k: v for k, v in byte_counts(dopt.optimizer).items()})
        extra = dopt.optimizer.offload.last_step_stats
        if "backward_grad_write_s" in extra:
            ph["backward-grad-write"] = extra["backward_grad_write_s"]
        phases.append(ph)
        log(f"[{label}] iter {i + 1:3d}/{iters}  loss {loss:.4f}  {iter_s[-1]:.2f} s  "
            f"update {ph.get('update', 0.0):.2f} s")
    offload = dopt.optimizer.offload
    host_bytes = policy_host_bytes(offload)
    staging = int(dopt.optimizer.staging_bytes)
    offload.close()
    del opt, model, offload
    steady = iter_s[1:] if len(iter_s) > 1 else iter_s  # the first iteration writes the initial state
    # Medians: a 2-core machine shared with anything else has outlier iterations.
    keys = sorted({k for p in phases[1:] or phases for k in p})
    breakdown = {k: statistics.median([p.get(k, 0.0) for p in (phases[1:] or phases)]) for k in keys}
    torch.distributed.barrier()
    return {"losses": losses, "iter_s": statistics.median(steady), "breakdown": breakdown, "host_bytes": host_bytes,
            "staging_bytes": staging}


def policy_host_bytes(offload) -> int:
    """Host bytes the offload policy itself holds at its peak, without the gradient and param
    staging both sides share: MLP-Offload's pool (cache and working buffers) and upcast buffer,
    the ZeRO-3-style policy's double buffers."""
    if hasattr(offload, "policy_host_bytes"):
        return int(offload.policy_host_bytes)
    return int(offload.peak_host_bytes) - int(offload.host_memory.staging_bytes)


def headline(r_mlp: dict, r_base: dict) -> dict:
    """The figures the demo leads with, from the two runs' steady-state medians.

    ``*_update_s``: the optimizer step's ``update`` phase; the baseline's excludes its fp32
    gradient write (ZeRO-3 does that during backward), reported as ``baseline_grad_write_s`` and
    counted in ``update_speedup_with_grad_write``. ``update_share_*``: the update phase's share of
    that side's iteration on this machine (its gradient write included for the baseline).
    """
    ratio = lambda a, b: a / b if b > 0 else float("nan")  # noqa: E731
    grad_write = r_base["breakdown"].get("backward-grad-write", 0.0)
    mlp_update = r_mlp["breakdown"].get("update", 0.0)
    base_update = r_base["breakdown"].get("update", 0.0) - grad_write
    return {
        "update_speedup": ratio(base_update, mlp_update),
        "update_speedup_with_grad_write": ratio(base_update + grad_write, mlp_update),
        "mlp_update_s": mlp_update, "baseline_update_s": base_update, "baseline_grad_write_s": grad_write,
        "mlp_host_bytes": r_mlp["host_bytes"], "baseline_host_bytes": r_base["host_bytes"],
        "staging_host_bytes": r_mlp["staging_bytes"],
        "iteration_speedup": ratio(r_base["iter_s"], r_mlp["iter_s"]),
        "update_share_mlp": ratio(mlp_update, r_mlp["iter_s"]),
        "update_share_baseline": ratio(base_update + grad_write, r_base["iter_s"]),
    }


GPU_NOTE = ("on a GPU the model's forward and backward run 10-100x faster than on a CPU, "
            "so there the update decides the iteration")


def headline_lines(result: dict) -> list[str]:
    """The demo's summary, the update phase first."""
    from megatron_mlp.units import human_bytes as size

    return [
        f"update phase (what MLP-Offload changes): speed-up {result['update_speedup']:.2f}x",
        f"  mlp-offload {result['mlp_update_s']:.3f} s, host memory {size(result['mlp_host_bytes'])} "
        "(working buffers + a cache of 2 subgroups)",
        f"  zero3-style {result['baseline_update_s']:.3f} s, host memory {size(result['baseline_host_bytes'])} "
        f"(double buffers); with its fp32 gradient write ({result['baseline_grad_write_s']:.3f} s) "
        f"{result['update_speedup_with_grad_write']:.2f}x",
        f"  both sides also stage the gradient and params in {size(result['staging_host_bytes'])} of host memory",
        f"iteration: speed-up {result['iteration_speedup']:.2f}x (mlp-offload {result['mlp_iter_s']:.2f} s, "
        f"zero3-style {result['baseline_iter_s']:.2f} s); the update is {result['update_share_mlp']:.0%} and "
        f"{result['update_share_baseline']:.0%} of it on this machine",
        f"  ({GPU_NOTE})",
        f"final loss {result['final_loss_mlp']:.4f} vs {result['final_loss_baseline']:.4f} "
        f"({'equal' if result['losses_equal'] else 'DIFFERENT'})",
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _check_args(args)
    out = sys.stderr if args.json else sys.stdout
    log = lambda msg: print(msg, file=out, flush=True)  # noqa: E731
    warnings.filterwarnings("ignore")
    import torch

    from megatron_mlp.config import MLPOffloadConfig
    from megatron_mlp.testing import gpt, install_cpu_harness

    if not torch.cuda.is_available():
        install_cpu_harness()
        log("no GPU: running Megatron-Core on the CPU through megatron_mlp.testing's harness")
    _init_single_process()
    spec = gpt.TinyGPT(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                       num_attention_heads=DEMO_HEADS, seq_length=DEMO_SEQ_LENGTH, micro_batch_size=2)
    own_dir = args.workdir is None
    workdir = args.workdir or tempfile.mkdtemp(prefix="mlp-offload-demo-", dir="/var/tmp")
    if args.paths:
        paths = args.paths
    else:
        tiers = [os.path.join(workdir, name) for name in ("tier-a", "tier-b")]
        for t in tiers:
            os.makedirs(t, exist_ok=True)
        paths = ";".join(tiers)
    try:
        mlp = MLPOffloadConfig.from_paths(paths, subgroup_params=args.subgroup_size,
                                          host_cache_bytes=2 * 12 * args.subgroup_size, calibration="off")
        r_mlp = _run("mlp-offload", spec, mlp, args.iters, log)
        r_base = _run("zero3-style", spec, mlp, args.iters, log, inner_factory=ZeroStyleAdam)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    result = {
        **headline(r_mlp, r_base),
        "mlp_iter_s": r_mlp["iter_s"], "baseline_iter_s": r_base["iter_s"],
        "final_loss_mlp": r_mlp["losses"][-1], "final_loss_baseline": r_base["losses"][-1],
        "losses_equal": r_mlp["losses"] == r_base["losses"],
        "breakdown_mlp": r_mlp["breakdown"], "breakdown_baseline": r_base["breakdown"],
        "iters": args.iters, "device": "cuda" if torch.cuda.is_available() else "cpu (harness)",
        "paths": [t.path for t in mlp.tiers],
        "note": ("tier paths as given by --paths" if args.paths
                 else "both tier paths are directories under the work dir (one device)"),
    }
    result["speedup"] = result["iteration_speedup"]   # the name earlier versions printed
    if args.json:
        print(json.dumps(result))
    else:
        log("")
        for line in headline_lines(result):
            log(line)
        log("\nphase breakdown (median s/iteration after the first):")
        for k in sorted(set(r_mlp["breakdown"]) | set(r_base["breakdown"])):
            if k.startswith("bytes"):
                continue
            log(f"  {k:<22} mlp-offload {r_mlp['breakdown'].get(k, 0.0):8.3f}   "
                f"zero3-style {r_base['breakdown'].get(k, 0.0):8.3f}")
    return 0 if result["losses_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
