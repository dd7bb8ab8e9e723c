"""A tiny Megatron-Core GPT (local layer spec unless asked otherwise), its DDP wrapper and a training loop.

Used by the oracle tests, the demo and laptop smoke-runs. Everything here is Megatron's own
code path (GPTModel, Float16Module, DistributedDataParallel, get_megatron_optimizer); only the
sizes are small. Deterministic: the same seed gives the same weights and batches on every run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class TinyGPT:
    """Sizes of the model and the batches."""

    vocab_size: int = 256      # divisible by 128*TP so vocab padding does not depend on TP (<=2)
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    seq_length: int = 32
    micro_batch_size: int = 2
    bf16: bool = True
    fp16: bool = False
    seed: int = 1234
    # Megatron-LM's default (no --untie-embeddings-and-output-weights): under PP the last stage's
    # output layer is a copy of the first stage's embedding, their gradients summed after the
    # data-parallel reduction.
    tied_embeddings: bool = False
    # Transformer Engine layers ("transformer_engine", Megatron-LM's --transformer-impl) and their
    # FP8 GEMMs ("hybrid" or "e4m3", --fp8-format; needs "transformer_engine" and a GPU with FP8).
    transformer_impl: str = "local"
    fp8: Optional[str] = None
    fp8_param: bool = False     # FP8 params, gathered as FP8 (--fp8-param-gather)

    @property
    def num_params_estimate(self) -> int:
        h, v, layers = self.hidden_size, self.vocab_size, self.num_layers
        return v * h + self.seq_length * h + layers * (12 * h * h + 13 * h) + 2 * h


@dataclass(frozen=True)
class StepOutcome:
    """What one training step reports: the DP-averaged loss and Megatron's step result."""

    loss: float
    ok: bool            # False when the step was skipped (fp16 overflow)
    grad_norm: Optional[float]


def on_gpu() -> bool:
    """A real GPU run: CUDA is there and the CPU harness is not installed."""
    from megatron_mlp.testing.harness import cpu_harness_installed
    return torch.cuda.is_available() and not cpu_harness_installed()


def init_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1234) -> None:
    """Initialise Megatron's parallel state on an initialised torch.distributed (gloo or NCCL)."""
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    # Weights are initialised on the CPU (use_cpu_initialization) and dropout is off, so one CPU
    # seed makes runs repeatable. On a GPU, Megatron's attention forks the CUDA RNG tracker's
    # 'model-parallel-rng' state, which only model_parallel_cuda_manual_seed adds (under the CPU
    # harness the fork is a no-op and CUDA generators do not exist).
    torch.manual_seed(seed)
    if on_gpu():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(seed)


def build_model(spec: TinyGPT, *, grad_reduce_in_fp32: bool = False, bucket_size: int | None = None,
                overlap_grad_reduce: bool = False, overlap_param_gather: bool = False):
    """GPTModel (local spec, or Transformer Engine's with ``spec.transformer_impl``) in bf16/fp16 via
    Float16Module, wrapped in Megatron's DDP.

    Under pipeline parallelism this rank builds its own stage: the embedding on the first, the
    output layer and loss on the last, ``num_layers / PP`` transformer layers on each. On a GPU
    the model moves to the current device before DDP wraps it, as Megatron-LM's get_model does.
    Returns a one-element list of model chunks, as get_megatron_optimizer expects.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(spec.seed)
    tconf = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, use_cpu_initialization=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.bfloat16 if spec.bf16 else (torch.float16 if spec.fp16 else torch.float32),
        bf16=spec.bf16, fp16=spec.fp16, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        **({"fp8": spec.fp8, "fp8_param": spec.fp8_param} if spec.fp8 else {}),
    )
    layer_spec = (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
                  if spec.transformer_impl == "transformer_engine" else gpt_layer_specs.get_gpt_layer_local_spec())
    model = GPTModel(config=tconf, transformer_layer_spec=layer_spec,
                     vocab_size=spec.vocab_size, max_sequence_length=spec.seq_length,
                     share_embeddings_and_output_weights=spec.tied_embeddings,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    if on_gpu():
        model.cuda(torch.cuda.current_device())
    if spec.bf16 or spec.fp16:
        model = Float16Module(tconf, model)
    ddp_kwargs = dict(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap_grad_reduce,
                      overlap_param_gather=overlap_param_gather, use_distributed_optimizer=True)
    if spec.fp8_param:
        ddp_kwargs["fp8_param_gather"] = True   # the FP8 params all-gathered as FP8, as Megatron-LM does
    if bucket_size is not None:
        ddp_kwargs["bucket_size"] = bucket_size
    ddp = DistributedDataParallel(tconf, DistributedDataParallelConfig(**ddp_kwargs), model)
    return [ddp]


def optimizer_config(spec: TinyGPT, **overrides):
    """Megatron OptimizerConfig for the tiny model (Adam, distributed optimizer, clipping on)."""
    from megatron.core.optimizer import OptimizerConfig

    kwargs = dict(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.1, adam_beta1=0.9,
                  adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, bf16=spec.bf16, fp16=spec.fp16,
                  use_distributed_optimizer=True)
    kwargs.update(overrides)
    return OptimizerConfig(**kwargs)


def batch(spec: TinyGPT, iteration: int, dp_rank: int):
    """Deterministic synthetic batch (tokens, labels, loss_mask, position_ids) for one DP rank."""
    g = torch.Generator().manual_seed(spec.seed * 1000 + iteration * 16 + dp_rank)
    # A learnable pattern (next token = token + 1 mod a small period) so the loss falls.
    start = torch.randint(0, spec.vocab_size, (spec.micro_batch_size, 1), generator=g)
    steps = torch.arange(spec.seq_length + 1).unsqueeze(0)
    seq = (start + steps * 7) % spec.vocab_size
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    loss_mask = torch.ones_like(tokens, dtype=torch.float32)
    position_ids = torch.arange(spec.seq_length).unsqueeze(0).expand_as(tokens).contiguous()
    return tokens, labels, loss_mask, position_ids


def train_step(spec: TinyGPT, model, optimizer, iteration: int, scheduler=None) -> float:
    """One forward/backward/step on this rank's batch; returns the DP-averaged loss."""
    return train_step_outcome(spec, model, optimizer, iteration, scheduler).loss


def train_step_outcome(spec: TinyGPT, model, optimizer, iteration: int, scheduler=None, *,
                       after_backward: Optional[Callable] = None) -> StepOutcome:
    """``train_step``, reporting Megatron's step result too. ``after_backward(model)`` runs once
    the gradients are reduced and before the optimizer sees them (tests inject overflows there)."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    tokens, labels, loss_mask, position_ids = batch(spec, iteration, dp_rank)
    if on_gpu():
        tokens, labels, loss_mask, position_ids = (t.cuda() for t in (tokens, labels, loss_mask, position_ids))
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    out = model[0](tokens, position_ids, None, labels=labels)
    loss = (out.float() * loss_mask).sum() / loss_mask.sum()
    scale = optimizer.get_loss_scale() if hasattr(optimizer, "get_loss_scale") else None
    (loss * scale if scale is not None else loss).backward()
    for chunk in model:
        chunk.finish_grad_sync()
    if after_backward is not None:
        after_backward(model)
    ok, grad_norm, _ = optimizer.step()
    if scheduler is not None:
        scheduler.step(increment=1)
    reported = loss.detach().clone()
    torch.distributed.all_reduce(reported, group=parallel_state.get_data_parallel_group())
    return StepOutcome(loss=float(reported) / parallel_state.get_data_parallel_world_size(), ok=bool(ok),
                       grad_norm=None if grad_norm is None else float(grad_norm))


def pipeline_train_step(spec: TinyGPT, model, optimizer, iteration: int) -> float | None:
    """One step through Megatron's pipeline schedule (one micro-batch); the loss on the last stage.

    The schedule sends activations and gradients between the stages, and ``finalize_model_grads``
    reduces the data-parallel gradients and the embedding gradient shared by the first and last
    stages, as Megatron-LM's training loop does. Returns None on the other stages.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    tokens, labels, loss_mask, position_ids = batch(spec, iteration, parallel_state.get_data_parallel_rank())
    config = get_model_config(model[0])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    def loss_func(output):
        loss = (output.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, chunk):
        return chunk(tokens, position_ids, None, labels=labels), loss_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=None, model=model, num_microbatches=1,
        seq_length=spec.seq_length, micro_batch_size=spec.micro_batch_size, forward_only=False)
    optimizer.step()
    if not parallel_state.is_pipeline_last_stage():
        return None
    return float(outputs[0]["loss"])


def gpt_model(model):
    """The GPTModel inside a model chunk list (DDP -> Float16Module -> GPTModel): what
    ``sharded_state_dict`` and ``load_state_dict`` of a checkpoint work on."""
    m = model[0].module
    while hasattr(m, "module"):
        m = m.module
    return m


def model_params(model) -> dict[str, torch.Tensor]:
    """Copies of this rank's model params by name (for bitwise comparisons)."""
    return {n: p.detach().clone() for n, p in model[0].named_parameters()}
