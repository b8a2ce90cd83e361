"""What ``quantpatch set`` was asked for, merged into one ``SetRequest``: a scheme's values,
``--linear`` over its GEMMs, each role named over both, and the BF16 layer policy
(``--bf16-layers``, else the scheme's, else the checkout's kept)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from quantpatch.base.config import GEMMS
from quantpatch.base.errors import UserError
from quantpatch.checkout.switch import SetRequest


@dataclass(frozen=True)
class SetOptions:
    """The options ``set`` was given."""

    linear: str | None = None
    fprop: str | None = None
    dgrad: str | None = None
    wgrad: str | None = None
    qk: str | None = None
    pv: str | None = None
    bf16_layers: str | None = None
    scheme: Mapping[str, str] | None = None
    """The values of the scheme named with ``--scheme`` (``Scheme.values``), None without."""
    dry_run: bool = False
    branch: bool = True
    split: bool = True
    allow_unknown: bool = False

    def named(self) -> dict[str, str]:
        """The roles and GEMMs named one by one."""
        given = {
            "linear": self.linear,
            "fprop": self.fprop,
            "dgrad": self.dgrad,
            "wgrad": self.wgrad,
            "qk": self.qk,
            "pv": self.pv,
        }
        return {k: v for k, v in given.items() if v is not None}


def set_request(options: SetOptions) -> SetRequest:
    """The request ``set`` runs: the scheme's values with the roles named over them
    (``--linear`` names all three GEMMs, so a scheme's own GEMMs give way to it); refused
    where nothing is named."""
    values = dict(options.scheme or {})
    if options.linear is not None:
        for gemm in GEMMS:
            values.pop(gemm, None)
    values.update(options.named())
    # the layer policy: --bf16-layers, else the scheme's (a scheme without one: none), else
    # the checkout's own is kept
    scheme_policy = values.pop("bf16_layers", "" if options.scheme is not None else None)
    policy = options.bf16_layers if options.bf16_layers is not None else scheme_policy
    if not values and policy is None:
        raise UserError(
            "nothing to set: give --linear, --fprop, --dgrad, --wgrad, --qk, --pv, "
            "--bf16-layers or --scheme."
        )
    return SetRequest(
        values, options.dry_run, options.branch, options.split, options.allow_unknown, policy
    )
