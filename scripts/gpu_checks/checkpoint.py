"""checkpoint: MLP-Offload's checkpoint loads into stock and continues alike."""
from __future__ import annotations

import shutil
import tempfile

from gpu_checks.compare import PARITY_REL_TOL, rel_diffs
from gpu_checks.context import Context, record
from gpu_checks.harness import build, inner, parity_mlp, parity_spec, release, train


def check_checkpoint(ctx: Context) -> None:
    """Save with MLP-Offload (Megatron's dist checkpoint), load into stock: the same next losses."""
    import torch
    from megatron.core import dist_checkpointing

    from megatron_mlp.testing import gpt
    spec = parity_spec(ctx.gpu)
    ckpt = tempfile.mkdtemp(prefix="ckpt-", dir=ctx.work_dir)
    meta = {"distrib_optim_sharding_type": "dp_reshardable"}
    before, after = 3, 2

    model, opt = build(spec, parity_mlp(ctx, spec, "ckpt"))
    try:
        train(spec, model, opt, before)
        model_sd = gpt.gpt_model(model).sharded_state_dict()
        dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)},
                                ckpt)
        continued = train(spec, model, opt, after, first=before)
    finally:
        release(model, opt)
    model, opt = build(spec, None)
    try:
        # Stock without TE/Apex cannot load into an optimizer that has no state yet: one step
        # creates it; the load then overwrites params, Adam state and step.
        gpt.train_step(spec, model, opt, 0)
        model_sd = gpt.gpt_model(model).sharded_state_dict()
        loaded = dist_checkpointing.load(
            {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=meta)}, ckpt)
        gpt.gpt_model(model).load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        # Stock without TE/Apex (torch AdamW keeps a 'step' per param) does not resume its step
        # from a dp_reshardable checkpoint: after the load every param shares one 'step' tensor
        # holding the pre-load count, which torch's multi-tensor AdamW then advances once per param
        # each step. TE's and Apex's Adam take the step from the param groups; so does this oracle,
        # one tensor per param as a fresh torch AdamW has, so that the comparison is of the state.
        steps = {g.get("step") for g in loaded["optimizer"]["optimizer"]["param_groups"]}
        assert len(steps) == 1, steps
        step = float(steps.pop())
        for state in inner(opt).optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)
        resumed = train(spec, model, opt, after, first=before)
    finally:
        release(model, opt)
        shutil.rmtree(ckpt, ignore_errors=True)
    rel = max(r for r in rel_diffs(resumed.losses, continued.losses))
    ok = rel <= PARITY_REL_TOL if ctx.gpu else resumed.losses == continued.losses
    record(ctx, "checkpoint", ok=ok, saved_after=before, format="dp_reshardable",
           stock_step_restored_by_the_check=step, losses_mlp_continued=continued.losses,
           losses_stock_resumed=resumed.losses, max_rel_diff_loss=rel,
           bitwise_losses=resumed.losses == continued.losses)
