"""Worker processes for measurements that run several I/O streams at once (calibration, the
contention benchmark): started without an engine's threads, together, and reaped whatever happens.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time

# The signals that end a measurement: the parent turns them into exceptions and stops its workers.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def worker_mp_context(preload: list[str]):
    """Worker processes that never inherit an engine's threads: from a fork server (started once,
    with the imports preloaded, so each worker starts in milliseconds), else spawned."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(preload)
        return ctx
    return mp.get_context("spawn")


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _stop_signals_deferred():
    """SIGINT, SIGTERM and SIGHUP wait until the block ends, then act as they would have.

    A start cut in half leaves a child unpickling the queue and the barrier that the exiting parent
    has just removed, and that child prints a traceback; so every worker is started, or none, and
    the interruption then stops all that were. (A blocked signal mask would not do: any other
    thread of the process, numpy's for one, takes the signal, and the main thread raises at once.)
    """
    if not _main_thread():   # only the main thread runs Python signal handlers
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum)) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if pending:
            signal.raise_signal(pending[0])


def _ensure_fork_server(ctx) -> None:
    """Start the fork server, if ``ctx`` uses one, with SIGINT ignored: the server and every worker
    forked from it inherit that from birth (Python keeps an inherited SIG_IGN), so a Ctrl-C to the
    process group reaches none of them while they import or unpickle -- the parent, which gets it
    too, stops them. The parent's SIGINT is ignored only for the fork and exec of the server."""
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver
    if not _main_thread():
        forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


WORKER_NAME = b"mlp-worker"   # the workers' name in ps and /proc/<pid>/comm


def _owner_gone(owner: int) -> bool:
    """The process that started the run is gone (or a zombie: killed, not yet reaped)."""
    try:
        with open(f"/proc/{owner}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _die_with_owner(owner: int) -> None:
    """A worker ends when the process that started the run dies, however it dies: a ``calibrate``
    killed by SIGKILL must leave no worker running on (each holds its buffers, about 150 MB, and
    waits on a barrier no one will reach). Its parent may be the forkserver, which outlives the
    owner, so a daemon thread watches the owner itself (Linux /proc; elsewhere nothing)."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, WORKER_NAME)   # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass
    if not os.path.isdir("/proc/self"):
        return

    def watch():
        while not _owner_gone(owner):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="mlp-worker-owner-watch", daemon=True).start()


def _report(queue, fn, args, owner: int) -> None:
    _die_with_owner(owner)
    # The parent owns the run: a Ctrl-C that reaches the whole process group is the parent's to
    # act on (it terminates its workers), and its SIGTERM ends a worker silently.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    try:
        queue.put(("ok", fn(*args)))
    except BaseException as e:  # reported to the parent with its message
        queue.put(("error", f"{type(e).__name__}: {e}"))


def run_workers(ctx, fn, jobs: list[tuple], *, what: str, timeout: float = 600.0, on_error=None) -> list:
    """``fn(*job)`` for each job, each in its own process of ``ctx``; returns their results.

    ``fn`` must be a module-level function (it is pickled to the workers). Processes that have not
    exited shortly after the last report (or the deadline) are killed, so none outlives the call.
    ``on_error()`` runs at the first failure a worker reports: jobs that wait for each other (a
    barrier) are released by it at once instead of waiting out their bound for a peer that is gone.

    Raises:
        RuntimeError: a worker raised (its message), or not every worker reported within ``timeout``
            seconds ("a ``what`` process did not report in time").
    """
    queue = ctx.Queue()
    procs = []
    results, errors = [], []
    _ensure_fork_server(ctx)
    try:
        with _stop_signals_deferred():   # all started, or (an error) those started are stopped below
            for job in jobs:
                procs.append(ctx.Process(target=_report, args=(queue, fn, job, os.getpid())))
                procs[-1].start()
        deadline = time.monotonic() + timeout
        for _ in procs:
            try:
                kind, value = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:
                errors.append(f"a {what} process did not report in time")
                break
            (results if kind == "ok" else errors).append(value)
            if kind != "ok" and on_error is not None and len(errors) == 1:
                on_error()
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM turned into an exception): stop the workers now rather than
        # let them run on for the join below; the caller removes what they leave behind.
        for p in procs:
            if p.pid is not None:
                p.terminate()
        raise
    finally:
        for p in procs:
            if p.pid is None:
                continue   # its start failed: nothing to reap
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError(_summary(errors, len(jobs)))
    return results


def _summary(errors: list[str], num_jobs: int) -> str:
    """Each distinct message once, with how many processes gave it: one short line for many workers."""
    counts: dict[str, int] = {}
    for e in errors:
        counts[e] = counts.get(e, 0) + 1
    return "; ".join(e if n == 1 else f"{e} ({n} of {num_jobs} processes)" for e, n in counts.items())
