"""Random Hadamard transform (RHT) for the weight-gradient GEMM, NVIDIA's NVFP4 recipe.

Installed by ``quantpatch init`` as ``megatron/core/quantpatch_rht.py`` beside
``quantpatch_ops.py``, which hands it the products of the value ``nvfp4-rht``; depends on
torch and the standard library only (the fused kernel in ``quantpatch_rht_kernels.py`` needs
triton). Public API::

    rht(x, dim=-1) -> Tensor                      # float32, ``dim`` padded to a multiple of 16
    rht_fake_quant(x, dim=-1, *, backward=False) -> Tensor
    rht_matmul(a, b, *, backward=False, quantize=True) -> Tensor

The transform (arXiv 2509.25149, section 4.2; Transformer Engine's NVFP4 recipe): the
reduction dimension is cut into blocks of 16 and every block, a row vector ``v``, becomes
``v @ (H16 @ diag(SIGNS) / 4)``, ``H16`` the 16 x 16 Hadamard matrix of Sylvester's
construction (``H1 = [1]``, ``H2n = [[Hn, Hn], [Hn, -Hn]]``) and ``SIGNS`` the fixed sign
vector below. ``H16 @ diag(s) / 4`` is orthogonal, so transforming both operands of a GEMM
along its reduction dimension leaves the product unchanged in exact arithmetic, while a block
outlier is spread over its 16 elements before NVFP4 quantizes them. A length that is not a
multiple of 16 is padded with zeros (in both operands alike, so the product is unchanged);
the transformed operands are that long.

Arithmetic: float32, in a fixed order that the kernel repeats step for step (bit-identical):
the Walsh-Hadamard butterfly, four stages, each replacing the pairs ``(x[i], x[i ^ 1])`` of the
lowest index bit by ``(x[i] + x[i ^ 1], x[i] - x[i ^ 1])`` and rotating the index bits right by
one (after four stages every bit has had its stage and the order is natural again); then each
element is multiplied by ``SIGNS[j] * 0.25`` (exact). For bf16 operands whose block
magnitudes span less than 2^12 every sum is exact, so the transform is the exact product.

``rht_fake_quant`` quantizes the transformed tensor to NVFP4 in 1 x 16 blocks along ``dim``
(the transform's blocks), the per-tensor scale from its amax, with stochastic rounding where
``backward`` (the draws from ``quantpatch_ops.sr_uniforms``, shaped as the result). In
``rht_matmul`` the first operand (the output gradient at the wgrad site) rounds
stochastically under ``backward``, the second (the layer's input) to nearest even.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .quantpatch_nvfp4 import nvfp4, sr_uniforms

RHT_BLOCK = 16
SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, 1, 1, -1, 1, -1, 1, 1)
"""The fixed sign vector ``s`` of the transform ``H16 @ diag(s) / 4`` (documented in
docs/formats.md): the same for every tensor and every step."""

_kernels_module: Any = None
_kernels_error: str | None = None


def _kernels() -> Any:
    """``quantpatch_rht_kernels`` beside this module, or None (the reason kept)."""
    global _kernels_module, _kernels_error
    if _kernels_module is None and _kernels_error is None:
        try:
            from . import quantpatch_rht_kernels
        except Exception as exc:  # no triton: the reference runs
            _kernels_error = f"{type(exc).__name__}: {exc}"
        else:
            _kernels_module = quantpatch_rht_kernels
    return _kernels_module


def _use_kernels(x: torch.Tensor) -> bool:
    """The fused kernel for CUDA tensors (and CPU tensors in Triton's interpreter with
    ``QUANTPATCH_KERNELS=triton``), as ``quantpatch_ops`` chooses its own kernels."""
    mode = os.environ.get("QUANTPATCH_KERNELS", "auto")
    if mode == "reference" or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if not x.is_cuda and (mode == "auto" or os.environ.get("TRITON_INTERPRET") != "1"):
        return False
    if _kernels() is None:
        if mode == "triton":
            raise RuntimeError(f"QUANTPATCH_KERNELS=triton, but {_kernels_error}")
        return False
    return True


def signs(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(SIGNS, dtype=torch.float32, device=device)


def butterfly16(v: torch.Tensor) -> torch.Tensor:
    """``H16 @ block`` of every 16-element block along the last dimension of float32 ``v``
    (whose length is a multiple of 16), in the documented order."""
    lead, n = v.shape[:-1], v.shape[-1]
    v = v.reshape(*lead, n // RHT_BLOCK, RHT_BLOCK)
    for _ in range(4):
        pairs = v.reshape(*lead, n // RHT_BLOCK, 8, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        # the sums take index bit 3 = 0, the differences bit 3 = 1: the bits rotate right
        v = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n // RHT_BLOCK, RHT_BLOCK)
    return v.reshape(*lead, n)


def _padded_last(x: torch.Tensor, dim: int) -> torch.Tensor:
    v = x.to(torch.float32).movedim(dim, -1)
    pad = (-v.shape[-1]) % RHT_BLOCK
    return torch.nn.functional.pad(v, (0, pad)) if pad else v


def rht(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The transform of ``x`` along ``dim`` (float32; ``dim`` zero-padded to a multiple of 16)."""
    v = _padded_last(x, dim)
    if v.shape[-1] == 0:
        return v.movedim(-1, dim)
    s = signs(v.device) * 0.25
    out = butterfly16(v).reshape(*v.shape[:-1], -1, RHT_BLOCK) * s
    return out.reshape(v.shape).movedim(-1, dim)


def inverse_rht(y: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """The inverse transform of float32 ``y`` along ``dim`` (``(y * s) @ H16 / 4`` per block:
    the transpose), cut back to the first ``n`` elements."""
    v = y.to(torch.float32).movedim(dim, -1)
    if v.shape[-1] == 0:
        return v[..., :n].movedim(-1, dim)
    s = signs(v.device)
    w = (v.reshape(*v.shape[:-1], -1, RHT_BLOCK) * s).reshape(v.shape)
    return (butterfly16(w) * 0.25)[..., :n].movedim(-1, dim)


def fake_quant_rht(x: torch.Tensor, dim: int = -1, *, backward: bool = False) -> torch.Tensor:
    """``quantpatch_ops.fake_quant(x, 'nvfp4-rht')``: the transformed, quantized values taken
    back through the inverse transform, so they compare with ``x`` element for element (the
    error a product sees: the transform is orthogonal); ``x``'s shape and dtype."""
    if x.dim() == 0:
        return fake_quant_rht(x.reshape(1), 0, backward=backward).reshape(())
    q = rht_fake_quant(x, dim, backward=backward).to(torch.float32)
    return inverse_rht(q, dim, x.shape[dim]).to(x.dtype)


def padded_shape(x: torch.Tensor, dim: int) -> torch.Size:
    shape = list(x.shape)
    shape[dim] += (-shape[dim]) % RHT_BLOCK
    return torch.Size(shape)


def rht_fake_quant(
    x: torch.Tensor, dim: int = -1, *, backward: bool = False, quantize: bool = True
) -> torch.Tensor:
    """``x`` transformed along ``dim`` and NVFP4 fake-quantized in the transform's blocks
    (stochastic rounding where ``backward``), in ``x``'s dtype; ``dim`` padded to a multiple
    of 16. ``quantize=False``: the transform alone (float32)."""
    if not quantize:
        return rht(x, dim)
    if x.dim() == 0:
        raise ValueError("the Hadamard transform needs a dimension to run along")
    rand = sr_uniforms(torch.empty(padded_shape(x, dim), device=x.device)) if backward else None
    if x.numel() == 0:
        return torch.empty(padded_shape(x, dim), dtype=x.dtype, device=x.device)
    if _use_kernels(x):
        out: torch.Tensor = _kernels_module.rht_nvfp4(x, dim, rand, signs(x.device))
        return out
    return reference_rht_fake_quant(x, dim, rand)


def reference_rht_fake_quant(x: torch.Tensor, dim: int, rand: torch.Tensor | None) -> torch.Tensor:
    """The PyTorch reference of ``rht_fake_quant`` (``rand``: the draws, or None for nearest
    even)."""
    t = rht(x, dim)
    return nvfp4(t, dim, False, rand).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: the RHT-quantized product. Backward: the unquantized product's gradients."""

    @staticmethod
    def forward(
        ctx: Any, a: torch.Tensor, b: torch.Tensor, backward: bool, quantize: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return _product(a, b, backward, quantize)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, Any, None, None]:
        a, b = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = torch.matmul(grad, b.transpose(-1, -2) if b.dim() > 1 else b)
        if ctx.needs_input_grad[1]:
            gb = torch.matmul(a.transpose(-1, -2), grad)
        return ga, gb, None, None


def _product(a: torch.Tensor, b: torch.Tensor, backward: bool, quantize: bool) -> torch.Tensor:
    bdim = -2 if b.dim() > 1 else -1
    qa = rht_fake_quant(a, -1, backward=backward, quantize=quantize)
    qb = rht_fake_quant(b, bdim, backward=False, quantize=quantize)
    out = torch.matmul(qa, qb)
    dtype = torch.promote_types(a.dtype, b.dtype)
    return out.to(dtype)


def rht_matmul(
    a: torch.Tensor, b: torch.Tensor, *, backward: bool = False, quantize: bool = True
) -> torch.Tensor:
    """``torch.matmul(a, b)`` with both operands transformed along the reduction dimension
    (the last of ``a``, the second to last of ``b``) and quantized to NVFP4 (``a`` with
    stochastic rounding under ``backward``); gradients, where autograd asks for them, are
    the unquantized product's (straight through, as for the other formats)."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        out: torch.Tensor = _StraightThrough.apply(a, b, backward, quantize)  # type: ignore[no-untyped-call]
        return out
    return _product(a, b, backward, quantize)
