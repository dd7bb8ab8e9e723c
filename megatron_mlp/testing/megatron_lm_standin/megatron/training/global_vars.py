"""``get_args`` / ``get_timers`` as Megatron-LM's global_vars has them."""
_ARGS = None


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
