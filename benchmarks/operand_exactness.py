"""How many operand elements a quantized product sees that are not code x scale.

Usage: python benchmarks/operand_exactness.py [--tokens T] [--hidden H] [--values V,...]
       [--dtypes bf16,fp16,fp32]

A tensor core multiplies the FP8/FP4 codes and applies their scales in float32. The emulated
product multiplies tensors of the training dtype instead, so what it sees is exact only where
the training dtype holds each operand element exactly. For every value and every training
dtype this runs the three products of Megatron's linear layer (fprop ``X W^T``, dgrad ``dY W``,
wgrad ``dY^T X``, called as the patched linear function calls ``quant_matmul``) and, where the
value applies to attention, ``Q K^T`` (``quant_baddbmm``) and ``P V`` (``quant_bmm``), captures
the operands of the matrix product that actually runs (``aten.mm``/``bmm``/``baddbmm``, through
a ``TorchDispatchMode``) and compares each element with its code times its scale computed in
float32, in one of two readings:

* the whole scale: ``code x scale`` as the vendor's dequantize computes it in float32 (for
  NVFP4 ``code x (block scale x tensor scale)``; for FP8 current and delayed scaling
  ``code x scale_inv``; for MX, HiF8 and fp8-block the power-of-two block scale);
* the block scale only: ``code x block scale`` (exact in float32), the per-tensor float32 scale
  left to multiply the product's float32 result, as the hardware's epilogue applies it.

An operand tensor counts its mismatches in the reading it matches best (a product that
factors the scale matches the second, one that does not the first; the other reading misses
nearly every element). The codes are the runtime's own (bit-identical to TE's and torchao's
references, proven in tests/test_reference_numerics.py and tests/test_te_nvfp4.py); where an
operand rounds stochastically, its code is read back from the captured value (the nearest
E2M1 value of ``value / scale``: the training dtype's rounding is far below E2M1's spacing).
A delayed value runs two steps and measures the second (scaled from the first's amaxes).

Prints one line per value and dtype: mismatching elements / elements compared, per GEMM.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quantpatch.runtime import quantpatch_delayed as delayed
from quantpatch.runtime import quantpatch_formats as formats
from quantpatch.runtime import quantpatch_ops as ops
from quantpatch.runtime import quantpatch_rht as rht
from quantpatch.runtime.quantpatch_fp8 import finite_amax, tensor_scales
from quantpatch.runtime.quantpatch_mx import round_element
from quantpatch.runtime.quantpatch_nvfp4 import (
    nv_decode,
    nv_global_decode,
    nvfp4_4over6_parts,
    nvfp4_parts,
)
from quantpatch.runtime.quantpatch_quantize import quantize

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_PRODUCTS = {
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.bmm.default: (0, 1),
    torch.ops.aten.baddbmm.default: (1, 2),
    torch.ops.aten.addmm.default: (1, 2),
}


class _Capture(TorchDispatchMode):
    """Records the two matrix operands of every matrix product that runs inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.products: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        picked = _PRODUCTS.get(func)
        if picked is not None:
            i, j = picked
            self.products.append((args[i].detach().clone(), args[j].detach().clone()))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def captured() -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    mode = _Capture()
    with mode:
        yield mode.products


# -- the references: code x scale in float32, whole or block part -----------------------------


def _e2m1_nearest(p: torch.Tensor) -> torch.Tensor:
    return torch.copysign(round_element(p.abs().clamp(max=6.0), formats.E2M1), p)


def readings(
    src: torch.Tensor,
    opfmt: str,
    dim: int,
    backward: bool,
    seen: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(whole, block)``: ``src``'s operand as ``opfmt`` quantizes it along ``dim``, code x
    its whole scale and code x its block scale, float32 (``seen``: the captured operand, whose
    codes a stochastically rounded operand is read back from; ``scale``: a delayed value's
    float32 scale)."""
    spec = formats.spec_of(opfmt)
    v = src.to(torch.float32)
    finite = torch.isfinite(v)
    clean = torch.where(finite, v, torch.zeros_like(v))
    if spec.family in ("fp8-tensor", "fp8-delayed"):
        elem = formats.ELEMENTS[str(spec.grad_output if backward else spec.input)]
        if scale is None:
            scale, scale_inv = tensor_scales(finite_amax(v), elem.vmax, src.dtype)
        else:
            scale_inv = torch.reciprocal(scale)
        q = round_element(torch.clamp(clean * scale, -elem.vmax, elem.vmax), elem)
        return torch.where(finite, q * scale_inv, v), torch.where(finite, q, v)
    if spec.family == "nvfp4":
        if spec.rht:
            v = rht.rht(src, dim).to(torch.float32)
        two_d = spec.tiled and v.dim() >= 2
        if spec.four_over_six and not backward:  # a 4over6 operand (its gradient: nvfp4's)
            q, s, amax = nvfp4_4over6_parts(v, opfmt, dim, two_d)
            return q * (s * nv_decode(amax, opfmt)), q * s
        q, s, amax = nvfp4_parts(v, dim, two_d)
        d = nv_global_decode(amax)
        stochastic = backward and "grad_output" in spec.stochastic
        if stochastic:  # the code the captured value holds, read back in either reading
            sd = s * d
            whole = _e2m1_nearest(seen / torch.where(sd > 0, sd, 1.0)) * sd
            block = _e2m1_nearest(seen / torch.where(s > 0, s, 1.0)) * s
            return whole, block
        return q * (s * d), q * s
    whole = quantize(v, opfmt, dim=dim, backward=backward)  # power-of-two scales: exact
    return whole, whole


def mismatches(seen: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Elements of ``seen`` that differ from the reading it matches best."""
    s = seen.to(torch.float32)
    return min(int((s != r.reshape(s.shape)).sum()) for r in ref)


# -- the products, called as Megatron's linear function and local attention call them ---------


class _Linear(torch.autograd.Function):
    """The three products of ``LinearWithGradAccumulationAndAsyncCommunication`` as quantpatch's
    patched sites call them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.fmt = fmt
        return ops.quant_matmul(x, w.t(), fmt=fmt, weight="b")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w = ctx.saved_tensors
        dx = ops.quant_matmul(g, w, fmt=ctx.fmt, backward=True, weight="b")
        dw = ops.quant_matmul(g.t(), x, fmt=ctx.fmt, backward=True)
        return dx, dw, None


def _operand_fmts(fmt: str, a_weight: bool, b_weight: bool) -> tuple[str, str]:
    weight_fmt, other = formats.spec_of(fmt).operands
    return (weight_fmt if a_weight else other, weight_fmt if b_weight else other)


def linear_gemms(
    fmt: str, dtype: torch.dtype, tokens: int, hidden: int, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """Train the linear layer one step (two for a delayed value) and return, per GEMM, its
    operands' sources and how they are quantized, the captured operands and its result."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).mul(2.0).to(dtype).requires_grad_()
    w0 = torch.randn(hidden, hidden, generator=gen) * hidden**-0.5
    w = torch.nn.Parameter(w0.to(dtype))
    gy = (torch.randn(tokens, hidden, generator=gen) * 1e-3).to(dtype)
    spec = formats.spec_of(fmt)
    layer = torch.nn.Module()
    layer.weight = w
    if spec.family == "fp8-delayed":
        ops.add_delayed_state(layer, fmt)
        _Linear.apply(x, w, fmt).backward(gy)
        x.grad = w.grad = None
        with torch.no_grad():
            w.mul_(1)  # as an optimizer step: the weight is quantized anew
    ops.reset_sr_generators()
    calls: list[dict[str, Any]] = []
    real = ops.quant_matmul

    def spy(a: torch.Tensor, b: torch.Tensor, fmt: str, **kw: Any) -> torch.Tensor:
        with captured() as products:
            out = real(a, b, fmt, **kw)
        calls.append({"a": a.detach(), "b": b.detach(), "out": out.detach(), "seen": products})
        return out

    ops.quant_matmul = spy  # type: ignore[assignment]
    try:
        y = _Linear.apply(x, w, fmt)
        y.backward(gy)
    finally:
        ops.quant_matmul = real  # type: ignore[assignment]
    fprop, dgrad, wgrad = calls
    b_backward = spec.backward == "all"
    scales: list[torch.Tensor | None] = [None, None, None]
    if spec.family == "fp8-delayed":
        scales = list(layer.fp8_delayed.scale.clone())
    fi, fw = _operand_fmts(fmt, False, True)
    inp, wt, grad = delayed.INPUT, delayed.WEIGHT, delayed.GRAD
    fprop.update(ops=((fi, -1, False, scales[inp]), (fw, -2, False, scales[wt])))
    dgrad.update(ops=((fi, -1, True, scales[grad]), (fw, -2, b_backward, scales[wt])))
    wgrad.update(ops=((fi, -1, True, scales[grad]), (fi, -2, b_backward, scales[inp])))
    return {"fprop": fprop, "dgrad": dgrad, "wgrad": wgrad}


def attention_gemms(
    fmt: str, dtype: torch.dtype, tokens: int, head_dim: int, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """``Q K^T`` and ``P V`` of a local attention (batch x heads 4), under autograd."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(4, tokens, head_dim, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(4, tokens, head_dim, generator=gen).to(dtype).requires_grad_()
    p = torch.softmax(torch.randn(4, tokens, tokens, generator=gen), -1).to(dtype)
    v = torch.randn(4, tokens, head_dim, generator=gen).to(dtype).requires_grad_()
    kt = k.transpose(1, 2)
    out: dict[str, dict[str, Any]] = {}
    buf = torch.empty(4, tokens, tokens, dtype=dtype)
    with captured() as seen:
        scores = ops.quant_baddbmm(buf, q, kt, beta=0.0, alpha=0.125, fmt=fmt)
    a_fmt, b_fmt = _operand_fmts(fmt, False, False)
    ops_qk = ((a_fmt, -1, False, None), (b_fmt, -2, False, None))
    out["qk"] = {"a": q.detach(), "b": kt.detach(), "out": scores.detach(), "seen": seen,
                 "ops": ops_qk}  # fmt: skip
    with captured() as seen:
        context = ops.quant_bmm(p, v, fmt=fmt)
    out["pv"] = {"a": p, "b": v.detach(), "out": context.detach(), "seen": seen, "ops": ops_qk}
    return out


def count(gemm: dict[str, Any]) -> tuple[int, int]:
    """(mismatching elements, elements compared) of one GEMM's two operands."""
    seen = gemm["seen"]
    if len(seen) != 1:
        raise AssertionError(f"expected one matrix product, captured {len(seen)}")
    bad = total = 0
    for src, got, (opfmt, dim, backward, scale) in zip(
        (gemm["a"], gemm["b"]), seen[0], gemm["ops"], strict=True
    ):
        got = got.reshape(src.shape)
        bad += mismatches(got, readings(src, opfmt, dim, backward, got, scale))
        total += got.numel()
    return bad, total


def measure(
    fmt: str, dtype: torch.dtype, tokens: int = 64, hidden: int = 256
) -> dict[str, tuple[int, int]]:
    """Mismatches per GEMM of ``fmt`` in ``dtype`` training."""
    gemms = linear_gemms(fmt, dtype, tokens, hidden)
    if "qk" in formats.spec_of(fmt).roles:
        gemms.update(attention_gemms(fmt, dtype, tokens, 64))
    return {name: count(g) for name, g in gemms.items()}


def quantized_values() -> list[str]:
    return [v for v in formats.VALUES if formats.spec_of(v).family not in ("none", "paretoq")]


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--values", default=",".join(quantized_values()))
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    out(f"{args.tokens} tokens x {args.hidden} hidden; torch {torch.__version__}")
    out("value dtype: mismatching / compared per GEMM (fprop dgrad wgrad [qk pv]) = total %")
    total_bad = 0
    for fmt in args.values.split(","):
        for name in args.dtypes.split(","):
            got = measure(fmt, DTYPES[name], args.tokens, args.hidden)
            bad = sum(b for b, _ in got.values())
            n = sum(t for _, t in got.values())
            total_bad += bad
            cells = " ".join(f"{g}={b}/{t}" for g, (b, t) in got.items())
            out(f"{fmt:20s} {name}: {cells} = {100 * bad / n:.1f} %")
    out(f"total mismatching operand elements: {total_bad}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
