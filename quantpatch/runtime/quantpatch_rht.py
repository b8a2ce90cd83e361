"""Random Hadamard transform (RHT) for the weight-gradient GEMM, NVIDIA's NVFP4 recipe.

Installed by ``quantpatch init`` as ``megatron/core/quantpatch/quantpatch_rht.py`` beside
``quantpatch_ops.py``, which hands it the products of the value ``nvfp4-rht``; depends on
torch and the standard library only (the fused kernel in ``quantpatch_rht_kernels.py`` needs
triton). Public API::

    rht(x, dim=-1) -> Tensor                      # x's dtype; x.shape[dim] % 16 == 0
    rht_fake_quant(x, dim=-1, *, backward=False) -> Tensor
    rht_matmul(a, b, *, backward=False, quantize=True) -> Tensor

The transform is TransformerEngine 2.20.2's (``NVFP4QuantizerRef._apply_rht`` with
``get_wgrad_sign_vector`` in ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``),
bit for bit: the reduction dimension is cut into blocks of 16 and every block, a row vector
``v``, becomes ``v @ M`` with ``M = diag(SIGNS) @ H16 * (1/4)`` (the signs applied before the
Hadamard), ``H16`` the 16 x 16 Hadamard matrix of Sylvester's construction (``H1 = [1]``,
``H2n = [[Hn, Hn], [Hn, -Hn]]``) and ``SIGNS`` TE's fixed sign vector below. ``M`` is
orthogonal, so transforming both operands of a GEMM along its reduction dimension leaves the
product unchanged in exact arithmetic, while a block outlier is spread over its 16 elements
before NVFP4 quantizes them.

Arithmetic, as TE computes it (``x_mat @ (H * 0.25)`` in ``x``'s dtype): each output
``out[j] = sum_i v[i] * M[i, j]``, the products exact, accumulated in float32 in index order
``i = 0..15`` from 0 and rounded once to ``x``'s dtype. That is TE's reference bit for bit on
CPU (measured on 2^20 values, fp32 and bf16 inputs); for bf16 inputs whose block magnitudes
span less than 2^12 every float32 partial sum is exact, so any accumulation order (a GPU's
GEMM) gives the same bf16 result. The transformed tensor is in ``x``'s dtype (bf16 inputs:
rounded to bf16) before its amax and the NVFP4 cast, as in TE.

The length along the reduction dimension must be a multiple of 16: TE's reference refuses
another length (``Inner dimension ... must be divisible by hadamard dimension 16``), and so
does this module, with a ``ValueError`` naming the shape; nothing is padded.

``rht_fake_quant`` quantizes the transformed tensor to NVFP4 in 1 x 16 blocks along ``dim``
(the transform's blocks), the per-tensor scale from its amax, with stochastic rounding where
``backward`` (8 random bits per element from ``quantpatch_ops.sr_bits``). In ``rht_matmul``
the first operand (the output gradient at the wgrad site) rounds stochastically under
``backward``, the second (the layer's input) to nearest even.
"""

from __future__ import annotations

from typing import Any

import torch

from . import quantpatch_env as env
from . import quantpatch_formats as formats
from .quantpatch_nvfp4 import nvfp4, nvfp4_factored, sr_bits, tensor_decode
from .quantpatch_quantize import factored_product, factors, require_capability

RHT_BLOCK = 16
_VALUE = formats.names(family="nvfp4", rht=True)[0]
"""The value this module computes, and the operand format its transformed operands take."""
_OPERAND = formats.names(family="nvfp4", rht=False, tiled=False)[0]
SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""TE's fixed sign vector ``s`` (``get_wgrad_sign_vector``) of the transform
``diag(s) @ H16 / 4`` (documented in docs/formats.md): the same for every tensor and step."""

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
    mode = env.kernels()
    if mode == "reference" or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if not x.is_cuda and (mode == "auto" or not env.triton_interpret()):
        return False
    if x.is_cuda:
        require_capability(x.device)
    if _kernels() is None:
        if mode == "triton":
            raise RuntimeError(f"QUANTPATCH_KERNELS=triton, but {_kernels_error}")
        return False
    return True


def signs(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(SIGNS, dtype=torch.float32, device=device)


def hadamard16(device: torch.device | str = "cpu") -> torch.Tensor:
    """``H16`` (float32) by Sylvester's construction."""
    h = torch.ones((1, 1), dtype=torch.float32, device=device)
    while h.shape[0] < RHT_BLOCK:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def transform_matrix(device: torch.device | str = "cpu") -> torch.Tensor:
    """``M = diag(SIGNS) @ H16 * (1/4)`` (float32, every entry +-1/4)."""
    return signs(device)[:, None] * hadamard16(device) * 0.25


def butterfly16(v: torch.Tensor) -> torch.Tensor:
    """``H16 @ block`` of every 16-element block along the last dimension of float32 ``v``
    (whose length is a multiple of 16): four stages, each replacing the pairs of the lowest
    index bit by their sum and difference and rotating the index bits right by one."""
    lead, n = v.shape[:-1], v.shape[-1]
    v = v.reshape(*lead, n // RHT_BLOCK, RHT_BLOCK)
    for _ in range(4):
        pairs = v.reshape(*lead, n // RHT_BLOCK, 8, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        # the sums take index bit 3 = 0, the differences bit 3 = 1: the bits rotate right
        v = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n // RHT_BLOCK, RHT_BLOCK)
    return v.reshape(*lead, n)


def check_length(x: torch.Tensor, dim: int) -> None:
    """Refuse a reduction length that is not a multiple of 16, naming the shape."""
    n = x.shape[dim] if x.dim() else 1
    if n % RHT_BLOCK:
        raise ValueError(
            f"{_VALUE} transforms blocks of 16 along the reduction dimension, but the tensor "
            f"of shape {tuple(x.shape)} has {n} there (dim {dim}), not a multiple of 16, which "
            f"TransformerEngine refuses too."
        )


def rht(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The transform of ``x`` along ``dim`` in ``x``'s dtype (float32 accumulation in index
    order, rounded once; see the module docstring); the length must be a multiple of 16."""
    check_length(x, dim)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = x.to(acc_dtype).movedim(dim, -1)
    if v.shape[-1] == 0:
        return v.to(x.dtype).movedim(-1, dim)
    blocks = v.reshape(*v.shape[:-1], -1, RHT_BLOCK)
    m = transform_matrix(x.device).to(acc_dtype)
    acc = torch.zeros_like(blocks)
    for i in range(RHT_BLOCK):
        acc = acc + blocks[..., i : i + 1] * m[i]  # the product is exact
    return acc.reshape(v.shape).to(x.dtype).movedim(-1, dim)


def inverse_rht(y: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse transform of ``y`` along ``dim`` (``y @ M.T`` per block: ``H16 @ y / 4``
    times the signs), float32, by the butterfly."""
    v = y.to(torch.float32).movedim(dim, -1)
    if v.shape[-1] == 0:
        return v.movedim(-1, dim)
    out = butterfly16(v).reshape(*v.shape[:-1], -1, RHT_BLOCK) * (signs(v.device) * 0.25)
    return (out.reshape(v.shape) + 0.0).movedim(-1, dim)  # + 0: an exact cancellation is +0


def fake_quant_rht(x: torch.Tensor, dim: int = -1, *, backward: bool = False) -> torch.Tensor:
    """``quantpatch_ops.fake_quant(x, 'nvfp4-rht')``: the transformed, quantized values taken
    back through the inverse transform, so they compare with ``x`` element for element (the
    error a product sees: the transform is orthogonal); ``x``'s shape and dtype."""
    if x.dim() == 0:
        return fake_quant_rht(x.reshape(1), 0, backward=backward).reshape(())
    q = rht_fake_quant(x, dim, backward=backward)
    return inverse_rht(q, dim).to(x.dtype)


def rht_fake_quant(
    x: torch.Tensor, dim: int = -1, *, backward: bool = False, quantize: bool = True
) -> torch.Tensor:
    """``x`` transformed along ``dim`` and NVFP4 fake-quantized in the transform's blocks
    (stochastic rounding where ``backward``), in ``x``'s dtype; the length along ``dim`` must
    be a multiple of 16. ``quantize=False``: the transform alone."""
    if x.dim() == 0:
        raise ValueError("the Hadamard transform needs a dimension to run along")
    check_length(x, dim)
    if not quantize:
        return rht(x, dim)
    bits = sr_bits(x) if backward else None
    if x.numel() == 0:
        return torch.empty_like(x)
    if _use_kernels(x):
        out: torch.Tensor = _kernels_module.rht_nvfp4(x, dim, bits, transform_matrix(x.device))
        return out
    return reference_rht_fake_quant(x, dim, bits)


def rht_factored(
    x: torch.Tensor, dim: int = -1, *, backward: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rht_fake_quant`` with the tensor's scale factored out: ``(t, f)``, ``t`` the
    transformed tensor's codes times their block scales in ``x``'s dtype (exact), ``f`` the
    per-tensor float32 factor the product's result takes (``quantpatch_quantize``'s section
    on factored operands)."""
    check_length(x, dim)
    bits = sr_bits(x) if backward else None
    if x.numel() == 0:
        return torch.empty_like(x), torch.ones((), dtype=torch.float32, device=x.device)
    if _use_kernels(x):
        amax: list[torch.Tensor] = []
        out = _kernels_module.rht_nvfp4(x, dim, bits, transform_matrix(x.device), amax)
        return out, tensor_decode(amax[0])
    return nvfp4_factored(rht(x, dim), dim, False, bits)


def reference_rht_fake_quant(x: torch.Tensor, dim: int, bits: torch.Tensor | None) -> torch.Tensor:
    """The PyTorch reference of ``rht_fake_quant`` (``bits``: 8 random bits per element, or
    None for nearest even)."""
    return nvfp4(rht(x, dim), dim, False, bits).to(x.dtype)


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


def _fused(a: torch.Tensor, b: torch.Tensor, backward: bool) -> torch.Tensor | None:
    """The quantized product through the fused GEMM (``quantpatch_weights``' choice, as for
    every value whose entry says ``fused_gemm``), or None where the separate path computes it.
    The transform cannot join the GEMM's tile loop: NVFP4's per-tensor scale is the amax of
    the *transformed* operand, known only after a pass over all of it, so both operands are
    transformed first (in their dtype, as the separate path's kernel rounds them) and the
    NVFP4 GEMM quantizes the transformed tiles as it loads them; the random bits of the first
    operand's stochastic rounding are drawn in the separate path's order (it alone draws)."""
    mode = env.gemm()
    if mode == "separate" or (mode == "auto" and (backward or not a.is_cuda)) or b.dim() < 2:
        return None  # auto never fuses stochastic rounding, nor on CPU: not worth transforming
    check_length(a, -1)
    check_length(b, -2)
    from .quantpatch_weights import fused_product

    return fused_product(rht(a, -1), rht(b, -2), _VALUE, backward, False, _OPERAND, _OPERAND)


def _product(a: torch.Tensor, b: torch.Tensor, backward: bool, quantize: bool) -> torch.Tensor:
    fused = _fused(a, b, backward) if quantize else None
    if fused is not None:
        return fused.to(torch.promote_types(a.dtype, b.dtype))
    bdim = -2 if b.dim() > 1 else -1
    if quantize and a.dtype == b.dtype and factors(_VALUE, a.dtype):
        fa = rht_factored(a, -1, backward=backward)
        fb = rht_factored(b, bdim, backward=False)
        with torch.no_grad():  # straight through: _StraightThrough's backward, not this
            return factored_product(a, b, fa, fb)
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
