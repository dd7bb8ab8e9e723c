"""A step is a transaction: what ``OffloadAdam`` checks before anything changes, and what it refuses.

* Every hyper-parameter and counter a step uses (``lr``, ``betas``, ``eps``, ``weight_decay``,
  the step counts, the loss scale and clip coefficient) is read and checked here, before the
  step touches any state; an error names the field and the value it got. A step refused here
  changes nothing: retrying it after the value is fixed gives one clean step.
* ``load_state_dict`` checks every field of a checkpoint the same way (types, lengths, ranges,
  dtypes, shapes) and names the field it refuses (``check_state_dict``, ``check_chunk``).
* A step that stops part-way (or a load that is refused or stops) leaves the optimizer *partial*:
  ``partial_error`` is what ``step``, ``state_dict`` and ``read_range`` raise until a good load.
"""
from __future__ import annotations

import copy
import math
import numbers

import torch

from megatron_mlp.errors import ConfigError, PartialStepError

STATE_FIELDS = ("param", "exp_avg", "exp_avg_sq")
GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DEFAULTS = {"weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8}


def _number(name: str, value, *, low: float = 0.0, high: float | None = None, low_open: bool = False,
            high_open: bool = False) -> float:
    """``value`` as a float in the range; TypeError (not a real number) or ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {value!r} ({type(value).__name__})")
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise TypeError(f"{name}: expected a number, got a tensor of shape {tuple(value.shape)}")
    v = float(value)
    bad = not math.isfinite(v) or v < low or (low_open and v == low)
    if high is not None:
        bad = bad or v > high or (high_open and v == high)
    if bad:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{name}: {value!r} is outside {lo}{low}, {'inf' if high is None else high}{hi}")
    return v


def check_step_count(name: str, value, *, minimum: int = 0) -> int:
    """A step counter: an integer (a Python int, or a float/tensor holding one) >= ``minimum``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{name}: expected an integer step count, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected an integer step count, got {value!r} ({type(value).__name__})")
    if not math.isfinite(float(value)) or float(value) != int(value):
        raise ValueError(f"{name}: {value!r} is not a whole number of steps")
    if int(value) < minimum:
        raise ValueError(f"{name}: {value!r} is below {minimum}")
    return int(value)


def check_group(group: dict, where: str) -> dict:
    """The kernel's hyper-parameters of one param group, each checked (``where`` names the group)."""
    for key in ("lr", "weight_decay", "betas", "eps"):
        if key not in group:
            raise KeyError(f"{where}: {key!r} is missing")
    betas = group["betas"]
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise TypeError(f"{where}['betas']: expected two numbers, got {betas!r}")
    return {"lr": _number(f"{where}['lr']", group["lr"]),
            "weight_decay": _number(f"{where}['weight_decay']", group["weight_decay"]),
            "beta1": _number(f"{where}['betas'][0]", betas[0], high=1.0, high_open=True),
            "beta2": _number(f"{where}['betas'][1]", betas[1], high=1.0, high_open=True),
            "eps": _number(f"{where}['eps']", group["eps"])}


def checked_hyper(param_groups: list, steps: list[int]) -> list[dict]:
    """Per group, the kernel's hyper-parameters for the step about to run (``steps``: the counts it
    will have), every value checked first. Raises TypeError / ValueError naming the field."""
    out = []
    for g, group in enumerate(param_groups):
        hyper = check_group(group, f"param_groups[{g}]")
        hyper["step"] = check_step_count(f"param_groups[{g}] step", steps[g], minimum=1)
        out.append(hyper)
    return out


def check_scale(inv_loss_scale, clip_coef) -> tuple[float, float]:
    return (_number("inv_loss_scale", inv_loss_scale, low_open=True),
            _number("clip_coef", clip_coef, low_open=True))


def partial_error(why: str) -> PartialStepError:
    return PartialStepError(
        f"OffloadAdam: the state is partial ({why}): some subgroups hold one state and others another, so "
        "stepping or saving it would apply a step twice to some or put a mixed state into a checkpoint. Restore "
        "the state from the last checkpoint (load_state_dict, or restart from it with Megatron's --load) first")


def check_state_dict(sd, numel: int, group_ranges: list, fmt: str) -> tuple[list[dict], list[int], int, list]:
    """The fields of an ``OffloadAdam.state_dict`` checked against this optimizer's shard.

    Returns ``(param_groups, steps, iteration, chunks)``; raises ValueError / TypeError naming the
    first field it refuses. The chunks themselves are checked one by one (``check_chunk``) as they
    are read, so a lazy chunk is materialized once.
    """
    if not isinstance(sd, dict):
        raise TypeError(f"load_state_dict: expected a dict, got {type(sd).__name__}")
    for key in ("format", "numel", "group_ranges", "param_groups", "steps", "state"):
        if key not in sd:
            raise ValueError(f"load_state_dict: field {key!r} is missing")
    if sd["format"] != fmt:
        raise ValueError(f"load_state_dict: 'format' is {sd['format']!r}, expected {fmt!r}")
    if check_step_count("load_state_dict: 'numel'", sd["numel"]) != numel:
        raise ValueError(f"load_state_dict: 'numel' is {sd['numel']!r}, this optimizer's shard has {numel}")
    ranges = sd["group_ranges"]
    if not isinstance(ranges, (list, tuple)) or [_pair(r) for r in ranges] != [tuple(r) for r in group_ranges]:
        raise ValueError(f"load_state_dict: 'group_ranges' is {ranges!r}, this optimizer has "
                         f"{[tuple(r) for r in group_ranges]}")
    n = len(group_ranges)
    groups, steps = sd["param_groups"], sd["steps"]
    if not isinstance(groups, (list, tuple)) or len(groups) != n:
        raise ValueError(f"load_state_dict: 'param_groups' has {_length(groups)} entries for {n} param groups")
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            raise TypeError(f"load_state_dict: 'param_groups'[{g}] is a {type(group).__name__}, expected a dict")
        check_group(group, f"load_state_dict: 'param_groups'[{g}]")
    if not isinstance(steps, (list, tuple)) or len(steps) != n:
        raise ValueError(f"load_state_dict: 'steps' has {_length(steps)} entries for {n} param groups")
    steps = [check_step_count(f"load_state_dict: 'steps'[{g}]", s) for g, s in enumerate(steps)]
    if len(set(steps)) > 1:   # the groups step together: a checkpoint that differs was edited or mixed
        raise ValueError(f"load_state_dict: 'steps' {steps} differ between param groups; they move together")
    iteration = check_step_count("load_state_dict: 'iteration'", sd.get("iteration", 0))
    if iteration > 0 and steps and steps[0] == 0:
        raise ValueError(f"load_state_dict: 'steps' {steps} are 0 while 'iteration' is {iteration}: the "
                         "state has been stepped, so its bias correction cannot start again")
    if not isinstance(sd["state"], (list, tuple)):
        raise TypeError(f"load_state_dict: 'state' is a {type(sd['state']).__name__}, expected a list of chunks")
    return list(groups), steps, iteration, list(sd["state"])


def hyper_of(group: dict) -> dict:
    """A copy of a param group's hyper-parameters: without its "params" (a caller's model tensors)."""
    return copy.deepcopy({k: v for k, v in group.items() if k != "params"})


def build_state_dict(fmt: str, numel: int, group_ranges, param_groups: list, steps: list[int], iteration: int,
                     chunks: list) -> dict:
    """The layout-independent state ``check_state_dict`` takes back: hyper-parameters, steps, chunks."""
    return {"format": fmt, "numel": numel, "group_ranges": [list(r) for r in group_ranges],
            "param_groups": [hyper_of(g) for g in param_groups], "steps": list(steps), "iteration": iteration,
            "state": chunks}


def check_chunk(data, k: int, covered: int, numel: int) -> tuple[int, int]:
    """A state chunk (``{"start", "end", "param", "exp_avg", "exp_avg_sq"}``) starting at ``covered``:
    fp32 CPU tensors of ``end - start`` elements each. Returns ``(start, end)``."""
    where = f"load_state_dict: 'state'[{k}]"
    if not isinstance(data, dict):
        raise TypeError(f"{where} is a {type(data).__name__}, expected a dict")
    for key in ("start", "end", *STATE_FIELDS):
        if key not in data:
            raise ValueError(f"{where}: field {key!r} is missing")
    start = check_step_count(f"{where}['start']", data["start"])
    end = check_step_count(f"{where}['end']", data["end"])
    if start != covered:
        raise ValueError(f"{where}['start'] is {start}: the chunks leave a gap or overlap at element {covered}")
    if not start < end <= numel:
        raise ValueError(f"{where}['end'] is {end}: expected ({start}, {numel}]")
    for key in STATE_FIELDS:
        t = data[key]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}[{key!r}] is a {type(t).__name__}, expected a torch.Tensor")
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(f"{where}[{key!r}] is {t.dtype} on {t.device}, expected torch.float32 on the CPU")
        if t.dim() != 1 or t.numel() != end - start:
            raise ValueError(f"{where}[{key!r}] has shape {tuple(t.shape)}, expected ({end - start},)")
    return start, end


def _pair(r) -> tuple:
    if not isinstance(r, (list, tuple)) or len(r) != 2:
        return (r,)
    return tuple(r)


def _length(x) -> str:
    return str(len(x)) if isinstance(x, (list, tuple)) else f"no list ({type(x).__name__}), hence no"


def check_flat(name: str, t, numel: int) -> None:
    """``t`` is a flat host tensor the kernel can read or write in place: contiguous, on the CPU,
    bf16 | fp16 | fp32, ``numel`` elements. Raises ValueError naming ``name`` and what it got."""
    if not isinstance(t, torch.Tensor) or t.dtype not in GRAD_DTYPES or t.device.type != "cpu" \
            or t.numel() != numel or not t.is_contiguous():
        desc = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a contiguous CPU bf16/fp16/fp32 tensor of {numel} elements, got {desc}")


def merge_range(ranges: list[tuple[int, int]], new: tuple[int, int]) -> list[tuple[int, int]]:
    """``ranges`` (sorted, disjoint) with ``new`` added, touching and overlapping ranges joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted([*ranges, new]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def with_defaults(param_groups: list, num_ranges: int) -> list:
    """``param_groups`` (the caller's dicts, kept by identity) with the AdamW defaults filled in."""
    if len(param_groups) != num_ranges:
        raise ConfigError(f"param_groups: {len(param_groups)} groups given for {num_ranges} group ranges")
    for i, group in enumerate(param_groups):
        if "lr" not in group:
            raise ConfigError(f"param_groups[{i}]: 'lr' is required")
        for key, value in _DEFAULTS.items():
            group.setdefault(key, value)
    return param_groups
