"""`python benchmarks/faults.py`: the fault campaign -- inject, detect, recover, and prove nothing was lost.

For each fault kind, N faults are injected at random steps of an M-step run of OffloadAdam over
two tiers (a disk directory and tmpfs), and the final optimizer state is compared bit for bit with
a fault-free reference run fed the same gradients, measured in the same invocation. A
"checkpoint" is the optimizer's own ``state_dict`` saved every ``--checkpoint-every`` steps
(write to a temp file, fsync, rename) -- the Megatron checkpoint's optimizer part, without the model.

Kinds and how each is injected (the engine's own fault hook unless said otherwise):
  eio          one read or write fails with EIO                       -> retried once on the same tier
  enospc       every write to one tier fails with ENOSPC              -> its subgroups fail over
  short_write  a write transfers only part of its bytes               -> the engine re-queues the rest
  corrupt      bytes of a subgroup's good slot flipped on storage     -> crc32c mismatch (IntegrityError)
  tier_vanish  one tier's scratch directory deleted (rm -rf)          -> failover through the open file
  timeout      a write never completes (test double of a hung device) -> ETIMEDOUT, failover
  sigkill      the training process killed with SIGKILL mid-run       -> restart from the last checkpoint
Recovery when the optimizer stops (IntegrityError, a fetch error, TierFailure): a TierFailure with
the state complete is saved as an emergency checkpoint and training resumes from it; anything else
resumes from the last periodic checkpoint and replays the steps since (gradients are a function of
the step, as in a data-parallel job restarted from a checkpoint).

``--layout moe`` runs every kind on a mixture-of-experts rank's layout: two optimizers (the dense
and the expert shard, ``megatron_mlp.testing.expert_shards``) with their own scratch on the same two
tiers and the host budget split between them, a fault landing on either; a checkpoint holds both.

Per kind it prints: injected, detected, recovered, lost (subgroups whose final state differs from
the reference; must be 0) and bit_equal. It also reports the cost of the crc32c checks: the
reference run's median step time with checksums on and off, measured in the same run.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

PIECE_BLOCK_BYTES = 64 << 10   # with --host-memory: pieces of 64 KiB per array (16k params)
KINDS = ("eio", "enospc", "short_write", "corrupt", "tier_vanish", "timeout", "sigkill")
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/faults.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run (M)")
    p.add_argument("--faults-per-kind", type=int, default=2, help="faults injected per kind (N)")
    p.add_argument("--num-params", type=int, default=2_000_000, help="parameters of the shard")
    p.add_argument("--subgroup-params", type=int, default=200_000, help="parameters per subgroup")
    p.add_argument("--checkpoint-every", type=int, default=3, help="steps between checkpoints")
    p.add_argument("--kinds", type=str, default=",".join(KINDS), help="comma-separated subset of: " + ", ".join(KINDS))
    p.add_argument("--dir", type=str, default="/var/tmp", help="where the disk tier and checkpoints go")
    p.add_argument("--shm", type=str, default="/dev/shm", help="the second (tmpfs) tier's parent; '' = disk only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-memory", type=str, default=None,
                   help="run under this host budget per optimizer (--mlp-offload-host-memory), with I/O blocks "
                        "of 64 KiB so that subgroups stream through the pool in pieces; default: a host cache "
                        "of one subgroup and whole working buffers")
    p.add_argument("--layout", choices=("dense", "moe"), default="dense",
                   help="one optimizer per rank (dense), or a dense and an expert optimizer on the same tiers (moe)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    p.add_argument("--child", type=str, default=None, help=argparse.SUPPRESS)
    return p


# ---------------------------------------------------------------------------- one training run

def _grads(step: int, numel: int):
    import torch
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + step)).to(torch.bfloat16)


def _init(numel: int):
    import torch
    return torch.randn(numel, generator=torch.Generator().manual_seed(7))


def _groups():
    return [{"lr": 1e-3, "weight_decay": 0.01}, {"lr": 5e-4, "weight_decay": 0.0, "betas": (0.9, 0.95)}]


def _ranges(numel: int):
    half = numel // 2
    return [(0, half), (half, numel)]


def _config(paths, spec, **overrides):
    from megatron_mlp.config import MLPOffloadConfig
    kw = dict(subgroup_params=spec["subgroup_params"], use_tokens=False, calibration="off",
              io_timeout_s=spec.get("io_timeout_s", 300.0), job_id=spec.get("job_id", "faultbench"))
    if spec.get("host_memory_bytes"):
        # The pool in pieces: the budget bounds everything; small I/O blocks make small pieces.
        kw.update(host_memory_bytes=spec["host_memory_bytes"], block_bytes=PIECE_BLOCK_BYTES)
    else:
        kw.update(host_cache_bytes=spec.get("host_cache_bytes", 0), prefetch_depth=spec.get("prefetch_depth", 2),
                  flush_depth=spec.get("flush_depth", 2))
    kw.update(overrides)
    return MLPOffloadConfig.from_paths(";".join(paths), **kw)


def _optimizer(paths, spec, engines=None, **overrides):
    from megatron_mlp.optim.offload_adam import OffloadAdam
    numel = spec["num_params"]
    if spec.get("layout") == "moe":
        from megatron_mlp.testing.expert_shards import ExpertShards
        dense = numel // 2   # the dense shard's and the expert shard's groups, each its own optimizer
        shards = [([(0, dense)], _groups()[:1]), ([(0, numel - dense)], _groups()[1:])]
        return ExpertShards(_config(paths, spec, **overrides), shards, _init(numel), engine_factory=engines)
    return OffloadAdam(_config(paths, spec, **overrides), _ranges(numel), _groups(), _init(numel),
                       engine_factory=engines)


def _members(opt) -> list:
    """The OffloadAdam instances behind ``opt`` (one, or the shards of the moe layout)."""
    return getattr(opt, "members", [opt])


def _save(opt, path: str) -> None:
    """Atomic checkpoint: temp file, fsync, rename, fsync the directory."""
    import torch
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(opt.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _load(opt, path: str) -> int:
    import torch
    sd = torch.load(path, weights_only=False)
    opt.load_state_dict(sd)
    return int(sd["steps"][0])


def _final_state(opt):
    return opt.read_range(0, opt.numel)


def _lost_subgroups(state, ref, plan) -> int:
    import torch
    lost = 0
    for sg in plan:
        if not all(torch.equal(state[k][sg.start:sg.end], ref[k][sg.start:sg.end]) for k in ref):
            lost += 1
    return lost


def reference_run(paths, spec, checksum: bool):
    opt = _optimizer(paths, spec, checksum=checksum)
    times, crc = [], []
    with opt:
        for s in range(spec["steps"]):
            t0 = time.perf_counter()
            opt.step(_grads(s, spec["num_params"]))
            times.append(time.perf_counter() - t0)
            crc.append(sum(t["checksum_s"] for m in _members(opt) for t in m.last_step_stats["tiers"]))
        return _final_state(opt), times, statistics.median(crc), opt.plan


# ---------------------------------------------------------------------------- in-process campaigns

class _Campaign:
    def __init__(self, kind, paths, spec, rng, work):
        self.kind, self.paths, self.spec, self.rng, self.work = kind, paths, spec, rng, work
        self.injected = self.detected = self.recovered = 0
        self.notes: list[str] = []
        self.recovered_by: dict[str, int] = {}
        self.ckpt = os.path.join(work, f"ckpt-{kind}.pt")

    def _fresh(self):
        from megatron_mlp.testing.fault_engine import FaultyEngines
        # Only the hang campaign uses a short I/O timeout: elsewhere a loaded disk must not look hung.
        spec = dict(self.spec, io_timeout_s=2.0) if self.kind == "timeout" else self.spec
        cfg = _config(self.paths, spec)
        self.engines = FaultyEngines(cfg, hanging=self.kind == "timeout")
        return _optimizer(self.paths, spec, self.engines)

    def _counters(self, opt):
        retries = sum(t.get("io_retries", 0) for m in _members(opt) for t in (m.last_step_stats or {}).get("tiers", []))
        failed = sum(len(m.failover.failed_tiers) for m in _members(opt))
        engine_retries = sum(e.stats()["retries"] for e in self.engines.engines if not e.closed)
        return retries, failed, engine_retries

    def _inject(self, opt) -> None:
        kind, rng = self.kind, self.rng
        members = _members(opt)
        if len(members) > 1:
            # The moe layout: a shard and a healthy tier the next step moves bytes on (one holding a
            # subgroup that host memory, the cache or the working buffers, does not hold).
            def moving(m):
                held = set(m.residency.buffers)
                return [s for s in m.stores if not s.failed and
                        any(t == s.index and i not in held for i, t in enumerate(m.tier_of))]
            opt = rng.choice([m for m in members if moving(m)] or members)
            healthy = moving(opt) or [s for s in opt.stores if not s.failed]
        else:
            healthy = [s for s in opt.stores if not s.failed]
        store = rng.choice(healthy)
        eng = store.engine   # this shard's engine of the tier (the moe layout has one per shard and path)
        if kind == "eio":
            eng.inject_fault(nth=rng.randint(1, 2), err=errno.EIO, op=rng.choice(["read", "write"]))
        elif kind == "enospc":
            eng.inject_fault(nth=1, err=errno.ENOSPC, op="write", every=True)
        elif kind == "short_write":
            eng.inject_fault(nth=1, short=True, op="write")
        elif kind == "corrupt":
            # A subgroup the next step reads from storage: not in host memory (the cache or the
            # working buffers).
            held = set(opt.residency.buffers)
            cands = [(i, s) for s in healthy for i, t in enumerate(opt.tier_of) if t == s.index and i not in held]
            if not cands:
                from megatron_mlp.errors import ConfigError
                raise ConfigError(f"--num-params: {opt.numel} params fit in host memory (cache and working buffers), "
                                  f"so nothing is read back to find a corruption in; use more params")
            index, store = rng.choice(cands)
            sg = opt.plan[index]
            rec = store.records[sg.index]
            fd = os.open(store.file_path, os.O_RDWR)
            try:
                pos = rec.offsets[rec.current] + rng.randrange(sg.numel * 4)
                b = os.pread(fd, 1, pos)
                os.pwrite(fd, bytes([b[0] ^ 0x5A]), pos)
                os.fsync(fd)
            finally:
                os.close(fd)
        elif kind == "tier_vanish":
            shutil.rmtree(store.scratch_dir)
        elif kind == "timeout":
            eng.hang_next("write")
        self.injected += 1

    def run(self):
        from megatron_mlp.errors import IntegrityError, TierFailure, TierIOError
        M, numel = self.spec["steps"], self.spec["num_params"]
        fault_steps = set(self.rng.sample(range(1, M), min(self.spec["faults"], M - 1)))
        opt = self._fresh()
        _save(opt, self.ckpt)
        s = 0
        try:
            while s < M:
                if s in fault_steps:
                    fault_steps.discard(s)
                    self._inject(opt)
                    before = self._counters(opt)
                else:
                    before = None
                try:
                    opt.step(_grads(s, numel))
                except (TierFailure, TierIOError, IntegrityError) as e:
                    self.detected += 1
                    s = self._recover(opt, e)
                    opt = self._opt
                    self.recovered += 1
                    continue
                if before is not None:
                    after = self._counters(opt)
                    if after != before:           # a retry, an engine re-queue or a failover: seen and handled
                        self.detected += 1
                        self.recovered += 1
                        how = ("failover" if after[1] > before[1] else "retry" if after[0] > before[0]
                               else "engine re-queue")
                        self.recovered_by[how] = self.recovered_by.get(how, 0) + 1
                    else:
                        self.notes.append(f"fault before step {s} had no visible effect")
                s += 1
                if s % self.spec["checkpoint_every"] == 0:
                    _save(opt, self.ckpt)
            return _final_state(opt), opt.plan
        finally:
            opt.close()

    def _recover(self, opt, exc):
        from megatron_mlp.errors import TierFailure
        emergency = isinstance(exc, TierFailure) and exc.state_complete
        how = "emergency checkpoint" if emergency else "last checkpoint"
        self.recovered_by[how] = self.recovered_by.get(how, 0) + 1
        if emergency:
            # The state is complete in memory / on the surviving tiers: save it (an emergency checkpoint).
            _save(opt, self.ckpt)
            self.notes.append(f"emergency checkpoint after: {type(exc).__name__}")
        else:
            self.notes.append(f"resume from the last checkpoint after: {type(exc).__name__}")
        opt.close()
        self._opt = self._fresh()        # the operator restarts on healthy tiers
        return _load(self._opt, self.ckpt)


# ---------------------------------------------------------------------------- SIGKILL + resume (processes)

def _child_main(spec_json: str) -> int:
    """Train from the checkpoint (if any) to ``steps``, checkpointing; report progress on stdout."""
    spec = json.loads(spec_json)
    opt = _optimizer(spec["paths"], spec)
    with opt:
        s = _load(opt, spec["ckpt"]) if os.path.exists(spec["ckpt"]) else 0
        if s == 0:
            _save(opt, spec["ckpt"])
        print(json.dumps({"stale_removed": len(opt.stale_scratch["removed"]), "start": s}), flush=True)
        while s < spec["steps"]:
            print(json.dumps({"step": s}), flush=True)
            opt.step(_grads(s, spec["num_params"]))
            s += 1
            if s % spec["checkpoint_every"] == 0:
                _save(opt, spec["ckpt"])
        import torch
        torch.save(_final_state(opt), spec["final"])
    print(json.dumps({"done": True}), flush=True)
    return 0


def sigkill_campaign(paths, spec, rng, work):
    import torch
    spec = dict(spec, paths=paths, ckpt=os.path.join(work, "ckpt-sigkill.pt"), final=os.path.join(work, "final.pt"))
    env = {**os.environ, "PYTHONPATH": _PKG_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    kill_steps = sorted(rng.sample(range(1, spec["steps"]), min(spec["faults"], spec["steps"] - 1)))
    out = {"injected": 0, "detected": 0, "recovered": 0, "recovered_by": {}, "notes": []}
    pending_kill = False
    for kill_at in kill_steps + [None]:
        err_path = os.path.join(work, "sigkill-child.err")
        err_file = open(err_path, "w")
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True, env=env)
        try:
            hello = json.loads(p.stdout.readline())
            if pending_kill:
                out["recovered"] += 1               # restarted from the last checkpoint
                out["recovered_by"]["last checkpoint"] = out["recovered_by"].get("last checkpoint", 0) + 1
                if hello["stale_removed"] > 0:
                    out["detected"] += 1            # ... and found the killed run's scratch (provably stale)
            pending_kill = False
            for line in p.stdout:
                msg = json.loads(line)
                if kill_at is not None and msg.get("step") == kill_at:
                    time.sleep(rng.uniform(0.0, 0.05))   # somewhere inside the update
                    p.send_signal(signal.SIGKILL)
                    break
            rc = p.wait(timeout=600)
        finally:
            p.stdout.close()
            err_file.close()
        if kill_at is None:
            if rc != 0:
                with open(err_path) as f:
                    tail = f.read()[-2000:].strip()
                raise RuntimeError(f"the resumed run failed with exit code {rc}: {tail or '(no output)'}")
        elif rc == -signal.SIGKILL:
            out["injected"] += 1
            pending_kill = True
        else:
            out["notes"].append(f"the run finished before the kill at step {kill_at} landed")
    final = torch.load(spec["final"], weights_only=False)
    out["notes"].append(f"killed before/inside steps {kill_steps}; each restart resumed from the last checkpoint")
    return out, final


# ---------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child is not None:
        return _child_main(args.child)
    from megatron_mlp.errors import ConfigError
    from megatron_mlp.units import parse_size
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for k in kinds:
        if k not in KINDS:
            raise ConfigError(f"--kinds: unknown kind {k!r} (choose from {', '.join(KINDS)})")
    for flag, v in (("--steps", args.steps), ("--faults-per-kind", args.faults_per_kind),
                    ("--num-params", args.num_params), ("--subgroup-params", args.subgroup_params),
                    ("--checkpoint-every", args.checkpoint_every)):
        if v <= 0:
            raise ConfigError(f"{flag}: {v} must be positive")
    if args.steps < 2:
        raise ConfigError(f"--steps: {args.steps} leaves no step to inject a fault before (need >= 2)")
    shards = 2 if args.layout == "moe" else 1
    if args.num_params < 2 * shards * args.subgroup_params:
        raise ConfigError(f"--num-params: {args.num_params} must hold at least two subgroups of --subgroup-params "
                          f"{args.subgroup_params} (one per tier) per optimizer ({shards} with --layout {args.layout})")
    import logging

    import torch
    # Failover warnings are expected here; the level is restored when the campaign ends, so that
    # a caller (a test, a notebook) keeps seeing the package's warnings afterwards.
    package_logger = logging.getLogger("megatron_mlp")
    previous_level = package_logger.level
    package_logger.setLevel(logging.ERROR)
    work = tempfile.mkdtemp(prefix="mlp-faultbench-", dir=args.dir)
    rng = random.Random(args.seed)
    host_memory = parse_size(args.host_memory, "--host-memory") if args.host_memory else 0
    spec = {"layout": args.layout, "host_memory_bytes": host_memory, "steps": args.steps, "faults": args.faults_per_kind, "num_params": args.num_params,
            "subgroup_params": args.subgroup_params, "checkpoint_every": args.checkpoint_every,
            "io_timeout_s": 120.0, "host_cache_bytes": 12 * args.subgroup_params + 3 * 4096,
            # A small working set, so that host memory (cache plus working buffers) cannot hold every
            # subgroup and each step reads some back: that is where corruption must be caught.
            "prefetch_depth": 1, "flush_depth": 1}
    created_shm: list[str] = []
    try:
        def tiers(name):
            a = os.path.join(work, name, "disk")
            os.makedirs(a)
            if args.shm and os.path.isdir(args.shm):
                b = tempfile.mkdtemp(prefix=f"mlp-faultbench-{name}-", dir=args.shm)
                created_shm.append(b)
            else:
                b = os.path.join(work, name, "disk2")
                os.makedirs(b)
            return [a, b]

        ref_paths = tiers("ref")
        # On and off interleaved, twice each, best median of each: other load on the machine
        # during one run must not pass for the checksum's cost.
        med_on = med_off = float("inf")
        for _ in range(2):
            ref_state, t_on, crc_s, plan = reference_run(ref_paths, spec, checksum=True)
            _, t_off, _, _ = reference_run(ref_paths, spec, checksum=False)
            med_on = min(med_on, statistics.median(t_on[1:] or t_on))
            med_off = min(med_off, statistics.median(t_off[1:] or t_off))
        results = {}
        for kind in kinds:
            paths = tiers(kind)
            t0 = time.perf_counter()
            try:
                results[kind] = _run_kind(kind, paths, spec, rng, work, ref_state, plan)
            except Exception as e:  # noqa: BLE001 -- one kind's failure must not hide the others' results
                # Not a loss (nothing was compared) but a campaign that could not finish, e.g. a
                # device too slow for a bound on a busy machine: say which kind and why.
                results[kind] = {"injected": 0, "detected": 0, "recovered": 0, "recovered_by": {}, "notes": [],
                                 "lost": None, "bit_equal": False, "error": f"{type(e).__name__}: {e}"}
            results[kind]["seconds"] = round(time.perf_counter() - t0, 2)
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
        report = {
            "benchmark": "faults", "layout": args.layout, "host_memory_bytes": host_memory or None, "steps": args.steps, "faults_per_kind": args.faults_per_kind,
            "num_params": args.num_params, "subgroup_params": args.subgroup_params, "num_subgroups": len(plan),
            "checkpoint_every": args.checkpoint_every, "tiers": ["disk", "tmpfs" if args.shm else "disk"],
            "torch": torch.__version__, "seed": args.seed,
            "checksum": {"step_s_on": med_on, "step_s_off": med_off, "ratio_on_off": med_on / med_off,
                         "crc_s_per_step": crc_s,
                         "crc_share_of_step": crc_s / med_on},
            "kinds": results,
            "all_bit_equal": all(r["bit_equal"] for r in results.values()),
            "total_lost": sum(r["lost"] or 0 for r in results.values()),
            "failed_kinds": {k: r["error"] for k, r in results.items() if "error" in r},
        }
    finally:
        package_logger.setLevel(previous_level)
        shutil.rmtree(work, ignore_errors=True)
        for d in created_shm:
            shutil.rmtree(d, ignore_errors=True)
    if args.json:
        print(json.dumps(report))
    else:
        _print(report)
    return 0 if report["total_lost"] == 0 and not report["failed_kinds"] else 1


def _run_kind(kind, paths, spec, rng, work, ref_state, plan) -> dict:
    """One fault kind's campaign and its comparison with the fault-free reference."""
    if kind == "sigkill":
        counts, final = sigkill_campaign(paths, spec, rng, work)
    else:
        camp = _Campaign(kind, paths, spec, rng, work)
        final, _ = camp.run()
        counts = {"injected": camp.injected, "detected": camp.detected, "recovered": camp.recovered,
                  "recovered_by": camp.recovered_by, "notes": camp.notes}
    lost = _lost_subgroups(final, ref_state, plan)
    out = {**counts, "lost": lost, "bit_equal": lost == 0}
    if lost:   # a recovery that does not reproduce the reference recovered nothing
        out["recovered"] = 0
    return out


def _print(r: dict) -> None:
    budget = f", host memory {r['host_memory_bytes']} bytes (pool in pieces)" if r["host_memory_bytes"] else ""
    print(f"bench faults ({r['layout']} layout{budget}): {r['steps']} steps, {r['num_params']} params in {r['num_subgroups']} subgroups over "
          f"two tiers ({' + '.join(r['tiers'])}), {r['faults_per_kind']} faults per kind, checkpoint every "
          f"{r['checkpoint_every']} steps, torch {r['torch']}")
    print(f"{'kind':<12} {'injected':>8} {'detected':>8} {'recovered':>9} {'lost':>5} {'bit-equal':>9} {'s':>6}  how")
    for kind, k in r["kinds"].items():
        how = ", ".join(f"{n} x{c}" for n, c in k.get("recovered_by", {}).items())
        if "error" in k:
            how = f"did not finish: {k['error']}"
        lost = "-" if k["lost"] is None else k["lost"]
        print(f"{kind:<12} {k['injected']:>8} {k['detected']:>8} {k['recovered']:>9} {lost:>5} "
              f"{str(k['bit_equal']):>9} {k['seconds']:>6}  {how}")
    c = r["checksum"]
    print(f"crc32c cost (fault-free reference, best of 2 median steps): on {c['step_s_on'] * 1e3:.1f} ms, "
          f"off {c['step_s_off'] * 1e3:.1f} ms, ratio {c['ratio_on_off']:.3f}; checksum threads "
          f"{c['crc_s_per_step'] * 1e3:.1f} ms per step ({100 * c['crc_share_of_step']:.1f}% of the step, "
          f"mostly overlapped with I/O)")
    print(f"all bit-equal to the fault-free run: {r['all_bit_equal']}; lost subgroups: {r['total_lost']}")
    for kind, why in r["failed_kinds"].items():
        print(f"the {kind} campaign did not finish (nothing of it was compared): {why}")


if __name__ == "__main__":
    sys.exit(main())
