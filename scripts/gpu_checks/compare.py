"""Comparisons of two runs: bitwise, in ulps, and the GPU parity rule."""
from __future__ import annotations

import math

from gpu_checks.harness import Run

PARITY_REL_TOL = 1e-3   # losses and grad norms, GPU Adam (stock) against the host's fused Adam


def bitwise_equal(a, b) -> bool:
    import torch
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _bits(t):
    import torch
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.int8}[t.element_size()])


def _ordered(t):
    """The float bits as integers that order like the floats (negative floats mirrored), so that
    the difference of two is their distance in units in the last place."""
    import torch
    bits = _bits(t).long().view(-1)
    sign = 1 << (t.element_size() * 8 - 1)
    return torch.where(bits < 0, -(bits & (sign - 1)), bits)


def ulp_distances(a, b):
    """Element-wise distance in units in the last place of two tensors of one 16/32-bit float dtype."""
    return (_ordered(a) - _ordered(b)).abs()


def max_ulp_distance(a, b) -> int:
    """Largest distance in units in the last place between two tensors of one 16/32-bit float dtype."""
    d = ulp_distances(a, b)
    return int(d.max()) if d.numel() else 0


def param_agreement(mlp: dict, stock: dict, lr: float) -> dict:
    """How far MLP-Offload's bf16 params are from stock's, element by element.

    An element agrees when the two are within one bf16 ulp, or within ``lr * 2**-16`` of each
    other: near zero one bf16 ulp is finer than the fp32 rounding of an Adam step (whose size is
    about ``lr``), so a param crossing zero can sit many ulps apart while the two differ by a few
    fp32 roundings of its update. Returns the worst element with both values.
    """
    abs_tol = lr * 2.0 ** -16
    worst = {"ulps": -1}
    disagree = 0
    for name in stock:
        a, b = mlp[name].float().view(-1), stock[name].float().view(-1)
        ulps = ulp_distances(mlp[name], stock[name])
        bad = (ulps > 1) & ((a - b).abs() > abs_tol)
        disagree += int(bad.sum())
        if ulps.numel() and int(ulps.max()) > worst["ulps"]:
            k = int(ulps.argmax())
            worst = {"ulps": int(ulps[k]), "param": name, "mlp": float(a[k]), "stock": float(b[k])}
    return {"elements_disagreeing": disagree, "worst_element": worst, "abs_tolerance": abs_tol}


def rel_diffs(xs, ys) -> list:
    out = []
    for x, y in zip(xs, ys):
        if x is None or y is None:
            out.append(None if x is None and y is None else math.inf)
        else:
            out.append(abs(x - y) / max(abs(y), 1e-12))
    return out


def compare_runs(mlp: Run, stock: Run, tol: float) -> dict:
    loss_rel = rel_diffs(mlp.losses, stock.losses)
    norm_rel = rel_diffs(mlp.grad_norms, stock.grad_norms)
    ulps = {n: max_ulp_distance(mlp.params[n], stock.params[n]) for n in stock.params}
    worst = max((r for r in loss_rel + norm_rel if r is not None), default=0.0)
    return {
        "losses_mlp": mlp.losses, "losses_stock": stock.losses,
        "grad_norms_mlp": mlp.grad_norms, "grad_norms_stock": stock.grad_norms,
        "max_rel_diff_loss": max((r for r in loss_rel if r is not None), default=0.0),
        "max_rel_diff_grad_norm": max((r for r in norm_rel if r is not None), default=0.0),
        "bitwise_losses": mlp.losses == stock.losses,
        "bitwise_params": all(bitwise_equal(mlp.params[n], stock.params[n]) for n in stock.params),
        "max_param_ulps": max(ulps.values(), default=0),
        "within_tolerance": worst <= tol,
    }


# ------------------------------------------------------------------------------------------ checks
