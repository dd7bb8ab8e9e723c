"""Megatron-LM's argument entry points, with the few flags the stand-in trains with.

``add_megatron_arguments`` is looked up as a module global by ``parse_args`` (as in Megatron-LM),
so the launcher's wrapper adds the ``--mlp-offload*`` flags to the same parser.
"""
import argparse


def add_megatron_arguments(parser):
    g = parser.add_argument_group("stand-in Megatron-LM")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--optimizer", default="adam")
    g.add_argument("--distributed-backend", default="gloo")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--vocab-size", type=int, default=256)
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--wandb-project", default=None)
    # The stand-in's own switches (tests): where each rank writes what it saw, a rank that dies.
    g.add_argument("--standin-result-dir", default=None)
    g.add_argument("--standin-kill-local-rank", type=int, default=None,
                   help="the rank with this LOCAL_RANK SIGKILLs itself in the middle of an update "
                        "(give it to one node's agent only: that node loses a rank)")
    g.add_argument("--standin-kill-iteration", type=int, default=None)
    g.add_argument("--standin-token-witness", action="store_true",
                   help="after training, show which ranks a tier token blocks")
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="stand-in Megatron-LM", allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
        return args
    return parser.parse_args()
