"""The CPU harness's 16-bit matmuls: in fp32 from the upcast inputs, rounded once (what a GPU's
tensor cores compute), where the CPU has no fast native path or MLP_CPU_HALF_MATMUL=fp32 asks;
torch's own kernels where it has one or MLP_CPU_HALF_MATMUL=native asks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the harness refuses to install where CUDA exists")

from megatron_mlp.testing import harness  # noqa: E402
from megatron_mlp.testing.multiproc import run_distributed  # noqa: E402


@pytest.fixture
def fp32_harness():
    harness.uninstall_cpu_harness()
    harness.install_cpu_harness(half_matmul="fp32")
    yield
    harness.uninstall_cpu_harness()


def _operands(dtype, requires_grad=True):
    g = torch.Generator().manual_seed(7)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_(requires_grad)  # noqa: E731
    return {"a": make(5, 64), "b": make(64, 3), "bias": make(5, 3), "x": make(2, 5, 64), "y": make(2, 64, 3),
            "bb": make(2, 5, 3), "w": make(3, 64), "lb": make(3)}


# Each call as Megatron's layers make it, beside the same call on fp32 tensors.
CALLS = {
    "matmul": lambda o: torch.matmul(o["a"], o["b"]),
    "operator": lambda o: o["a"] @ o["b"],
    "tensor.matmul": lambda o: o["a"].matmul(o["b"]),
    "mm": lambda o: torch.mm(o["a"], o["b"]),
    "tensor.mm": lambda o: o["a"].mm(o["b"]),
    "bmm": lambda o: torch.bmm(o["x"], o["y"]),
    "addmm": lambda o: torch.addmm(o["bias"], o["a"], o["b"], beta=0.5, alpha=2.0),
    "baddbmm": lambda o: torch.baddbmm(o["bb"], o["x"], o["y"], beta=0.0, alpha=0.125),
    "linear": lambda o: F.linear(o["a"], o["w"], o["lb"]),
    "linear-no-bias": lambda o: F.linear(o["a"], o["w"]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_half_matmul_is_fp32_matmul_of_upcast_inputs_rounded_once_when_mode_fp32(fp32_harness, call, dtype):
    ops = _operands(dtype)
    out = CALLS[call](ops)
    assert out.dtype == dtype
    ref_ops = {k: v.detach().float().requires_grad_() for k, v in ops.items()}
    with torch._C.DisableTorchFunction():  # the oracle: torch's own fp32 matmul
        ref = CALLS[call](ref_ops)
    assert torch.equal(out, ref.to(dtype))
    # Backward too: each gradient is the fp32 matmul of the upcast operands, rounded once.
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    out.backward(grad)
    with torch._C.DisableTorchFunction():
        ref.backward(grad.float())
    for k, v in ops.items():
        if v.grad is not None or ref_ops[k].grad is not None:
            assert torch.equal(v.grad, ref_ops[k].grad.to(dtype)), k
    # Both sides of a comparison run this same code: the same inputs give the same bits again.
    assert torch.equal(CALLS[call](_operands(dtype)), out)


def test_native_mode_leaves_torch_16bit_matmul_alone():
    harness.uninstall_cpu_harness()
    harness.install_cpu_harness(half_matmul="native")
    try:
        ops = _operands(torch.bfloat16, requires_grad=False)
        with torch._C.DisableTorchFunction():
            expected = torch.matmul(ops["a"], ops["b"])
        assert torch.equal(torch.matmul(ops["a"], ops["b"]), expected)
        assert harness.half_matmul_fp32_dtypes() == frozenset()
    finally:
        harness.uninstall_cpu_harness()


def test_mixed_or_fp32_operands_are_left_to_torch_when_mode_fp32(fp32_harness):
    a, b = torch.randn(4, 8), torch.randn(8, 2)
    assert torch.matmul(a, b).dtype == torch.float32
    with pytest.raises(RuntimeError):  # torch's own dtype check still applies to mixed operands
        torch.matmul(a.bfloat16(), b)


@pytest.mark.parametrize("flags, fp32", [
    ({"avx2", "fma"}, {torch.bfloat16, torch.float16}),
    ({"avx2", "avx512f", "avx512_bf16"}, {torch.float16}),
    ({"amx_bf16", "amx_fp16"}, set()),
], ids=["avx2", "avx512-bf16", "amx"])
def test_auto_mode_uses_fp32_only_for_dtypes_the_cpu_has_no_native_dot_product_for(flags, fp32):
    chosen, reason = harness.choose_half_matmul("auto", flags)
    assert chosen == fp32
    assert "\n" not in reason and "bf16" in reason


def test_mode_comes_from_the_environment_and_an_unknown_one_names_the_variable(monkeypatch):
    monkeypatch.setenv("MLP_CPU_HALF_MATMUL", "fp32")
    assert harness.choose_half_matmul()[0] == {torch.bfloat16, torch.float16}
    monkeypatch.setenv("MLP_CPU_HALF_MATMUL", "native")
    assert harness.choose_half_matmul()[0] == set()
    monkeypatch.setenv("MLP_CPU_HALF_MATMUL", "fast")
    with pytest.raises(ValueError, match="MLP_CPU_HALF_MATMUL='fast'"):
        harness.choose_half_matmul()


def _half_matmuls_reaching_torch(rank, world_size, mode):
    """The aten matmuls with 16-bit operands in one forward and backward of Megatron's GPT."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_mlp.testing import gpt, install_cpu_harness

    install_cpu_harness(half_matmul=mode)
    gpt.init_model_parallel()
    spec = gpt.TinyGPT()
    model = gpt.build_model(spec)
    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear") and any(
                    isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) for a in args):
                seen.append(name)
            return func(*args, **(kwargs or {}))

    tokens, labels, mask, pos = gpt.batch(spec, 0, 0)
    with Recorder():
        loss = model[0](tokens, pos, None, labels=labels).float().mean()
        loss.backward()
    return sorted(set(seen)), len(seen)


def test_no_16bit_matmul_reaches_torch_in_megatron_gpt_forward_and_backward_when_mode_fp32():
    """Megatron's local layers (forward, and the custom backward of its linear layers) all go
    through the harness; with native mode the same recorder sees them (it works)."""
    assert run_distributed(_half_matmuls_reaching_torch, 1, "fp32")[0] == ([], 0)
    names, count = run_distributed(_half_matmuls_reaching_torch, 1, "native")[0]
    assert "mm" in names and count > 10
