"""The stand-in's training loop: Megatron-Core's tiny GPT, its optimizer factory and checkpoints.

``get_megatron_optimizer`` is imported by name and ``training_log`` is a module global, as in
Megatron-LM's training.py, so the launcher's hooks replace them here exactly as there. Each rank
prints Megatron-style iteration lines (losses and grad norms in ``float.hex``, so tests compare
them bit for bit) and, with ``--standin-result-dir``, writes what it saw to ``rank<N>.json``.
"""
import datetime
import json
import os
import signal

import torch

from megatron.core.optimizer import get_megatron_optimizer  # by name, as in Megatron-LM
from megatron.training.arguments import parse_args
from megatron.training.global_vars import get_args, set_args

TRACKER = "latest_checkpointed_iteration.txt"


def training_log(loss, grad_norm, iteration, train_iters):
    """One line per iteration, on the first rank (Megatron prints from the last; either works)."""
    if torch.distributed.get_rank() == 0:
        print(f" iteration {iteration:8d}/{train_iters:8d} | lm loss: {float(loss).hex()} | "
              f"grad norm: {float(grad_norm).hex()} |", flush=True)


def _node_and_local_rank():
    """(node, local rank): torchrun's GROUP_RANK, or Slurm's SLURM_NODEID under srun."""
    node = int(os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", "0")))
    return node, int(os.environ.get("LOCAL_RANK", "0"))


def _inner_optimizers(opt):
    return list(getattr(opt, "chained_optimizers", [opt]))


def _gpt_model(model):
    from megatron_mlp.testing.gpt import gpt_model
    return gpt_model(model)


def _sharded_state_dict(model, opt, loading):
    meta = {"distrib_optim_sharding_type": "dp_reshardable"}
    model_sd = _gpt_model(model).sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=loading, metadata=meta)}


def _save(args, model, opt, iteration):
    from megatron.core import dist_checkpointing

    path = os.path.join(args.save, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(_sharded_state_dict(model, opt, False), path)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        tmp = os.path.join(args.save, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(args.save, TRACKER))
        print(f"successfully saved checkpoint from iteration {iteration:7d} to {args.save}", flush=True)
    torch.distributed.barrier()


def _load(args, model, opt):
    from megatron.core import dist_checkpointing

    tracker = os.path.join(args.load, TRACKER)
    if not os.path.isfile(tracker):
        return 0
    with open(tracker) as f:
        iteration = int(f.read().strip())
    loaded = dist_checkpointing.load(_sharded_state_dict(model, opt, True),
                                     os.path.join(args.load, f"iter_{iteration:07d}"))
    _gpt_model(model).load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    if torch.distributed.get_rank() == 0:
        print(f"successfully loaded checkpoint from {args.load} at iteration {iteration}", flush=True)
    return iteration


def full_optimizer_state(model, opt):
    """{param name: {param, exp_avg, exp_avg_sq}} of the whole model on rank 0 (None elsewhere),
    assembled from every data-parallel rank's shard: comparable across data-parallel sizes."""
    names = {p: n for n, p in model[0].named_parameters()}
    mine = []
    for dopt in _inner_optimizers(opt):
        for gbuf_range_maps in dopt.gbuf_ranges:
            for ranges in gbuf_range_maps.values():
                for bucket_map in ranges:
                    for param, info in bucket_map["param_map"].items():
                        t = dopt._get_main_param_and_optimizer_states(param)
                        mine.append((names[param], param.numel(), info["param"].start,
                                     {k: t[k].detach().float().cpu().clone()
                                      for k in ("param", "exp_avg", "exp_avg_sq")}))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    if torch.distributed.get_rank() != 0:
        return None
    full = {}
    for pieces in gathered:
        for name, numel, start, tensors in pieces:
            entry = full.setdefault(name, {k: torch.full((numel,), float("nan")) for k in tensors})
            for k, v in tensors.items():
                entry[k][start:start + v.numel()] = v
    return full


def _die_mid_update(opt):
    """SIGKILL this process after two subgroups of the next update: some updated, some not."""
    for dopt in _inner_optimizers(opt):
        offload = dopt.optimizer.offload
        original = offload.step

        def dying_step(grads, params_out=None, *, on_subgroup_done=None, _orig=original, **kw):
            done = []

            def on_done(a, b):
                done.append((a, b))
                if on_subgroup_done is not None:
                    on_subgroup_done(a, b)
                if len(done) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
            return _orig(grads, params_out, on_subgroup_done=on_done, **kw)

        offload.step = dying_step


def _token_witness(args):
    """Which ranks a tier token blocks: each node's first rank in turn holds the last tier's token
    while every other rank, one at a time, tries to take it. Returns {holder node: {rank: got it}}."""
    from megatron_mlp.megatron.arguments import config_from_args
    from megatron_mlp.optim.tier_stores import default_token_factory

    config = config_from_args(args)
    token = default_token_factory(config)(config.tiers[-1])
    node, local = _node_and_local_rank()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    where = [None] * world
    torch.distributed.all_gather_object(where, (node, local))
    out = {}
    for holder_node in sorted({n for n, _ in where}):
        holder = where.index((holder_node, 0))
        if rank == holder:
            assert token.acquire(timeout=60), "the witness could not take its own node's token"
        torch.distributed.barrier()
        tried = {}
        for other in range(world):
            if other != holder:
                if rank == other:
                    got = token.try_acquire()
                    if got:
                        token.release()
                    tried[other] = got
                torch.distributed.barrier()
        if rank == holder:
            token.release()
        torch.distributed.barrier()
        out[holder_node] = tried
    return {"where": where, "tried": out}


def _tier_listing(args):
    from megatron_mlp.tier.spec import parse_tier_paths

    if not getattr(args, "mlp_offload", False):
        return {}
    return {s.path: sorted(os.listdir(s.path)) for s in parse_tier_paths(args.mlp_offload_paths)}


def pretrain():
    args = parse_args()
    set_args(args)
    torch.distributed.init_process_group(args.distributed_backend, timeout=datetime.timedelta(seconds=120))
    from megatron_mlp.testing import gpt, install_cpu_harness

    install_cpu_harness()
    torch.set_num_threads(1)
    spec = gpt.TinyGPT(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                       num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                       micro_batch_size=args.micro_batch_size, bf16=args.bf16, seed=args.seed)
    gpt.init_model_parallel(tp=args.tensor_model_parallel_size, seed=args.seed)
    model = gpt.build_model(spec)
    opt = get_megatron_optimizer(gpt.optimizer_config(spec, lr=args.lr), model)
    term = []
    if args.exit_signal_handler:
        signal.signal(signal.SIGTERM, lambda *a: term.append(1))
    start = _load(args, model, opt) if args.load else 0
    result = {"rank": torch.distributed.get_rank(), "node_and_local_rank": _node_and_local_rank(),
              "start": start, "losses": {}, "grad_norms": {},
              "stale_scratch_removed": [os.path.basename(d) for dopt in _inner_optimizers(opt)
                                        if hasattr(dopt.optimizer, "offload")
                                        for d in dopt.optimizer.offload.stale_scratch["removed"]]}
    if args.standin_result_dir and args.load and start:
        state = full_optimizer_state(model, opt)
        if state is not None:
            torch.save(state, os.path.join(args.standin_result_dir, f"state-loaded-{start}.pt"))
    grad_norms = []
    step = opt.step

    def recording_step():
        ok, grad_norm, zeros = step()
        grad_norms.append(grad_norm)
        return ok, grad_norm, zeros

    opt.step = recording_step
    for it in range(start, args.train_iters):
        if args.standin_kill_local_rank == _node_and_local_rank()[1] and args.standin_kill_iteration == it + 1:
            _die_mid_update(opt)
        args.curr_iteration = it   # as Megatron-LM's loop: set before the step, one behind the logged iteration
        loss = gpt.train_step(spec, model, opt, it)
        training_log(loss, grad_norms[-1], it + 1, args.train_iters)
        result["losses"][it + 1] = float(loss).hex()
        result["grad_norms"][it + 1] = float(grad_norms[-1]).hex()
        stop = torch.tensor([len(term)], dtype=torch.int64)
        torch.distributed.all_reduce(stop)
        if args.save and ((args.save_interval and (it + 1) % args.save_interval == 0) or stop.item()):
            _save(args, model, opt, it + 1)
            if args.standin_result_dir:
                state = full_optimizer_state(model, opt)
                if state is not None:
                    torch.save(state, os.path.join(args.standin_result_dir, f"state-saved-{it + 1}.pt"))
        if stop.item() or (args.exit_interval and (it + 1) % args.exit_interval == 0):
            break
    if args.standin_token_witness:
        result["witness"] = _token_witness(args)
    torch.distributed.barrier()
    result["tiers"] = _tier_listing(args)  # every rank's scratch exists until the ranks exit
    from megatron.training.global_vars import get_tensorboard_writer

    writer = get_tensorboard_writer()
    if writer is not None:
        writer.close()   # as Megatron-LM at exit: the event file is complete on disk
    torch.distributed.barrier()
    if args.standin_result_dir:
        with open(os.path.join(args.standin_result_dir, f"rank{result['rank']}.json"), "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
