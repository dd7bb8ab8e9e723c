"""Tiny Megatron-Core GPTs that make Megatron build several distributed optimizers (tests, smoke-runs).

A mixture-of-experts GPT with expert parallelism (a dense optimizer over the data-parallel group
and an expert optimizer over the expert-data-parallel group), virtual pipeline stages with
``overlap_param_gather_with_optimizer_step`` (the first model chunk gets its own optimizer), and
multi-token prediction layers. Everything is Megatron's own code path (GPTModel with the local
spec, DistributedDataParallel, get_megatron_optimizer -> ChainedOptimizer); only the sizes are
small. Workers return plain data for ``multiproc.run_distributed``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_mlp.testing.gpt import TinyGPT


@dataclass(frozen=True)
class TinyMoE(TinyGPT):
    """TinyGPT with experts, model-parallel layout and multi-token prediction."""

    hidden_size: int = 32
    num_moe_experts: int = 4         # 0: dense MLPs
    moe_router_topk: int = 2
    ffn_hidden_size: int = 64
    expert_parallel: int = 2         # --expert-model-parallel-size
    pipeline_parallel: int = 1
    virtual_stages: int = 1          # model chunks per pipeline rank (--num-virtual-stages-per-pipeline-rank)
    overlap_param_gather_with_optimizer_step: bool = False
    mtp_num_layers: int = 0          # --mtp-num-layers
    clip_grad: float = 0.3           # below the tiny models' grad norms: clipping is active


def patch_moe_without_te() -> None:
    """Megatron-Core 0.16's router gating reads ``moe_utils.te_general_gemm``, a name bound only
    when Transformer Engine imports: without TE every MoE forward raises NameError. Bind it to None
    (Megatron's own ``torch.mm`` fallback then runs), as an import without TE would have meant."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def init_parallel(spec: TinyMoE) -> None:
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=spec.pipeline_parallel,
        virtual_pipeline_model_parallel_size=spec.virtual_stages if spec.virtual_stages > 1 else None,
        expert_model_parallel_size=spec.expert_parallel)
    torch.manual_seed(spec.seed)


def transformer_config(spec: TinyMoE):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, use_cpu_initialization=True,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=spec.pipeline_parallel,
        pipeline_dtype=torch.bfloat16 if spec.bf16 else torch.float32,
        bf16=spec.bf16, fp16=spec.fp16, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size())
    if spec.virtual_stages > 1:
        kwargs["virtual_pipeline_model_parallel_size"] = spec.virtual_stages
    if spec.num_moe_experts:
        kwargs.update(num_moe_experts=spec.num_moe_experts, moe_router_topk=spec.moe_router_topk,
                      moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="allgather",
                      add_bias_linear=False)   # 0.13 refuses biases with MoE
    if spec.mtp_num_layers:
        kwargs.update(mtp_num_layers=spec.mtp_num_layers, mtp_loss_scaling_factor=0.1)
    return TransformerConfig(**kwargs)


def build_model(spec: TinyMoE, tconf=None):
    """One DDP-wrapped GPTModel per virtual stage of this rank (the list get_megatron_optimizer takes)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.module import Float16Module

    tconf = tconf or transformer_config(spec)
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_moe_experts or None)
    chunks = []
    torch.manual_seed(spec.seed)
    for vp in range(spec.virtual_stages):
        vp_stage = vp if spec.virtual_stages > 1 else None
        if vp_stage is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(vp)
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        extra = {}
        if spec.mtp_num_layers:
            extra["mtp_block_spec"] = get_gpt_mtp_block_spec(tconf, layer_spec, use_transformer_engine=False,
                                                             vp_stage=vp_stage)
        model = GPTModel(config=tconf, transformer_layer_spec=layer_spec, vocab_size=spec.vocab_size,
                         max_sequence_length=spec.seq_length, pre_process=first, post_process=last,
                         vp_stage=vp_stage, **extra)
        if spec.bf16 or spec.fp16:
            model = Float16Module(tconf, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=False, use_distributed_optimizer=True,
            overlap_grad_reduce=spec.overlap_param_gather_with_optimizer_step,
            overlap_param_gather=spec.overlap_param_gather_with_optimizer_step,
            bucket_size=4096 if spec.overlap_param_gather_with_optimizer_step else None)
        chunks.append(DistributedDataParallel(tconf, ddp_config, model,
                                              disable_bucketing=vp > 0 and spec.overlap_param_gather_with_optimizer_step))
    if spec.virtual_stages > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks


def build(spec: TinyMoE, mlp_config=None, inner_factory=None):
    """Parallel state + model chunks + Megatron's optimizer (ours when ``mlp_config`` is given)."""
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_mlp.megatron.factory import mlp_offload_optimizers
    from megatron_mlp.testing import gpt, install_cpu_harness

    install_cpu_harness()
    patch_moe_without_te()
    init_parallel(spec)
    model = build_model(spec)
    config = gpt.optimizer_config(spec, clip_grad=spec.clip_grad,
                                  overlap_param_gather_with_optimizer_step=spec.overlap_param_gather_with_optimizer_step)
    with mlp_offload_optimizers(mlp_config, inner_factory):
        opt = get_megatron_optimizer(config, model)
    return model, opt


def train_step(spec: TinyMoE, model, optimizer, iteration: int):
    """One step through Megatron's forward-backward schedule (one micro-batch per model chunk and
    pipeline stage). Returns (DP-averaged loss on the last stage or None, Megatron's grad norm)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from megatron_mlp.testing import gpt

    tokens, labels, loss_mask, position_ids = gpt.batch(spec, iteration, parallel_state.get_data_parallel_rank())
    config = get_model_config(model[0])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if spec.overlap_param_gather_with_optimizer_step:
        config.param_sync_func = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = config.param_sync_func[0] if len(model) == 1 else config.param_sync_func
        config.no_sync_func = [chunk.no_sync for chunk in model]
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model]

    def loss_func(output):
        loss = (output.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, chunk):
        kwargs = {"loss_mask": loss_mask} if spec.mtp_num_layers else {}
        return chunk(tokens, position_ids, None, labels=labels, **kwargs), loss_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    num_microbatches = spec.virtual_stages * spec.pipeline_parallel if spec.virtual_stages > 1 else 1
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[None] * len(model) if len(model) > 1 else None,
        model=model, num_microbatches=num_microbatches, seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    assert ok, "a bf16 step is never skipped"
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None, float(grad_norm)
    loss = torch.stack([o["loss"] for o in outputs]).mean()
    torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return float(loss) / parallel_state.get_data_parallel_world_size(), float(grad_norm)


def params_by_name(model) -> dict[str, torch.Tensor]:
    return {f"chunk{i}.{n}": p.detach().clone() for i, chunk in enumerate(model) for n, p in chunk.named_parameters()}


def optimizer_layout(opt) -> list[dict]:
    """What Megatron built: per distributed optimizer, its class, shard size and data-parallel size,
    and the params of its shard kept on the device (--mlp-offload-device-memory)."""
    out = []
    for dopt in getattr(opt, "chained_optimizers", [opt]):
        share = getattr(dopt.optimizer, "device_share", None)
        out.append({"type": type(dopt).__name__, "dp_size": dopt.data_parallel_group.size(),
                    "shard_numel": sum(p.numel() for g in dopt.optimizer.param_groups for p in g["params"]),
                    "device_share_numel": share.numel if share is not None else 0})
    return out


def train(rank, world_size, spec, mlp_config, iters, inner_factory=None):
    """Train ``iters`` steps; returns (losses, grad norms, params by name, optimizer layout)."""
    model, opt = build(spec, mlp_config, inner_factory)
    losses, norms = [], []
    for i in range(iters):
        loss, norm = train_step(spec, model, opt, i)
        losses.append(loss)
        norms.append(norm)
    return losses, norms, params_by_name(model), optimizer_layout(opt)


def checkpoint_run(rank, world_size, spec, mlp_config, iters_before, iters_after, ckpt_dir, mode,
                   sharding_type="dp_reshardable"):
    """mode 'save': train iters_before, save (torch_dist), train iters_after; 'load': build, load,
    train iters_after. Returns (losses and grad norms after the save point, params)."""
    from megatron_mlp.testing.runs import load_checkpoint, save_checkpoint

    model, opt = build(spec, mlp_config)
    meta = {"distrib_optim_sharding_type": sharding_type}
    modules = [_gpt_model(chunk) for chunk in model]

    def model_sd():
        if len(modules) == 1:
            return modules[0].sharded_state_dict()
        return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(modules)}

    if mode == "save":
        for i in range(iters_before):
            train_step(spec, model, opt, i)
        save_checkpoint(model_sd(), opt, meta, ckpt_dir, rank)
    else:
        loaded = load_checkpoint(model_sd(), opt, meta, ckpt_dir)
        if len(modules) == 1:
            modules[0].load_state_dict(loaded["model"])
        else:
            for i, m in enumerate(modules):
                m.load_state_dict(loaded["model"][f"model{i}"])
        opt.load_state_dict(loaded["optimizer"])
    after = [train_step(spec, model, opt, iters_before + i) for i in range(iters_after)]
    return [a[0] for a in after], [a[1] for a in after], params_by_name(model)


def _gpt_model(chunk):
    m = chunk.module
    while hasattr(m, "module"):
        m = m.module
    return m


def state_pieces_by_global_name(model, opt, spec: TinyMoE) -> dict:
    """This rank's pieces of the optimizer state: ``{name: [(first element, {"param", "exp_avg",
    "exp_avg_sq"})]}``, each local expert index made global (``local_experts.<i>`` of EP rank ``e``
    is expert ``e * experts_per_rank + i``), so that pieces from runs with other EP and DP sizes
    assemble into the same whole params."""
    import re

    from megatron.core import parallel_state

    from megatron_mlp.testing.runs import inner_optimizers
    per_rank = spec.num_moe_experts // spec.expert_parallel if spec.num_moe_experts else 0
    first = parallel_state.get_expert_model_parallel_rank() * per_rank
    names = {p: re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{first + int(m.group(1))}.", n)
             for n, p in model[0].named_parameters()}
    out: dict = {}
    for dopt in inner_optimizers(opt):
        for gbuf_range_maps in dopt.gbuf_ranges:
            for ranges in gbuf_range_maps.values():
                for bucket_map in ranges:
                    for model_param, where in bucket_map["param_map"].items():
                        t = dopt._get_main_param_and_optimizer_states(model_param)
                        out.setdefault(names[model_param], []).append(
                            (where["param"].start, {k: t[k].detach().float().cpu().clone()
                                                    for k in ("param", "exp_avg", "exp_avg_sq")}))
    return out


def reshard_run(rank, world_size, spec, mlp_config, iters, ckpt_dir, mode, sharding_type, iters_after=0):
    """mode 'save': train ``iters`` and save (torch_dist, ``sharding_type``, the chain's members
    without prefixes, as Megatron-LM saves them); 'load': build and load. Then train ``iters_after``.
    Returns (this rank's ``state_pieces_by_global_name`` at the save or after the load, the losses
    after it)."""
    from megatron_mlp.testing.runs import load_checkpoint, save_checkpoint

    model, opt = build(spec, mlp_config)
    meta = {"distrib_optim_sharding_type": sharding_type, "chained_optim_avoid_prefix": True}
    module = _gpt_model(model[0])
    if mode == "save":
        for i in range(iters):
            train_step(spec, model, opt, i)
        save_checkpoint(module.sharded_state_dict(), opt, meta, ckpt_dir, rank)
    else:
        loaded = load_checkpoint(module.sharded_state_dict(), opt, meta, ckpt_dir)
        module.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
    state = state_pieces_by_global_name(model, opt, spec)
    after = [train_step(spec, model, opt, iters + i)[0] for i in range(iters_after)]
    return state, after
