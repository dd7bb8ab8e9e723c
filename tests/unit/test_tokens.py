"""Node-level tier tokens: mutual exclusion, crash safety, non-blocking try, FIFO fairness, tier order."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import signal
import stat
import threading
import time

import pytest

from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.tokens import TierToken, TokenOrderError, acquire_in_order, ensure_private_dir

CTX = mp.get_context("fork")  # workers import nothing heavy; fork keeps the tests fast


@pytest.fixture
def rundir(tmp_path):
    d = tmp_path / "run"
    return str(d)


def _append(log_path: str, line: str) -> None:
    # One write() with O_APPEND per record: records from different processes never interleave.
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _hammer(rundir, log_path, keys, slots, rounds, seed):
    rng = random.Random(seed)
    tokens = {k: TierToken(key=k, slots=slots, runtime_dir=rundir) for k in keys}
    for n in range(rounds):
        key = rng.choice(keys)
        tok = tokens[key]
        if rng.random() < 0.3:
            if not tok.try_acquire():
                continue
        else:
            assert tok.acquire(timeout=30)
        _append(log_path, f"E {key} {os.getpid()} {n}")
        time.sleep(rng.uniform(0, 0.002))
        _append(log_path, f"X {key} {os.getpid()} {n}")
        tok.release()


def _max_concurrency(log_path):
    inside: dict[str, set] = {}
    worst: dict[str, int] = {}
    for line in open(log_path).read().splitlines():
        kind, key, pid, n = line.split()
        holders = inside.setdefault(key, set())
        if kind == "E":
            holders.add((pid, n))
            worst[key] = max(worst.get(key, 0), len(holders))
        else:
            holders.remove((pid, n))
    return worst


def _run_procs(target, args_list, timeout=60):
    procs = [CTX.Process(target=target, args=a) for a in args_list]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    assert not alive, "workers hung (deadlock?)"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


@pytest.mark.parametrize("nprocs", [4, 8])
def test_never_two_holders_on_one_tier_when_processes_hammer_two_tiers(rundir, tmp_path, nprocs):
    log = str(tmp_path / "witness.log")
    _run_procs(_hammer, [(rundir, log, ["tierA", "tierB"], 1, 25, s) for s in range(nprocs)])
    worst = _max_concurrency(log)
    assert worst == {"tierA": 1, "tierB": 1}


def test_at_most_k_holders_and_k_reached_when_tier_has_k_slots(rundir, tmp_path):
    log = str(tmp_path / "witness.log")
    _run_procs(_hammer, [(rundir, log, ["tierA"], 2, 30, s) for s in range(5)])
    assert _max_concurrency(log)["tierA"] <= 2


def _hold_forever(rundir, key, ready):
    tok = TierToken(key=key, runtime_dir=rundir)
    assert tok.acquire(timeout=10)
    ready.set()
    time.sleep(600)


@contextlib.contextmanager
def _held_by_another_process(rundir, key):
    """Yields a process that holds token ``key`` (until it is killed, at the latest on exit)."""
    ready = CTX.Event()
    p = CTX.Process(target=_hold_forever, args=(rundir, key, ready))
    p.start()
    try:
        assert ready.wait(10)
        yield p
    finally:
        p.kill()
        p.join()


def test_sigkill_of_holder_frees_token_within_a_second(rundir):
    with _held_by_another_process(rundir, "nvme") as holder:
        tok = TierToken(key="nvme", runtime_dir=rundir)
        assert not tok.try_acquire()
        os.kill(holder.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert tok.acquire(timeout=1.0), "token not freed within a second of SIGKILL"
        assert time.monotonic() - t0 < 1.0
        tok.release()


def _hold_then_fork_a_worker(rundir, key, ready, child_pid):
    tok = TierToken(key=key, runtime_dir=rundir)
    assert tok.acquire(timeout=10)
    pid = os.fork()  # e.g. a data-loader worker forked while the token is held
    if pid == 0:
        code = 0 if not tok.held else 3  # the child does not hold the parent's token
        time.sleep(30)
        os._exit(code)
    child_pid.value = pid
    ready.set()
    time.sleep(600)


def test_sigkill_frees_token_when_holder_forked_a_child_that_lives_on(rundir):
    ready, child_pid = CTX.Event(), CTX.Value("i", 0)
    p = CTX.Process(target=_hold_then_fork_a_worker, args=(rundir, "nvme", ready, child_pid))
    p.start()
    try:
        assert ready.wait(10)
        tok = TierToken(key="nvme", runtime_dir=rundir)
        assert not tok.try_acquire()
        os.kill(p.pid, signal.SIGKILL)
        assert tok.acquire(timeout=1.0), "the forked child kept the dead parent's token"
        tok.release()
    finally:
        p.kill()
        p.join()
        if child_pid.value:
            try:
                os.kill(child_pid.value, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_try_acquire_returns_false_without_waiting_when_token_is_held(rundir):
    with _held_by_another_process(rundir, "nvme"):
        tok = TierToken(key="nvme", runtime_dir=rundir)
        # The holder keeps it for minutes: any call that waited would take far longer than this bound.
        for _ in range(50):
            t0 = time.monotonic()
            assert tok.try_acquire() is False
            assert time.monotonic() - t0 < 0.5
        t0 = time.monotonic()
        assert tok.acquire(timeout=0.2) is False
        assert 0.15 <= time.monotonic() - t0 < 2.0


def test_try_acquire_yields_to_queued_waiters_when_slot_is_free(rundir):
    # A live queue entry ahead (a waiter): try_acquire must not barge past it.
    holder = TierToken(key="t", runtime_dir=rundir)
    assert holder.try_acquire()
    waiter = TierToken(key="t", runtime_dir=rundir)
    got = []
    th = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=10)))
    th.start()
    deadline = time.monotonic() + 5
    while not any(n.startswith("q-") for n in os.listdir(waiter.dir)) and time.monotonic() < deadline:
        time.sleep(0.001)
    holder.release()
    barger = TierToken(key="t", runtime_dir=rundir)
    barged = barger.try_acquire()
    th.join(10)
    assert got == [True]
    assert not barged or not waiter.held
    waiter.release()
    if barged:
        barger.release()


def _cycle(rundir, log_path, key, rounds, hold_s, start):
    tok = TierToken(key=key, runtime_dir=rundir)
    start.wait(10)
    for n in range(rounds):
        assert tok.acquire(timeout=60)
        _append(log_path, f"G {os.getpid()} {tok.last_ticket if tok.last_ticket is not None else -1}")
        time.sleep(hold_s)
        tok.release()


def test_waiters_served_in_ticket_order_when_processes_cycle(rundir, tmp_path):
    log = str(tmp_path / "grants.log")
    start = CTX.Event()
    procs = [CTX.Process(target=_cycle, args=(rundir, log, "fifo", 15, 0.002, start)) for _ in range(5)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    grants = [line.split() for line in open(log).read().splitlines()]
    assert len(grants) == 75
    tickets = [int(t) for _, _, t in grants if int(t) >= 0]
    assert len(tickets) > 30, "the test should exercise the queue, not only the fast path"
    assert tickets == sorted(tickets), "a queued waiter was overtaken by a later ticket"


def _one_acquire(rundir, log_path, key, start):
    tok = TierToken(key=key, runtime_dir=rundir)
    start.wait(10)
    time.sleep(0.05)  # let the cyclers saturate the tier first
    _append(log_path, f"R {os.getpid()} -1")
    assert tok.acquire(timeout=60)
    _append(log_path, f"V {os.getpid()} {tok.last_ticket}")
    tok.release()


def test_waiter_not_starved_when_other_processes_cycle_continuously(rundir, tmp_path):
    log = str(tmp_path / "grants.log")
    start = CTX.Event()
    ncyclers = 4
    procs = [CTX.Process(target=_cycle, args=(rundir, log, "fair", 40, 0.002, start)) for _ in range(ncyclers)]
    victim = CTX.Process(target=_one_acquire, args=(rundir, log, "fair", start))
    for p in procs + [victim]:
        p.start()
    start.set()
    for p in procs + [victim]:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs + [victim])
    lines = [line.split() for line in open(log).read().splitlines()]
    kinds = [k for k, _, _ in lines]
    r, v = kinds.index("R"), kinds.index("V")
    overtakes = sum(1 for k in kinds[r:v] if k == "G")
    # FIFO: at most one grant per other process queued ahead, plus one fast-path barger each.
    assert overtakes <= 2 * ncyclers, f"victim waited through {overtakes} grants"
    assert kinds[v + 1:].count("G") > 0, "cyclers were still cycling when the victim got the token"


def test_blocking_acquire_out_of_order_raises_when_thread_holds_a_larger_key(rundir):
    a = TierToken(key="0-1", runtime_dir=rundir)
    b = TierToken(key="0-2", runtime_dir=rundir)
    assert b.acquire(timeout=5)
    with pytest.raises(TokenOrderError, match="ascending"):
        a.acquire(timeout=5)
    assert a.try_acquire()  # try_acquire never blocks, so any order is allowed
    a.release()
    b.release()
    assert a.acquire(timeout=5) and b.acquire(timeout=5)  # ascending order is fine
    b.release()
    a.release()


def test_reacquiring_the_same_tier_raises_when_thread_already_holds_it(rundir):
    a = TierToken(key="0-1", runtime_dir=rundir)
    other = TierToken(key="0-1", runtime_dir=rundir)
    assert a.acquire(timeout=5)
    with pytest.raises(TokenOrderError):
        other.acquire(timeout=5)
    a.release()


def _two_tiers(rundir, log_path, rounds, seed):
    rng = random.Random(seed)
    toks = [TierToken(key="0-1", runtime_dir=rundir), TierToken(key="0-2", runtime_dir=rundir)]
    for n in range(rounds):
        wanted = toks[:] if rng.random() < 0.5 else toks[::-1]  # callers ask in either order
        assert acquire_in_order(wanted, timeout=30)
        _append(log_path, f"E both {os.getpid()} {n}")
        time.sleep(0.001)
        _append(log_path, f"X both {os.getpid()} {n}")
        for t in wanted:
            t.release()
        # and mix in the opportunistic pattern: hold one, try the other
        first, second = rng.sample(toks, 2)
        assert first.acquire(timeout=30)
        if second.try_acquire():
            second.release()
        first.release()


def test_no_deadlock_when_processes_take_two_tiers_in_different_orders(rundir, tmp_path):
    log = str(tmp_path / "witness.log")
    _run_procs(_two_tiers, [(rundir, log, 20, s) for s in range(4)], timeout=60)
    assert _max_concurrency(log) == {"both": 1}


def test_acquire_in_order_releases_all_when_one_times_out(rundir):
    a = TierToken(key="0-1", runtime_dir=rundir)
    b = TierToken(key="0-2", runtime_dir=rundir)
    blocker = TierToken(key="0-2", runtime_dir=rundir)
    ready, done = threading.Event(), threading.Event()

    def hold():
        assert blocker.acquire(timeout=5)
        ready.set()
        done.wait(10)
        blocker.release()

    th = threading.Thread(target=hold)
    th.start()
    ready.wait(5)
    assert acquire_in_order([b, a], timeout=0.1) is False
    assert not a.held and not b.held
    done.set()
    th.join()


def test_threads_sharing_one_token_object_take_turns(rundir):
    tok = TierToken(key="t", runtime_dir=rundir)
    inside, worst, lock = [0], [0], threading.Lock()

    def work():
        for _ in range(20):
            assert tok.acquire(timeout=10)
            with lock:
                inside[0] += 1
                worst[0] = max(worst[0], inside[0])
            time.sleep(0.0005)
            with lock:
                inside[0] -= 1
            tok.release()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert worst[0] == 1


def test_two_objects_in_one_process_exclude_each_other_when_same_tier(rundir):
    a = TierToken(key="t", runtime_dir=rundir)
    b = TierToken(key="t", runtime_dir=rundir)
    assert a.try_acquire()
    assert not b.try_acquire()
    a.release()
    assert b.try_acquire()
    b.release()


def test_stale_files_are_harmless_when_left_by_dead_processes(rundir):
    tok = TierToken(key="t", runtime_dir=rundir)
    for name in ("q-3", "q-17", "t-999-junk", "slot-0", "slot-5", "seq"):
        with open(os.path.join(tok.dir, name), "w") as f:
            f.write("stale")
    assert tok.try_acquire()  # dead queue entries are recognized (nobody holds their lock)
    tok.release()
    assert tok.acquire(timeout=1)
    tok.release()
    assert not any(n in os.listdir(tok.dir) for n in ("q-3", "q-17"))


def test_release_without_acquire_raises(rundir):
    with pytest.raises(RuntimeError, match="not held"):
        TierToken(key="t", runtime_dir=rundir).release()


def test_token_key_is_the_device_of_the_path_when_given_a_path(rundir, tmp_path):
    sub = tmp_path / "a" / "b"
    t1 = TierToken(str(tmp_path), runtime_dir=rundir)
    t2 = TierToken(str(sub), runtime_dir=rundir)  # need not exist; same device
    assert t1.key == t2.key and t1.dir == t2.dir


def test_runtime_dir_created_private_when_missing(tmp_path):
    d = str(tmp_path / "rt")
    TierToken(key="t", runtime_dir=d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    tok_dir = os.path.join(d, "tier-t")
    assert stat.S_IMODE(os.stat(tok_dir).st_mode) == 0o700
    tok = TierToken(key="t", runtime_dir=d)
    assert tok.try_acquire()
    assert stat.S_IMODE(os.stat(os.path.join(tok_dir, "slot-0")).st_mode) & 0o077 == 0
    tok.release()


def test_runtime_dir_refused_when_it_is_a_symlink(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="--mlp-offload-runtime-dir.*link"):
        ensure_private_dir(str(link))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create a directory owned by another user")
def test_runtime_dir_refused_when_owned_by_another_user(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        ensure_private_dir(str(d))


def test_zero_slots_rejected_with_flag():
    with pytest.raises(ConfigError, match="--mlp-offload-tokens-per-tier"):
        TierToken(key="t", slots=0, runtime_dir="/tmp/unused-never-created")


def test_paths_on_one_device_share_one_token_when_used_by_different_jobs(rundir, tmp_path):
    job_a = TierToken(str(tmp_path / "job-a" / "optimizer"), runtime_dir=rundir)
    job_b = TierToken(str(tmp_path / "job-b"), runtime_dir=rundir)
    assert job_a.try_acquire()
    assert not job_b.try_acquire()
    job_a.release()
    assert job_b.try_acquire()
    job_b.release()


def test_paths_on_different_devices_have_independent_tokens(rundir, disk_dir, shm_dir):
    disk = TierToken(disk_dir, runtime_dir=rundir)
    shm = TierToken(shm_dir, runtime_dir=rundir)
    assert disk.key != shm.key
    assert disk.try_acquire() and shm.try_acquire()
    disk.release()
    shm.release()
