"""Worker processes for measurements that run several I/O streams at once (calibration, the
contention benchmark): started without an engine's threads, together, and reaped whatever happens.
"""
from __future__ import annotations

import multiprocessing as mp
import time


def worker_mp_context(preload: list[str]):
    """Worker processes that never inherit an engine's threads: from a fork server (started once,
    with the imports preloaded, so each worker starts in milliseconds), else spawned."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(preload)
        return ctx
    return mp.get_context("spawn")


def _report(queue, fn, args) -> None:
    try:
        queue.put(("ok", fn(*args)))
    except BaseException as e:  # reported to the parent with its message
        queue.put(("error", f"{type(e).__name__}: {e}"))


def run_workers(ctx, fn, jobs: list[tuple], *, what: str, timeout: float = 600.0) -> list:
    """``fn(*job)`` for each job, each in its own process of ``ctx``; returns their results.

    ``fn`` must be a module-level function (it is pickled to the workers). Processes that have not
    exited shortly after the last report (or the deadline) are killed, so none outlives the call.

    Raises:
        RuntimeError: a worker raised (its message), or not every worker reported within ``timeout``
            seconds ("a ``what`` process did not report in time").
    """
    queue = ctx.Queue()
    procs = [ctx.Process(target=_report, args=(queue, fn, job)) for job in jobs]
    for p in procs:
        p.start()
    results, errors = [], []
    deadline = time.monotonic() + timeout
    try:
        for _ in procs:
            try:
                kind, value = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:
                errors.append(f"a {what} process did not report in time")
                break
            (results if kind == "ok" else errors).append(value)
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM turned into an exception): stop the workers now rather than
        # let them run on for the join below; the caller removes what they leave behind.
        for p in procs:
            p.terminate()
        raise
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return results
