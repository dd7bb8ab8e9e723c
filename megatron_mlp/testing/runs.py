"""Worker functions for multi-process Megatron runs under the CPU harness (tests, smoke-runs).

Each worker runs on one rank (see ``multiproc.run_distributed``) and returns plain data:
losses, this rank's model params, and, on request, optimizer facts.
"""
from __future__ import annotations

import os

import torch


def build(spec, tp: int, mlp_config=None, *, grad_reduce_in_fp32: bool = False, inner_factory=None,
          opt_overrides: dict | None = None, pp: int = 1, overlap_param_gather: bool = False):
    """Parallel state + tiny GPT + Megatron's optimizer (ours when ``mlp_config`` is given)."""
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_mlp.megatron.factory import mlp_offload_optimizers
    from megatron_mlp.testing import gpt, install_cpu_harness

    if not torch.cuda.is_available():   # a real GPU run needs no harness (and it would refuse)
        install_cpu_harness()
    gpt.init_model_parallel(tp=tp, pp=pp, seed=spec.seed)
    # The param all-gather in the forward's pre-hooks (with the overlapped grad reduce, as Megatron-LM
    # requires): small buckets make several bucket groups.
    model = gpt.build_model(spec, grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_param_gather=overlap_param_gather,
                            overlap_grad_reduce=overlap_param_gather, bucket_size=4096 if overlap_param_gather else None)
    with mlp_offload_optimizers(mlp_config, inner_factory):
        opt = get_megatron_optimizer(gpt.optimizer_config(spec, **(opt_overrides or {})), model)
    return model, opt


def inner_optimizers(opt):
    return list(getattr(opt, "chained_optimizers", [opt]))


def train(rank, world_size, spec, tp, mlp_config, iters, grad_reduce_in_fp32=False, inner_factory=None,
          opt_overrides=None, overlap_param_gather=False):
    """Train ``iters`` steps; returns (losses, params-by-name). With ``overlap_param_gather`` the
    params are all-gathered by the next forward's pre-hooks: the last step's are forced at the end."""
    from megatron_mlp.testing import gpt

    model, opt = build(spec, tp, mlp_config, grad_reduce_in_fp32=grad_reduce_in_fp32,
                       inner_factory=inner_factory, opt_overrides=opt_overrides,
                       overlap_param_gather=overlap_param_gather)
    skipped = []
    step = opt.step

    def counting_step():
        ok, grad_norm, zeros = step()
        skipped.append(not ok)
        return ok, grad_norm, zeros

    opt.step = counting_step
    losses = [gpt.train_step(spec, model, opt, i) for i in range(iters)]
    if overlap_param_gather:
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    params = _with_copy_figures(gpt.model_params(model), opt)
    params["__skipped_steps__"] = torch.tensor(sum(skipped))
    return losses, params


def _with_copy_figures(params: dict, opt) -> dict:
    """``params`` plus, where they ran, MLP-Offload's bucket-by-bucket hand-off
    (``__bucket_waits__``: bucket groups handed their params, of those while the update ran;
    megatron/hand_off.py) and its gradient copies during backward (``__early_grad_steps__``: steps
    that used them, steps that copied everything again; megatron/early_grads.py) and the params kept
    on the device (``__device_share__``: params, steps; --mlp-offload-device-memory)."""
    inners = [getattr(o, "optimizer", None) for o in inner_optimizers(opt)]
    waits = [getattr(i, "bucket_waits", None) for i in inners]
    if any(w for w in waits):
        params["__bucket_waits__"] = torch.tensor([sum(w[i] for w in waits if w) for i in (0, 1)])
    early = [e for e in (getattr(i, "early_grads", None) for i in inners) if e is not None]
    if early:
        params["__early_grad_steps__"] = torch.tensor([sum(e.steps_early for e in early),
                                                       sum(e.steps_recopied for e in early)])
    shares = [s for s in (getattr(i, "device_share", None) for i in inners) if s is not None]
    if shares:
        params["__device_share__"] = torch.tensor([sum(s.numel for s in shares),
                                                   sum(s.steps for s in shares)])
    return params


def train_pipeline(rank, world_size, spec, pp, mlp_config, iters, overlap_param_gather=False):
    """Train ``iters`` steps through Megatron's pipeline schedule with ``pp`` stages (TP=1, the
    rest data-parallel); returns (losses on the last stage, None elsewhere; params-by-name). With
    ``overlap_param_gather`` as :func:`train`."""
    from megatron_mlp.testing import gpt

    model, opt = build(spec, 1, mlp_config, pp=pp, overlap_param_gather=overlap_param_gather)
    losses = [gpt.pipeline_train_step(spec, model, opt, i) for i in range(iters)]
    if overlap_param_gather:
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    return losses, _with_copy_figures(gpt.model_params(model), opt)


def device_state_report(rank, world_size, spec, tp, mlp_config, iters, inner_factory=None):
    """Train, then list every tensor the optimizer object graph keeps that is not a view of the
    model's DDP buffers: what would occupy device memory on a GPU (fp32 masters, Adam state)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_mlp.testing import gpt

    model, opt = build(spec, tp, mlp_config, inner_factory=inner_factory)
    for i in range(iters):
        gpt.train_step(spec, model, opt, i)
    owned_storages = set()
    for chunk in model:
        for buf in chunk.buffers:
            for t in (buf.param_data, buf.grad_data):
                if t is not None:
                    owned_storages.add(t.untyped_storage().data_ptr())
    report = []
    for dopt in inner_optimizers(opt):
        assert isinstance(dopt, DistributedOptimizer)
        fp32_masters = [p for g in dopt.shard_fp32_from_float16_groups for p in g if p is not None]
        state_tensors = []
        for st in dopt.optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    state_tensors.append((k, v.numel()))
        group_params_outside = [p.numel() for g in dopt.optimizer.param_groups for p in g["params"]
                                if p.untyped_storage().data_ptr() not in owned_storages]
        report.append({"type": type(dopt).__name__, "fp32_master_numel": sum(p.numel() for p in fp32_masters),
                       "state_tensor_numel": sum(n for _, n in state_tensors),
                       "group_params_not_in_ddp_buffers": sum(group_params_outside),
                       "shard_numel": sum(p.numel() for g in dopt.optimizer.param_groups for p in g["params"])})
    return report


def checkpoint_run(rank, world_size, spec, tp, mlp_config, iters_before, iters_after, ckpt_dir, mode,
                   sharding_type="dp_reshardable", inner_factory=None, overlap_param_gather=False):
    return _checkpoint_run(rank, world_size, spec, tp, mlp_config, iters_before, iters_after, ckpt_dir, mode,
                           sharding_type, inner_factory, overlap_param_gather)


def checkpoint_run_tp(rank, world_size, save_tp, load_tp, spec, mlp_config, iters, ckpt_dir, mode,
                      sharding_type, inner_factory=None):
    """checkpoint_run with the TP size chosen by mode: save with save_tp, load with load_tp."""
    tp = save_tp if mode == "save" else load_tp
    return _checkpoint_run(rank, world_size, spec, tp, mlp_config, iters, 0, ckpt_dir, mode, sharding_type,
                           inner_factory)


def _checkpoint_run(rank, world_size, spec, tp, mlp_config, iters_before, iters_after, ckpt_dir, mode,
                    sharding_type, inner_factory, overlap_param_gather=False):
    """mode 'save': train iters_before, save, keep training iters_after; 'load': build, load, train
    iters_after. Returns (losses after the save point, params, optimizer state by param name).
    With ``overlap_param_gather`` the params are all-gathered by the next forward's pre-hooks;
    around the save the hooks are turned off with a forced all-gather, as Megatron-LM does."""
    from megatron_mlp.testing import gpt

    model, opt = build(spec, tp, mlp_config, inner_factory=inner_factory, overlap_param_gather=overlap_param_gather)
    meta = {"distrib_optim_sharding_type": sharding_type}
    gpt_model = gpt.gpt_model(model)
    if mode == "save":
        for i in range(iters_before):
            gpt.train_step(spec, model, opt, i)
        if overlap_param_gather:
            for chunk in model:
                chunk.disable_forward_pre_hook()
        save_checkpoint(gpt_model.sharded_state_dict(), opt, meta, ckpt_dir, rank)
        if overlap_param_gather:
            for chunk in model:
                chunk.enable_forward_pre_hook()
    else:
        if mlp_config is None:
            # Stock DistributedOptimizer without TE/Apex cannot load into a fresh optimizer (no
            # torch state yet: an assert on the per-param steps). One step creates that state;
            # the load then overwrites params, Adam state and step.
            gpt.train_step(spec, model, opt, 0)
        loaded = load_checkpoint(gpt_model.sharded_state_dict(), opt, meta, ckpt_dir)
        gpt_model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
    state = optimizer_state_by_param(model, opt)
    losses = [gpt.train_step(spec, model, opt, iters_before + i) for i in range(iters_after)]
    if overlap_param_gather:
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    return losses, gpt.model_params(model), state


def save_checkpoint(model_sd: dict, opt, meta: dict, ckpt_dir: str, rank: int) -> None:
    """Megatron's distributed save of the model's and the optimizer's sharded state into ``ckpt_dir``."""
    from megatron.core import dist_checkpointing

    sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)}
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sd, ckpt_dir)
    torch.distributed.barrier()


def load_checkpoint(model_sd: dict, opt, meta: dict, ckpt_dir: str) -> dict:
    """Megatron's distributed load of what :func:`save_checkpoint` wrote; the caller applies it."""
    from megatron.core import dist_checkpointing

    sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=meta)}
    return dist_checkpointing.load(sd, ckpt_dir)


def optimizer_state_by_param(model, opt) -> dict:
    """{param name: {"param", "exp_avg", "exp_avg_sq"}} of this rank's shard (fp32 CPU copies)."""
    names = {p: n for n, p in model[0].named_parameters()}
    out = {}
    for dopt in inner_optimizers(opt):
        for gbuf_range_maps in dopt.gbuf_ranges:
            for ranges in gbuf_range_maps.values():
                for bucket_map in ranges:
                    for model_param in bucket_map["param_map"]:
                        t = dopt._get_main_param_and_optimizer_states(model_param)
                        out[names[model_param]] = {k: t[k].detach().float().cpu().clone()
                                                   for k in ("param", "exp_avg", "exp_avg_sq")}
    return out


def grad_staging_report(rank, world_size, spec, mlp_config, iters, grad_reduce_in_fp32=True):
    """Train; after each step compare the host gradient staging buffer with the grad buffer's shard
    (rounded to the staging dtype). Returns (losses, [{bytes_d2h, host_dtype, exact}] per step)."""
    from megatron_mlp.testing import gpt

    model, opt = build(spec, 1, mlp_config, grad_reduce_in_fp32=grad_reduce_in_fp32)
    staging = inner_optimizers(opt)[0].optimizer
    losses, report = [], []
    for i in range(iters):
        losses.append(gpt.train_step(spec, model, opt, i))
        exact = all(torch.equal(staging._grads_host[s.flat_start:s.flat_end],
                                s.grad_view.to(staging.transfer_dtype)) for s in staging._segments)
        report.append({"bytes_d2h": staging.last_stats["bytes_d2h"], "numel": staging._numel,
                       "host_dtype": str(staging.transfer_dtype), "exact": exact})
    return losses, report


def build_only(rank, world_size, spec, mlp_config, opt_overrides=None, builds=1):
    """Build the optimizer ``builds`` times inside one factory swap (what a ChainedOptimizer of
    several distributed optimizers does); returns the error message, or None."""
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_mlp.megatron.factory import mlp_offload_optimizers
    from megatron_mlp.testing import gpt, install_cpu_harness

    install_cpu_harness()
    gpt.init_model_parallel(tp=1, seed=spec.seed)
    model = gpt.build_model(spec)
    try:
        with mlp_offload_optimizers(mlp_config):
            for _ in range(builds):
                get_megatron_optimizer(gpt.optimizer_config(spec, **(opt_overrides or {})), model)
    except ValueError as exc:
        return str(exc)
    return None


def train_handing_off(rank, world_size, spec, tp, mlp_config, iters, first_bucket_timeout_s=10.0):
    """``train`` with ``--overlap-param-gather`` and the update behind the caller, watching the
    hand-off: returns (losses, params, watch) where ``watch["needs"]`` is, per step but the last, the
    positions in the update's order of the subgroups each bucket group's all-gather waited for (in
    the order the next forward dispatched them), and ``watch["first_bucket_first"]`` says, per step
    but the last, whether the next forward's first bucket group got its params while the update's
    last subgroup was held back (its hand-off blocked until then, ``first_bucket_timeout_s`` at
    most): event order, not timing."""
    import threading

    from megatron_mlp.testing import gpt

    model, opt = build(spec, tp, mlp_config, overlap_param_gather=True)
    [inner] = [o.optimizer for o in inner_optimizers(opt)]
    offload = inner.offload
    watch = {"needs": [], "first_bucket_first": []}
    first_bucket = threading.Event()
    wait_for_params, step = inner.wait_for_params, offload.step

    def watched_wait(ranges):
        wait_for_params(ranges)
        if watch["needs"]:
            position = {sg: pos for pos, sg in enumerate(offload.next_order())}
            watch["needs"][-1].append({position[sg.index] for s, e in ranges for sg in offload.plan.overlapping(s, e)})
        first_bucket.set()

    def watched_step(*args, on_subgroup_done=None, **kwargs):
        first_bucket.clear()
        watch["needs"].append([])
        finished = [0]

        def done(start, end):
            finished[0] += 1
            if finished[0] == len(offload.plan):   # the update's last subgroup (whichever the pipeline took last)
                watch["first_bucket_first"].append(first_bucket.wait(first_bucket_timeout_s))
            on_subgroup_done(start, end)

        return step(*args, on_subgroup_done=done, **kwargs)

    inner.wait_for_params, offload.step = watched_wait, watched_step
    outcomes = [gpt.train_step_outcome(spec, model, opt, i) for i in range(iters)]
    # No forward follows the last step: release its last subgroup, and keep the forced all-gather
    # (bucket groups in buffer order, as before a checkpoint save) out of the last step's needs.
    first_bucket.set()
    watch["needs"].append([])
    for chunk in model:
        chunk.start_param_sync(force_sync=True)
    watch["needs"].pop()
    params = gpt.model_params(model)
    params["__skipped_steps__"] = torch.tensor(sum(not o.ok for o in outcomes))
    return [o.loss for o in outcomes], params, watch
