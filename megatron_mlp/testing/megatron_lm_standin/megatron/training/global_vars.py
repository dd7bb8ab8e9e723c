"""``get_args`` / ``get_timers`` / ``get_tensorboard_writer`` / ``get_wandb_writer`` as Megatron-LM's
global_vars has them: the TensorBoard writer exists with ``--tensorboard-dir``, on the last rank only."""
_ARGS = None
_TENSORBOARD = None


class Timers:
    """Megatron's Timers as the hooks see them: a ``_timers`` dict and ``log``."""

    def __init__(self):
        self._timers = {}

    def log(self, names, normalizer=1.0, reset=True, barrier=False):
        pass


_TIMERS = Timers()


def set_args(args):
    global _ARGS
    _ARGS = args


def get_args():
    return _ARGS


def get_timers():
    return _TIMERS


def get_tensorboard_writer():
    """Megatron-LM's writer: a ``torch.utils.tensorboard.SummaryWriter`` on the last rank."""
    global _TENSORBOARD
    if _TENSORBOARD is None and getattr(_ARGS, "tensorboard_dir", None):
        import torch.distributed as dist

        if dist.get_rank() == dist.get_world_size() - 1:
            from torch.utils.tensorboard import SummaryWriter

            _TENSORBOARD = SummaryWriter(log_dir=_ARGS.tensorboard_dir, max_queue=1000)
    return _TENSORBOARD


def get_wandb_writer():
    return None   # --wandb-project is accepted but the stand-in logs nowhere (no network in tests)
