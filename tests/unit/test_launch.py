"""The zero-edit launcher and its hooks, against a fake Megatron-LM checkout made in the test.

The fake checkout has the three names the hooks wrap (add_megatron_arguments, the by-name import
of get_megatron_optimizer in megatron.training.training, training_log), with the call pattern of
Megatron-LM core_r0.13..main; its pretrain_gpt.py reports what it saw as JSON. The optimizer
factory of megatron_mlp is replaced by a recorder inside the fake script, so this tests the
wiring, not the optimizer (tests/integration/test_pretrain_gpt_e2e.py runs the real thing).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_mlp.megatron import hooks

REPO = Path(__file__).resolve().parents[2]

FAKE_FILES = {
    "megatron/__init__.py": "",
    "megatron/training/__init__.py": "",
    "megatron/training/global_vars.py": """
        _ARGS = None
        class Timers:
            def __init__(self):
                self._timers = {}
                self.logged = []
            def log(self, names, normalizer=1.0, reset=True, barrier=False):
                self.logged.append((list(names), normalizer))
        _TIMERS = Timers()
        def set_args(a):
            global _ARGS
            _ARGS = a
        def get_args():
            return _ARGS
        def get_timers():
            return _TIMERS
    """,
    "megatron/training/arguments.py": """
        import argparse
        def add_megatron_arguments(parser):
            parser.add_argument('--use-distributed-optimizer', action='store_true')
            parser.add_argument('--optimizer', default='adam')
            parser.add_argument('--log-interval', type=int, default=1)
            return parser
        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            parser = argparse.ArgumentParser(allow_abbrev=False)
            parser = add_megatron_arguments(parser)   # looked up as a module global, as in Megatron
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return parser.parse_args()
    """,
    "megatron/core_optimizer.py": """
        def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
            return {'built_by': 'stock', 'config': config, 'chunks': model_chunks, 'args': list(args),
                    'kwargs': kwargs}
    """,
    "megatron/training/training.py": """
        from megatron.core_optimizer import get_megatron_optimizer   # by name, as in Megatron
        def training_log(loss_dict, iteration):
            return 'megatron-log'
        def setup_optimizer():
            return get_megatron_optimizer('cfg', ['chunk'], 'pos3', no_weight_decay_cond=None)
    """,
    "pretrain_gpt.py": """
        import json, os, sys, types
        # Stand-in for megatron_mlp.megatron.factory: records what the hook hands it.
        factory = types.ModuleType('megatron_mlp.megatron.factory')
        def wrap_get_megatron_optimizer(orig, config):
            def wrapped(*a, **k):
                out = orig(*a, **k)
                out['built_by'] = 'mlp-offload'
                out['tiers'] = [t.path for t in config.tiers]
                out['host_memory_bytes'] = config.host_memory_bytes
                return out
            return wrapped
        factory.wrap_get_megatron_optimizer = wrap_get_megatron_optimizer
        sys.modules['megatron_mlp.megatron.factory'] = factory
        import megatron
        from megatron.training import arguments, global_vars, training
        if __name__ == '__main__':
            args = arguments.parse_args()
            global_vars.set_args(args)
            args.curr_iteration = 2
            args.log_interval = 2
            timers = global_vars.get_timers()
            timers._timers = {'optimizer-mlp-offload-update': 1, 'optimizer-mlp-offload-fetch-nvme': 1,
                              'forward-backward': 1}
            opt = training.setup_optimizer()
            log = training.training_log({}, 2)
            with open(os.environ['FAKE_OUT'], 'w') as f:
                json.dump({'argv': sys.argv, 'path0': sys.path[0], 'megatron': megatron.__file__,
                           'opt': opt, 'log': log, 'timers_logged': timers.logged,
                           'mlp_offload': getattr(args, 'mlp_offload', None)}, f)
    """,
}


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "Megatron-LM"
    for rel, text in FAKE_FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _launch(checkout: Path, *args: str, env=None, cwd=None):
    out = checkout.parent / "out.json"
    full_env = dict(os.environ, PYTHONPATH=str(REPO), FAKE_OUT=str(out))
    full_env.pop("MLP_OFFLOAD_CPU", None)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "megatron_mlp.launch", str(checkout / "pretrain_gpt.py"), *args],
                          env=full_env, cwd=cwd or checkout.parent, capture_output=True, text=True, timeout=120)
    result = json.loads(out.read_text()) if out.exists() else None
    return proc, result


def test_launcher_runs_script_as_python_would_with_flags_and_optimizer_hook(checkout):
    proc, out = _launch(checkout, "--use-distributed-optimizer", "--mlp-offload",
                        "--mlp-offload-paths", "/nvme/x;/pfs/y", "--mlp-offload-host-memory", "2GB")
    assert proc.returncode == 0, proc.stderr
    assert out["argv"][0] == str(checkout / "pretrain_gpt.py") and "--mlp-offload" in out["argv"]
    assert out["path0"] == str(checkout)
    assert out["megatron"] == str(checkout / "megatron" / "__init__.py"), "the checkout's megatron must win"
    assert out["mlp_offload"] is True
    opt = out["opt"]
    assert opt["built_by"] == "mlp-offload" and opt["tiers"] == ["/nvme/x", "/pfs/y"]
    assert opt["host_memory_bytes"] == 2 * 10**9
    # every argument of Megatron's call reaches the factory untouched
    assert (opt["config"], opt["chunks"], opt["args"], opt["kwargs"]) == ("cfg", ["chunk"], ["pos3"],
                                                                          {"no_weight_decay_cond": None})


def test_launcher_logs_offload_timers_every_log_interval(checkout):
    proc, out = _launch(checkout, "--use-distributed-optimizer", "--mlp-offload", "--mlp-offload-paths", "/a")
    assert proc.returncode == 0, proc.stderr
    assert out["log"] == "megatron-log"
    assert out["timers_logged"] == [[["optimizer-mlp-offload-fetch-nvme", "optimizer-mlp-offload-update"], 2]]


def test_launcher_leaves_megatron_untouched_when_mlp_offload_is_off(checkout):
    proc, out = _launch(checkout, "--use-distributed-optimizer")
    assert proc.returncode == 0, proc.stderr
    assert out["opt"]["built_by"] == "stock" and out["mlp_offload"] is False
    assert out["timers_logged"] == []


@pytest.mark.parametrize("args,flag", [
    (["--use-distributed-optimizer", "--mlp-offload", "--mlp-offload-paths", "/a",
      "--mlp-offload-host-memory", "lots"], "--mlp-offload-host-memory"),
    (["--mlp-offload", "--mlp-offload-paths", "/a"], "--use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--mlp-offload"], "--mlp-offload-paths"),
])
def test_launcher_fails_fast_naming_the_flag_when_a_value_is_invalid(checkout, args, flag):
    proc, out = _launch(checkout, *args)
    assert proc.returncode == 2 and flag in proc.stderr and out is None, proc.stderr


def test_launcher_explains_usage_when_script_is_missing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_mlp.launch", str(tmp_path / "nope.py")],
                          env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    assert proc.returncode == 2 and "nope.py: no such script" in proc.stderr


def test_hooks_are_idempotent_when_applied_twice():
    def add(parser):
        return parser
    once = hooks.wrap_add_megatron_arguments(add)
    assert hooks.wrap_add_megatron_arguments(once) is once
    opt_once = hooks.wrap_get_megatron_optimizer(lambda: None, lambda: None)
    assert hooks.wrap_get_megatron_optimizer(opt_once, lambda: None) is opt_once


def test_training_log_hook_skips_timers_between_log_intervals():
    class Timers:
        _timers = {"optimizer-mlp-offload-update": 1}
        logged = []

        def log(self, names, normalizer=1.0):
            self.logged.append(names)

    class Args:
        mlp_offload, log_interval = True, 5

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale):  # 0.16's order
        return "ok"

    timers = Timers()
    wrapped = hooks.wrap_training_log(training_log, lambda: Args, lambda: timers)
    assert wrapped({}, {}, 1e-3, 3, 1.0) == "ok" and timers.logged == []
    wrapped({}, {}, 1e-3, 10, 1.0)
    assert timers.logged == [["optimizer-mlp-offload-update"]]


@pytest.mark.parametrize("call", [
    lambda log: log({}, {}, 1e-3, 1e-3, 5, 1.0),            # 0.13-0.15: decoupled_learning_rate before it
    lambda log: log({}, {}, 1e-3, 1e-3, iteration=5, loss_scale=1.0),
])
def test_our_line_follows_megatrons_own_line_of_the_same_iteration_whatever_the_argument_order(call, capsys):
    class Args:   # the loop sets curr_iteration before the step: one behind the iteration logged
        mlp_offload, log_interval, curr_iteration = True, 5, 4

    class Timers:
        _timers = {"optimizer-mlp-offload-update": 1}
        logged = []

        def log(self, names, normalizer=1.0):
            self.logged.append(names)

    def training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, iteration, loss_scale):
        print(f"megatron: iteration {iteration}")

    timers = Timers()
    call(hooks.wrap_training_log(training_log, lambda: Args, lambda: timers))
    assert timers.logged == [["optimizer-mlp-offload-update"]]
    assert hooks.logged_iteration(None, (), {}, Args) == 5    # no argument to bind: curr_iteration + 1


def test_cpu_switch_makes_cuda_calls_of_megatron_lm_run_on_cpu():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    code = textwrap.dedent("""
        import torch
        from megatron_mlp.testing import cpu_launch
        cpu_launch.install()
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            t = torch.empty(4, device='cuda')
        assert t.device.type == 'cpu'
        torch.cuda.synchronize(); torch.cuda.set_device(0)
        assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())
        print('CPU-OK')
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "CPU-OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("args,preset,expected", [
    (["--tensor-model-parallel-size", "2"], None, "1"),
    (["--tensor-model-parallel-size=4"], None, "1"),
    (["--tensor-model-parallel-size", "2"], "8", "8"),      # the user's own value is kept
    (["--tensor-model-parallel-size", "1"], None, None),
    ([], None, None),
])
def test_launcher_sets_one_cuda_connection_before_the_script_when_tensor_parallel(checkout, args, preset,
                                                                                    expected):
    # The fake script reports what the environment held when it ran (before any CUDA start).
    (checkout / "pretrain_gpt.py").write_text(
        "import json, os\nimport megatron.training\n"
        "json.dump({'cuda_connections': os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}, "
        "open(os.environ['FAKE_OUT'], 'w'))\n")
    env = {} if preset is None else {"CUDA_DEVICE_MAX_CONNECTIONS": preset}
    base_env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    out = checkout.parent / "out.json"
    proc = subprocess.run([sys.executable, "-m", "megatron_mlp.launch", str(checkout / "pretrain_gpt.py"), *args],
                          env=dict(base_env, PYTHONPATH=str(REPO), FAKE_OUT=str(out), **env),
                          cwd=checkout.parent, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["cuda_connections"] == expected


def test_training_log_hook_prints_bytes_each_tier_moved_once_per_log_interval(capsys):
    class Inner:
        def __init__(self):
            self.counts = {"/nvme/x": (3_000_000, 2_000_000), "/pfs/y": (1_000_000, 0)}

        def take_tier_bytes(self):
            taken, self.counts = self.counts, {}
            return taken

    class Dist:   # Megatron's DistributedOptimizer holds the inner one as .optimizer
        optimizer = Inner()

    class Args:
        mlp_offload, log_interval = True, 5

    class Timers:
        _timers = {}

    def training_log(loss_dict, iteration):
        return "ok"

    opt = Dist()
    hooks._built.add(opt)
    try:
        wrapped = hooks.wrap_training_log(training_log, lambda: Args, lambda: Timers())
        wrapped({}, 3)
        assert "megatron_mlp: last" not in capsys.readouterr().out   # not a log iteration
        wrapped({}, 5)
        assert capsys.readouterr().out.strip() == ("megatron_mlp: last 5 iterations, this rank: /nvme/x read 3.00 MB, "
                                                   "wrote 2.00 MB; /pfs/y read 1.00 MB, wrote 0 B")
        wrapped({}, 10)
        assert "megatron_mlp: last" not in capsys.readouterr().out   # counted anew: nothing moved since
    finally:
        hooks._built.discard(opt)


def test_a_script_patched_with_the_earlier_line_refuses_the_cpu_switch_and_says_how_to_update(checkout):
    # The earlier patch line imported the Megatron layer directly, which cannot install the CPU
    # harness (test equipment, one layer up): it must say so, not train on a device it lacks.
    code = ("import sys; sys.argv = ['pretrain_gpt.py', '--mlp-offload-cpu']\n"
            "import megatron_mlp.megatron.hooks as h; h.install()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=f"{checkout}{os.pathsep}{REPO}"))
    assert proc.returncode != 0
    assert "--mlp-offload-cpu" in proc.stderr and "apply_megatron_patch.sh" in proc.stderr
    assert "python -m megatron_mlp.launch" in proc.stderr


def test_launch_install_puts_the_cpu_harness_in_place_before_the_hooks(monkeypatch):
    import megatron_mlp.launch as launch
    from megatron_mlp.testing import cpu_launch

    calls = []
    monkeypatch.setattr(cpu_launch, "install", lambda: calls.append("harness"))
    monkeypatch.setattr(hooks, "install", lambda argv=None: calls.append(("hooks", argv)))
    launch.install(["pretrain_gpt.py", "--mlp-offload-cpu"])
    assert calls == ["harness", ("hooks", ["pretrain_gpt.py", "--mlp-offload-cpu"])]
    calls.clear()
    monkeypatch.delenv("MLP_OFFLOAD_CPU", raising=False)
    launch.install(["pretrain_gpt.py"])
    assert calls == [("hooks", ["pretrain_gpt.py"])]
