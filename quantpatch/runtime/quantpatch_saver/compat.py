"""The calling conventions of a fork's own ``tensor_saver.py``, mapped onto the saver's: the
keywords ``phase``, ``component`` and ``rank`` (recorded in the metadata), and the fork's
positional order after ``layer_idx`` (``phase, component, rank, metadata[,
attention_weights]``) beside quantpatch's (one ``metadata`` mapping). ``TensorSaver`` and
``get_tensor_saver()``, the fork's object API, are in ``tensor_saver.py`` with the rest of
the API its callers use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FORK_ORDER = ("phase", "component", "rank", "metadata")


def caller_order(
    func: str, extra: tuple[Any, ...], keywords: dict[str, Any], order: tuple[str, ...]
) -> dict[str, Any]:
    """The keywords, completed by the positional arguments after ``layer_idx``: one mapping
    (or ``None``) there is quantpatch's ``metadata``; anything else is in the order of a
    fork's saver (``phase, component, rank, metadata[, attention_weights]``)."""
    if not extra:
        return keywords
    if len(extra) == 1 and (extra[0] is None or isinstance(extra[0], Mapping)):
        order = ("metadata",)
    if len(extra) > len(order):
        raise TypeError(f"{func}() got {len(extra)} positional arguments after layer_idx")
    out = dict(keywords)
    for name, value in zip(order, extra, strict=False):
        if out.get(name) is not None:
            raise TypeError(f"{func}() got multiple values for argument '{name}'")
        out[name] = value
    return out


def merged_metadata(
    metadata: Mapping[str, Any] | None, phase: Any, component: Any, rank: Any
) -> dict[str, Any]:
    out = dict(metadata or {})
    for key, value in (("phase", phase), ("component", component), ("rank", rank)):
        if value is not None:
            out[key] = value
    return out


def save_tensor_metadata(
    args: tuple[Any, ...],
    metadata: Mapping[str, Any] | None,
    phase: str | None,
    component: str | None,
    rank: int | None,
) -> dict[str, Any]:
    """The metadata of a ``save_tensor`` call, whichever order (the contract's or the
    fork's) its positional arguments after ``layer_idx`` follow."""
    return _call_metadata("save_tensor", args, metadata, phase, component, rank)


def linear_metadata(
    args: tuple[Any, ...],
    metadata: Mapping[str, Any] | None,
    phase: str | None,
    component: str | None,
    rank: int | None,
) -> dict[str, Any]:
    """The metadata of a ``save_linear_tensors`` call, in either order."""
    return _call_metadata("save_linear_tensors", args, metadata, phase, component, rank)


def _call_metadata(
    name: str,
    args: tuple[Any, ...],
    metadata: Mapping[str, Any] | None,
    phase: str | None,
    component: str | None,
    rank: int | None,
) -> dict[str, Any]:
    """The metadata of a call of ``name`` whose positional arguments after ``layer_idx``
    follow the contract's or the fork's order."""
    kw = caller_order(
        name,
        args,
        {"metadata": metadata, "phase": phase, "component": component, "rank": rank},
        FORK_ORDER,
    )
    return merged_metadata(kw["metadata"], kw["phase"], kw["component"], kw["rank"])


def attention_metadata(
    args: tuple[Any, ...],
    metadata: Mapping[str, Any] | None,
    phase: str | None,
    component: str | None,
    rank: int | None,
    attention_weights: Any,
) -> tuple[dict[str, Any], Any]:
    """The metadata of a ``save_attention_tensors`` call, in either order, and its attention
    probabilities (the fork's ``attention_weights``, which may come positionally last)."""
    kw = caller_order(
        "save_attention_tensors",
        args,
        {
            "metadata": metadata,
            "phase": phase,
            "component": component,
            "rank": rank,
            "attention_weights": attention_weights,
        },
        (*FORK_ORDER, "attention_weights"),
    )
    md = {"module_kind": "core_attention"}
    md.update(merged_metadata(kw["metadata"], kw["phase"], kw["component"], kw["rank"]))
    return md, kw["attention_weights"]
