"""The update in flight: the part of a step that runs behind the caller, and what waits for it.

With ``--mlp-offload-overlap-io`` (``config.overlap_io``) a step returns once every subgroup is
updated and its params handed out; its last write-backs are still on their way to the tiers. A
worker thread (``UpdateInFlight``) completes them and, as each one ends, starts the reads the next
step needs first (``Prefetch``): those of the subgroups it updates first that are not in host
memory, in its order, into buffers of the same pool (``--mlp-offload-host-memory`` stays a hard
bound: a prefetched buffer or piece is a pool buffer). A subgroup whose own write-back is still in
flight is read only once that write-back has switched its record, so a read never sees an older
slot; reads never depend on the gradient, so the next step is bitwise the serial one.

``OffloadAdam.step(..., wait=False)`` goes one step further: the kernels too run on the worker,
``step`` returns once the inputs are checked, and the params are handed out subgroup by subgroup
with an event each (``ParamHandOff``): ``wait_for_params(start, end)`` returns as soon as the
subgroups covering that range are updated, before the step's last subgroup is.

Who waits: everything that reads or writes params or state -- ``read_range``, ``write_range``,
``state_dict``, ``load_state_dict``, ``close``, the next ``step`` -- waits for the update in flight
first (``OffloadAdam.wait_for_update``). A write-back that failed in the background is handled
there exactly as after a serial step (retry, failover to a healthy tier or host memory; a
streamed one is recomputed from its old slot with the same gradient, which is why the gradient
buffer belongs to the update until that call): ``wait_for_update`` and the next ``step`` raise
the ``TierFailure`` when no tier can take the state, the reads keep working on the state held in
host memory. A prefetch is dropped (its buffers given back) by any call but the next step.
"""
from __future__ import annotations

import errno
import threading
from concurrent.futures import wait as wait_futures

from megatron_mlp.optim.piece_stream import PieceStream
from megatron_mlp.optim.step_pipeline import Fetch


class Prefetch:
    """The next step's first reads, started behind the caller within the pool.

    Args:
        opt: the ``OffloadAdam`` (plan, residency, tiers, pieces, host memory, trace).
        order, keep: the next step's order and the subgroups it will keep in host memory
            (``Residency.keep_for``); the step adopts this prefetch only if both still hold.

    With the pool in pieces the subgroups the next step streams are read piece by piece by its
    own ``PieceStream``, pumped early; otherwise the first ``prefetch_depth + 1`` subgroups to
    fetch are read into whole buffers, as the step's own fetch window would.
    """

    def __init__(self, opt, order, keep):
        self.order, self.keep = list(order), set(keep)
        self.residency, self.tiers, self.plan, self.pieces = opt.residency, opt.tiers, opt.plan, opt.pieces
        to_fetch = [i for i in order if i not in opt.residency]
        self.fetches: dict[int, Fetch] = {}
        self.stream: PieceStream | None = None
        self.whole: list[int] = []
        memory = opt.host_memory
        if memory.streams:
            streamed = [opt.plan[i] for i in to_fetch if i not in self.keep]
            self.stream = PieceStream(opt.residency.pool, memory, opt.tiers, streamed, opt.trace)
        else:
            self.whole = to_fetch[:memory.prefetch_depth + 1]

    def matches(self, order, keep) -> bool:
        return self.order == list(order) and self.keep == set(keep)

    def pump(self, pending=frozenset()) -> None:
        """Start the reads the pool allows, none of a subgroup in ``pending`` (its write-back is
        still in flight: the record it would read is about to switch)."""
        if self.stream is not None:
            self.stream.pump(blocked=pending)
            return
        for idx in self.whole:
            if idx in self.fetches or idx in pending:
                continue
            buf = self.residency.acquire()
            if buf is None:
                return
            fut, landed = self.tiers.of(idx).fetch_streamed(self.plan[idx], buf, self.pieces[idx])
            self.fetches[idx] = Fetch(fut, buf, landed)

    def drop(self) -> None:
        """Wait for the reads in flight and give their buffers back (a timed-out one is abandoned)."""
        if self.stream is not None:
            self.stream.drain()
        for fetch in self.fetches.values():
            wait_futures([fetch.future])
            error = fetch.future.exception()
            if getattr(error, "errno", None) == errno.ETIMEDOUT:
                self.residency.abandon(fetch.buffer)
            else:
                self.residency.release(fetch.buffer)
        self.fetches.clear()


class ParamHandOff:
    """One event per subgroup of ``plan``, set once its ``params_out`` slice is final.

    ``done(start, end)`` is the pipeline's ``on_subgroup_done``; ``wait(start, end)`` returns True
    once every subgroup overlapping ``[start, end)`` is done, False when the update ended
    without them (it failed: the caller asks the optimizer for the error). ``order`` lists the
    subgroups in the order their params became final.
    """

    def __init__(self, plan, on_done=None):
        self.plan, self.on_done = plan, on_done
        self.events = {sg.index: threading.Event() for sg in plan}
        self.ready: set[int] = set()
        self.order: list[int] = []
        self._ended = threading.Event()
        self._lock = threading.Lock()

    def done(self, start: int, end: int) -> None:
        if self.on_done is not None:
            self.on_done(start, end)
        for sg in self.plan.overlapping(start, end):
            with self._lock:
                self.ready.add(sg.index)
                self.order.append(sg.index)
            self.events[sg.index].set()

    def wait(self, start: int, end: int) -> bool:
        for sg in self.plan.overlapping(start, end):
            while not self.events[sg.index].wait(0.1):
                if self._ended.is_set():
                    break
        return all(sg.index in self.ready for sg in self.plan.overlapping(start, end))

    def end(self) -> None:
        """The update is over (done or failed): wake every waiter."""
        self._ended.set()
        for event in self.events.values():
            event.set()


class UpdateInFlight:
    """A step's work left to a worker thread: with ``commit`` the compute loop and the commit
    too (``step(wait=False)``), else only the tail (its write-backs), then the next step's
    prefetch when ``prefetch_for`` gives one.

    Args:
        pipeline: the step's ``StepPipeline``.
        stats: the step's ``StepStats`` (the write-backs keep adding to it until ``join``).
        commit: run on the worker after the compute loop (moves the step counters), or None
            when the caller already ran the loop.
        prefetch_for: ``() -> Prefetch | None``, called once the step is committed.
        hand_off: the step's ``ParamHandOff`` (ended when the worker stops), or None.
    """

    def __init__(self, pipeline, stats, *, commit=None, prefetch_for=None, hand_off=None):
        self.pipeline, self.stats, self.hand_off = pipeline, stats, hand_off
        self._commit, self._prefetch_for = commit, prefetch_for
        self.computed = commit is None   # whether every subgroup was updated (the step is committed)
        self.prefetch: Prefetch | None = None
        self.failed: list = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlp-update-in-flight", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if not self.computed:
                self.pipeline.run(defer=True)
                self._commit()
                self.computed = True
            if self._prefetch_for is not None:
                self.prefetch = self._prefetch_for()
            self.failed = self.pipeline.finish(self.prefetch)
        except BaseException as e:  # noqa: BLE001 -- raised by the call that waits (OffloadAdam._settle)
            self.error = e
        finally:
            if self.hand_off is not None:
                self.hand_off.end()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()


class InFlight:
    """What one optimizer has running behind its caller: the ``UpdateInFlight`` of its last step
    and the next step's ``Prefetch`` that work left. The optimizer asks it before anything that
    reads or writes params or state (``settle``)."""

    def __init__(self):
        self.flight: UpdateInFlight | None = None
        self.prefetch: Prefetch | None = None

    def start(self, pipeline, stats, **kwargs) -> None:
        self.flight = UpdateInFlight(pipeline, stats, **kwargs)

    @property
    def busy(self) -> bool:
        return self.flight is not None and not self.flight.done()

    @property
    def updating(self) -> bool:
        """Whether the kernels of a step (``wait=False``) are still running behind the caller."""
        flight = self.flight
        return flight is not None and not flight.computed and not flight.done()

    def take_prefetch(self, order, keep) -> Prefetch | None:
        """The prefetch for a step over ``order`` keeping ``keep``; one made for another is dropped."""
        pre, self.prefetch = self.prefetch, None
        if pre is not None and not pre.matches(order, keep):
            pre.drop()
            return None
        return pre

    def settle(self, keep_prefetch: bool) -> UpdateInFlight | None:
        """Wait for the update in flight; returns it (its ``error`` and ``failed`` write-backs for
        the caller to handle) or None. The prefetch is kept only with ``keep_prefetch`` and when
        that work went well (a failover moves subgroups)."""
        flight, self.flight = self.flight, None
        if flight is not None:
            flight.join()
            self.prefetch = flight.prefetch
        bad = flight is not None and (flight.error is not None or flight.failed)
        if self.prefetch is not None and (bad or not keep_prefetch):
            pre, self.prefetch = self.prefetch, None
            pre.drop()
        return flight

    def params_ready(self, start: int, end: int) -> bool:
        """Wait until ``[start, end)`` of the step in flight is handed out; False when that step
        ended without it (it failed). True at once when nothing hands params out."""
        flight = self.flight
        return flight is None or flight.hand_off is None or flight.hand_off.wait(int(start), int(end))
