"""How long a rank waits for a busy tier token, and what it does then.

A token is a throughput policy (one rank at a time gets a device's full bandwidth), never a
health signal: a holder that is slow, stopped (SIGSTOP, a debugger) or swapped out says nothing
about the tier. So a busy token never fails a request: the waiter logs its progress and, past a
bound longer than the I/O timeout, goes on without the token (the device then serves two ranks
at once for a while: slower, never wrong). The I/O timeout keeps its one meaning: a request the
device itself did not finish.
"""
from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("megatron_mlp.tier.tokens")

# The longest wait for a busy token, in I/O timeouts (--mlp-offload-io-timeout).
TOKEN_WAIT_TIMEOUTS = 2.0
# Progress is logged this often while the wait lasts (at most; sooner for short timeouts).
PROGRESS_EVERY_S = 60.0


def token_wait_bound_s(io_timeout_s: float | None) -> float | None:
    """The longest a request waits for its tier's token before going on without it (None: no bound)."""
    return None if io_timeout_s is None else TOKEN_WAIT_TIMEOUTS * float(io_timeout_s)


def acquire_or_go_on(token, bound_s: float | None, what: str) -> bool:
    """Wait for ``token`` (FIFO, one ticket for the whole wait) at most ``bound_s`` seconds, logging
    progress meanwhile. True when it is held; False when the bound passed: the caller goes on
    without it (and must not release it)."""
    progress_s = PROGRESS_EVERY_S if bound_s is None else max(0.5, min(PROGRESS_EVERY_S, bound_s / 4))
    t0 = time.monotonic()
    done = threading.Event()

    def report():
        while not done.wait(progress_s):
            logger.warning("%s: waiting %.0f s so far for the node-level token another process holds%s", what,
                           time.monotonic() - t0, "" if bound_s is None else
                           f"; going on without it after {bound_s:.0f} s")

    reporter = threading.Thread(target=report, name="mlp-token-wait-log", daemon=True)
    reporter.start()
    try:
        held = token.acquire(timeout=bound_s)
    finally:
        done.set()
    if not held:
        logger.warning("%s: the node-level token was still held by another process after %.0f s (2x "
                       "--mlp-offload-io-timeout); going on without it: a token only shares bandwidth, the tier "
                       "is not failed", what, time.monotonic() - t0)
    return held
