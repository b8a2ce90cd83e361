"""FP8 delayed scaling, as TransformerEngine computes it (part of ``quantpatch_ops``; see its
docstring for the values): TE's ``DelayedScaling`` recipe, Megatron's default
``--fp8-recipe delayed``.

* ``fp8-delayed`` (``--fp8-format hybrid``): E4M3 for the forward operands (input, weight),
  E5M2 for the output gradient; ``fp8-delayed-e4m3`` (``--fp8-format e4m3``): E4M3 for all
  three.
* State per linear layer and operand (forward input, weight; backward output gradient): an
  amax history of ``--fp8-amax-history-len`` float32 entries and a float32 scale, 1.0 before
  the first update, kept in the layer's child module ``fp8_delayed`` (persistent buffers
  ``amax_history`` ``[len, 3]`` and ``scale`` ``[3]``: the layer's ``state_dict`` and Megatron's
  sharded checkpoint carry them, as TE keeps its ``_extra_state``).
* An operand is quantized with its current scale: ``q = fp8(clamp(x * scale))`` (the float32
  product rounded to nearest even, saturated at +-448 / +-57344 as TE's ``satfinite``
  conversion does), the result ``q * (1 / scale)`` in ``x``'s dtype. Its amax (max |x|, NaN
  left out and Inf taken in, as TE's cast kernels compute it) goes into ``amax_history[0]``
  (the max of what the step quantized), all-reduced (max) at once over the group Megatron gives
  TE: ``parallel_state.get_amax_reduction_group(with_context_parallel=True,
  tp_only_amax_red=...)``, i.e. TP x DP x CP, or TP x CP under ``--tp-only-amax-red``.
* The update, TE's fused kernel ``fused_amax_and_scale_update_after_reduction`` (the one TE runs
  by default on a GPU): with ``a`` the step's reduced amax, when ``a != 0`` the history rolls
  (``[0, h[2], ..., h[len-1], a]``); the amax taken is ``a`` (``most_recent``) or the max of
  ``h[1:]`` and ``a`` (``max``; 0 where the step's amax is 0); where it is finite and > 0 the
  scale becomes ``(fp8_max * 2^-margin) / amax`` in one float32 division, else the previous
  scale stays; an infinite scale becomes float32's max. (TE's unfused Python update,
  ``NVTE_UNFUSED_FP8_UPDATE=1``, differs in two points: it computes ``reciprocal(amax) *
  fp8_max``, another float32 for about 1 amax in 9, and it rolls the history at amax 0.)
* When: TE updates the forward operands' state when the forward of a step ends and the output
  gradient's when its backward ends, so step t quantizes with the scales from steps < t. Here
  the same update runs at the layer's next forward (next backward); what a step computes is the
  same. A weight is quantized on the first forward of an optimizer step and reused by the later
  micro-batches (TE's ``is_first_microbatch`` cache, which Megatron sets): those record no
  amax, so the weight's history does not roll for them. The backward (dgrad, wgrad) multiplies
  the input and weight as the forward quantized them (TE saves its FP8 operands): each forward
  leaves its scales in a queue the layer's backward takes them from, in order.
* History length, algorithm and margin are the run's Megatron flags, read from the layer's
  ``TransformerConfig`` (``fp8_amax_history_len``, ``fp8_amax_compute_algo``, ``fp8_margin``,
  ``tp_only_amax_red``; Megatron's defaults 1, ``most_recent``, 0 where a layer has no config).

* A forward in eval mode (``model.eval()``: Megatron's evaluation) quantizes with the current
  scales and records its amaxes without an update, as TE under ``torch.no_grad()``: they join
  the next training step's.

A delayed value needs a layer to keep its history: ``fake_quant`` (no layer), the attention
products (Q.K^T, P.V) and a linear product whose weight is not a layer's registered weight
refuse it with a ``ValueError``. Pipeline schedules (another micro-batch's forward between a
forward and its backward) are served by the queue; activation recomputation of such a layer is
not (TE copies the forward's state for the recomputed forward; here the recomputed forward
would queue its scales a second time).

Installed by ``quantpatch init`` beside ``quantpatch_ops.py``; torch and the standard library
only.
"""

from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from . import quantpatch_formats as formats
from .quantpatch_formats import ELEMENTS, Element
from .quantpatch_mx import round_element
from .quantpatch_quantize import factored_product, factors

Operand = tuple[torch.Tensor, "torch.Tensor | None"]
"""An operand as a product takes it: the fake-quantized tensor and None, or (bf16 and fp16
products) its codes and the float32 reciprocal of its scale, which multiplies the product's
float32 result (``quantpatch_quantize``'s section on factored operands)."""

DELAYED_FORMATS = formats.names(family="fp8-delayed")
_CURRENT = " or ".join(formats.names(family="fp8-tensor"))
"""The current-scaling value(s) a refusal of a delayed one points to."""
"""The delayed-scaling values, declared in the format spec (``fp8-delayed``: TE's
``Format.HYBRID``; ``fp8-delayed-e4m3``: ``Format.E4M3``)."""
INPUT, WEIGHT, GRAD = 0, 1, 2
"""The operands' columns in a layer's state (TE: forward input, weight; backward output
gradient)."""
ALGOS = ("most_recent", "max")
FLOAT32_MAX = torch.finfo(torch.float32).max


def is_delayed(fmt: str) -> bool:
    return fmt in DELAYED_FORMATS


@dataclass(frozen=True)
class DelayedRecipe:
    """TE's ``DelayedScaling`` as Megatron builds it from its flags."""

    hybrid: bool = True
    history_len: int = 1
    algo: str = "most_recent"
    margin: int = 0
    tp_only_amax_red: bool = False

    def __post_init__(self) -> None:
        if self.history_len < 1:
            raise ValueError(f"fp8_amax_history_len={self.history_len}; it must be >= 1")
        if self.algo not in ALGOS:
            raise ValueError(f"fp8_amax_compute_algo={self.algo!r}; expected most_recent or max")

    def element(self, operand: int) -> Element:
        return ELEMENTS["e5m2" if operand == GRAD and self.hybrid else "e4m3"]

    def fp8_max(self, operand: int) -> float:
        return float(self.element(operand)[2])

    def scaled_max(self, operand: int) -> torch.Tensor:
        """``fp8_max * 2^-margin`` as float32 (the kernel's ``scaled_max``)."""
        return torch.tensor(self.fp8_max(operand), dtype=torch.float32) * torch.pow(
            torch.tensor(2.0, dtype=torch.float32), -float(self.margin)
        )


def recipe_for(fmt: str, config: Any = None) -> DelayedRecipe:
    """The recipe of ``fmt`` with the history length, algorithm and margin of Megatron's
    ``TransformerConfig`` ``config`` (its defaults where ``config`` is None)."""
    if not is_delayed(fmt):
        raise ValueError(
            f"{fmt!r} is not a delayed-scaling value; expected one of {DELAYED_FORMATS}"
        )
    return DelayedRecipe(
        hybrid=formats.SPEC[fmt].grad_output == "e5m2",
        history_len=int(getattr(config, "fp8_amax_history_len", 1) or 1),
        algo=str(getattr(config, "fp8_amax_compute_algo", "most_recent") or "most_recent"),
        margin=int(getattr(config, "fp8_margin", 0) or 0),
        tp_only_amax_red=bool(getattr(config, "tp_only_amax_red", False)),
    )


# -- the arithmetic -------------------------------------------------------------------------------


def te_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as TE's cast kernels take it (``fmaxf``: NaN left out, Inf taken in), float32 0-d
    (0 for an empty tensor)."""
    v = x.detach().to(torch.float32).abs()
    if v.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.where(torch.isnan(v), torch.zeros_like(v), v).amax()


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, elem: Element) -> torch.Tensor:
    """``x`` quantized to ``elem`` under the float32 ``scale`` and dequantized with
    ``1 / scale``, in ``x``'s dtype; NaN and +-Inf pass through unchanged."""
    v = x.detach().to(torch.float32)
    finite = torch.isfinite(v)
    scale = scale.to(device=v.device, dtype=torch.float32)
    vmax = elem[2]
    p = torch.clamp(torch.where(finite, v, torch.zeros_like(v)) * scale, -vmax, vmax)
    q = round_element(p, elem)
    return torch.where(finite, q * torch.reciprocal(scale), v).to(x.dtype)


def codes_with_scale(x: torch.Tensor, scale: torch.Tensor, elem: Element) -> torch.Tensor:
    """The codes :func:`quantize_with_scale` multiplies by ``1 / scale``, in ``x``'s dtype
    (which holds them exactly: E4M3 and E5M2 in bf16 or fp16); NaN and +-Inf pass through."""
    v = x.detach().to(torch.float32)
    finite = torch.isfinite(v)
    scale = scale.to(device=v.device, dtype=torch.float32)
    vmax = elem[2]
    p = torch.clamp(torch.where(finite, v, torch.zeros_like(v)) * scale, -vmax, vmax)
    return torch.where(finite, round_element(p, elem), v).to(x.dtype)


def operand(x: torch.Tensor, scale: torch.Tensor, elem: Element, factored: bool) -> Operand:
    """``x`` under ``scale`` as a product takes it (:data:`Operand`)."""
    if factored:
        inv = torch.reciprocal(scale.to(device=x.device, dtype=torch.float32))
        return codes_with_scale(x, scale, elem), inv.reshape(())
    return quantize_with_scale(x, scale, elem), None


def update(
    history: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    algo: str,
    scaled_max: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's fused update after the reduction for the columns of ``history`` ``[len, n]`` and
    ``scale`` ``[n]`` (float32), ``amax`` ``[n]`` the step's reduced amaxes: the new history and
    scales (see the module's docstring)."""
    last = amax.to(torch.float32)
    length = history.shape[0]
    zero = torch.zeros_like(last)[None]
    rolled = torch.cat([zero, history[2:], last[None]]) if length > 1 else zero
    roll = last != 0
    window = torch.cat([history[1:], last[None]])
    window = torch.where(torch.isnan(window), torch.zeros_like(window), window)  # fmaxf
    if algo == "most_recent":
        chosen = last
    elif algo == "max":
        chosen = torch.where(roll, window.amax(dim=0), torch.zeros_like(last))
    else:
        raise ValueError(f"amax compute algorithm {algo!r}; expected most_recent or max")
    ok = torch.isfinite(chosen) & (chosen > 0)
    divided = torch.div(scaled_max.to(chosen.device).expand_as(chosen), chosen)
    new_scale = torch.where(ok, divided, scale)
    new_scale = torch.where(torch.isinf(new_scale), FLOAT32_MAX, new_scale)
    return torch.where(roll[None], rolled, history), new_scale


def settled_quantize(
    x: torch.Tensor, fmt: str, backward: bool = False, amax: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` as a delayed value quantizes it once its history holds ``x``'s own amax (``amax``:
    the whole tensor's where ``x`` is a sample of it; default :func:`te_amax`) under Megatron's
    defaults (history 1, ``most_recent``, margin 0): the scale the kernel's update gives a fresh
    state from that amax, i.e. current scaling's ``fp8_max / amax`` (1 where the amax is 0 or
    not finite). What ``quantpatch tensors formats`` measures for a delayed value; a training
    step quantizes with the scale of earlier steps instead."""
    recipe = recipe_for(fmt)
    operand = GRAD if backward else INPUT
    a = (te_amax(x) if amax is None else amax.to(torch.float32)).reshape(1).to(x.device)
    ones = torch.ones(1, dtype=torch.float32, device=x.device)
    _, scale = update(ones[None] * 0, ones, a, "most_recent", recipe.scaled_max(operand))
    return quantize_with_scale(x, scale[0], recipe.element(operand))


# -- a layer's state ------------------------------------------------------------------------------


class _Local(threading.local):
    backward: tuple[DelayedState, torch.Tensor, torch.Tensor] | None = None


_LOCAL = _Local()
_OPTIMIZER_STEPS = [0]
_HOOKED = [False]


def _count_step(*_: Any) -> None:
    _OPTIMIZER_STEPS[0] += 1


def _hook_optimizer() -> None:
    if not _HOOKED[0]:
        from torch.optim import optimizer

        optimizer.register_optimizer_step_post_hook(_count_step)
        _HOOKED[0] = True


class DelayedState(torch.nn.Module):
    """One linear layer's delayed-scaling state: ``amax_history`` ``[len, 3]`` and ``scale``
    ``[3]`` (float32; columns :data:`INPUT`, :data:`WEIGHT`, :data:`GRAD`)."""

    amax_history: torch.Tensor
    scale: torch.Tensor
    recipe: DelayedRecipe
    group: Any
    group_known: bool

    def __init__(self, recipe: DelayedRecipe, device: Any = None, group: Any = None) -> None:
        super().__init__()
        self.recipe = recipe
        self.register_buffer(
            "amax_history",
            torch.zeros(recipe.history_len, 3, dtype=torch.float32, device=device),
        )
        self.register_buffer("scale", torch.ones(3, dtype=torch.float32, device=device))
        self.group = group  # None: Megatron's amax reduction group, once it exists
        self.group_known = group is not None
        self.snapshots: collections.deque[torch.Tensor] = collections.deque()
        self._weight: tuple[tuple[Any, ...], Operand, torch.Tensor] | None = None
        self._merge_next = False  # an eval forward's amaxes wait for the next training step's
        self._register_load_state_dict_pre_hook(_fresh_where_missing, with_module=True)  # type: ignore[no-untyped-call]
        _hook_optimizer()

    # Megatron casts its model to bf16/fp16 (``module.bfloat16()``): the state stays float32
    def _apply(self, fn: Any, recurse: bool = True) -> DelayedState:
        device = fn(torch.zeros((), dtype=torch.float32)).device
        for name, buf in list(self._buffers.items()):
            if buf is not None:
                self._buffers[name] = buf.to(device=device)
        return self

    def reduction_group(self) -> Any:
        """The group the amaxes are all-reduced over (None: the default group, where
        ``torch.distributed`` runs without Megatron's parallel state)."""
        if not self.group_known:
            try:
                from megatron.core import parallel_state
            except ImportError:
                return None
            if not parallel_state.model_parallel_is_initialized():
                return None
            self.group = parallel_state.get_amax_reduction_group(
                with_context_parallel=True, tp_only_amax_red=self.recipe.tp_only_amax_red
            )
            self.group_known = True
        return self.group

    def _reduce(self, amax: torch.Tensor) -> torch.Tensor:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            group = self.reduction_group()
            if dist.get_world_size(group=group) > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    @torch.no_grad()
    def flush(self, columns: list[int]) -> None:
        """Run the update for ``columns`` (what the last step recorded; a no-op where it
        recorded nothing)."""
        cols = torch.tensor(columns, device=self.scale.device)
        history = self.amax_history[:, cols]
        scale = self.scale[cols]
        ops = [int(c) for c in columns]
        maxes = torch.stack([self.recipe.scaled_max(c) for c in ops]).to(scale.device)
        new_history, new_scale = update(history, scale, history[0], self.recipe.algo, maxes)
        self.amax_history[:, cols] = new_history
        self.scale[cols] = new_scale

    @torch.no_grad()
    def _record(self, amaxes: dict[int, torch.Tensor]) -> None:
        cols = sorted(amaxes)
        local = torch.stack([amaxes[c].to(self.scale.device) for c in cols])
        reduced = self._reduce(local.clone())
        idx = torch.tensor(cols, device=self.scale.device)
        self.amax_history[0, idx] = torch.maximum(self.amax_history[0, idx], reduced)

    def _weight_stamp(self, w: torch.Tensor) -> tuple[int, int, int]:
        base = w._base if w._base is not None else w
        return (_OPTIMIZER_STEPS[0], base._version, base.data_ptr())

    @torch.no_grad()
    def forward_operands(
        self, x: torch.Tensor, w: torch.Tensor, factored: bool = False
    ) -> tuple[Operand, Operand]:
        """A forward GEMM's input and weight quantized with the current scales (the weight
        once per optimizer step; ``factored``: as codes and their scales' reciprocals); their
        amaxes recorded, the scales queued for the backward."""
        if not self._merge_next:
            self.flush([INPUT, WEIGHT])
        self._merge_next = not self.training
        scale = self.scale.clone()
        xq = operand(x, scale[INPUT], self.recipe.element(INPUT), factored)
        amaxes = {INPUT: te_amax(x)}
        stamp = (*self._weight_stamp(w), factored)
        if self._weight is not None and self._weight[0] == stamp:
            # the cached weight keeps the scale it was quantized with, and records no amax
            wq, wscale = self._weight[1], self._weight[2]
        else:
            wscale = scale[WEIGHT]
            wq = operand(w, wscale, self.recipe.element(WEIGHT), factored)
            amaxes[WEIGHT] = te_amax(w)
            self._weight = (stamp, wq, wscale)
        self._record(amaxes)
        if self.training:
            self.snapshots.append(torch.stack([scale[INPUT], wscale]))
        return xq, wq

    @torch.no_grad()
    def dgrad_operands(
        self, grad: torch.Tensor, w: torch.Tensor, factored: bool = False
    ) -> tuple[Operand, Operand]:
        """The input-gradient GEMM's output gradient (current scale; amax recorded) and weight
        (as its forward quantized it)."""
        fwd = self.snapshots.popleft() if self.snapshots else self.scale[:2].clone()
        self.flush([GRAD])
        gscale = self.scale[GRAD].clone()
        gq = operand(grad, gscale, self.recipe.element(GRAD), factored)
        self._record({GRAD: te_amax(grad)})
        wq = operand(w, fwd[1], self.recipe.element(WEIGHT), factored)
        _LOCAL.backward = (self, fwd, gscale)
        return gq, wq


def _fresh_where_missing(
    module: DelayedState, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """A checkpoint without the state (saved under another value) loads as a fresh state."""
    for name, buf in module._buffers.items():
        if buf is not None and prefix + name not in state_dict:
            state_dict[prefix + name] = buf.detach().clone()


def state_of(weight: torch.Tensor) -> DelayedState | None:
    """The delayed-scaling state of the layer whose weight ``weight`` is (or views)."""
    base = weight._base if weight._base is not None else weight
    ref = getattr(base, "_quantpatch_delayed", None)
    return ref() if ref is not None else None


def add_delayed_state(module: Any, fmt: str) -> None:
    """Give a linear layer the state of ``fmt`` (child module ``fp8_delayed``, so its
    ``state_dict`` and Megatron's checkpoint hold it) and point its weight at it; a layer
    that is handed its weight at forward time (the output layer sharing the embedding's)
    points that weight at it before each forward."""
    weight = getattr(module, "weight", None)
    device = weight.device if isinstance(weight, torch.Tensor) else None
    state = DelayedState(recipe_for(fmt, getattr(module, "config", None)), device=device)
    module.add_module("fp8_delayed", state)
    if isinstance(weight, torch.Tensor):
        weight._quantpatch_delayed = weakref.ref(state)  # type: ignore[attr-defined]
    else:
        module.register_forward_pre_hook(_link_forward_weight, with_kwargs=True)


def _link_forward_weight(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
    weight = kwargs.get("weight")
    if isinstance(weight, torch.Tensor):
        base = weight._base if weight._base is not None else weight
        base._quantpatch_delayed = weakref.ref(module.fp8_delayed)  # type: ignore[attr-defined]


def _no_state(fmt: str, where: str) -> ValueError:
    return ValueError(
        f"{fmt} scales each operand from its layer's amax history, which {where} does not "
        f"keep; use it on the linear role, or {_CURRENT} (current scaling) here."
    )


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return q

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _through(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if x.requires_grad and torch.is_grad_enabled():
        out: torch.Tensor = _StraightThrough.apply(x, q)  # type: ignore[no-untyped-call]
        return out
    return q


def _product(a: torch.Tensor, b: torch.Tensor, qa: Operand, qb: Operand) -> torch.Tensor:
    if qa[1] is None and qb[1] is None:
        return torch.matmul(_through(a, qa[0]), _through(b, qb[0]))
    return factored_product(a, b, qa, qb)


def delayed_matmul(
    a: torch.Tensor, b: torch.Tensor, fmt: str, *, backward: bool, weight: str | None
) -> torch.Tensor:
    """A linear layer's product under a delayed value: the forward (``weight="b"``: ``input @
    weight.t()``), the input gradient (``backward``, ``weight="b"``: ``grad @ weight``) or the
    weight gradient (``backward``, no weight: ``grad.t() @ input``, right after its layer's
    input gradient). In bf16 and fp16 the operands are the codes, and the reciprocals of
    their scales multiply the float32 result (``quantpatch_quantize``'s factored operands)."""
    factored = a.dtype == b.dtype and factors(fmt, a.dtype)
    if not backward:
        state = state_of(b) if weight == "b" else None
        if state is None:
            raise _no_state(fmt, "this product (no layer weight)")
        aq, bq = state.forward_operands(a, b, factored)
        return _product(a, b, aq, bq)
    if weight == "b":
        state = state_of(b)
        if state is None:
            raise _no_state(fmt, "this product (no layer weight)")
        gq, wq = state.dgrad_operands(a, b, factored)
        return _product(a, b, gq, wq)
    pending = _LOCAL.backward
    if pending is None:
        raise _no_state(fmt, "a weight gradient without its layer's input gradient")
    state, fwd, gscale = pending
    gq = operand(a, gscale, state.recipe.element(GRAD), factored)
    xq = operand(b, fwd[0], state.recipe.element(INPUT), factored)
    return _product(a, b, gq, xq)


def refuse_delayed(fmt: str, where: str) -> None:
    """Raise the one-sentence refusal of a delayed value where no layer state is kept."""
    if is_delayed(fmt):
        raise _no_state(fmt, where)
