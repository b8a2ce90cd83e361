"""Which attention path the runs of one set of launch scripts take.

A bf16 baseline compared with FA schemes must run the same attention kernel as they do, or a
report's step-time and memory columns compare kernels, not formats. ``gen-scripts`` and
``sweep run`` take ``--attention``:

* ``auto`` (default): every run takes the path of the set's FA schemes: ``flash`` when any
  scheme quantizes Q.K^T (the bf16 Q.K^T of the others, the baseline's included, goes through
  the same flash kernel, nothing quantized), else ``stock``;
* ``flash``: every run on quantpatch's flash kernel where its inputs allow it;
* ``stock``: every run on Megatron's unfused attention (the FA schemes' too).

The scripts export what the runtime reads (``quantpatch_ops.flash_refusal``):
``QUANTPATCH_FLASH`` (``auto``: the kernel for CUDA tensors; ``0``: never) and
``QUANTPATCH_FLASH_BF16`` (``1``: a bf16 Q.K^T takes the kernel too). A run's log says which
path it took (``[quantpatch] attention path: ...``, printed by the runtime) and what its script
asked for (``[quantpatch] attention: ...``); ``quantpatch runs`` shows both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quantpatch.base.errors import UserError
from quantpatch.launch.registry import Scheme

CHOICES = ("auto", "flash", "stock")


@dataclass(frozen=True)
class Attention:
    choice: str
    """What was asked: auto, flash or stock."""
    path: str
    """What every run of the set is to take: flash or stock."""
    why: str

    @property
    def flash(self) -> str:
        """``QUANTPATCH_FLASH``."""
        return "auto" if self.path == "flash" else "0"

    @property
    def flash_bf16(self) -> str:
        """``QUANTPATCH_FLASH_BF16``."""
        return "1" if self.path == "flash" else "0"

    def as_dict(self) -> dict[str, str]:
        return {"choice": self.choice, "path": self.path, "why": self.why}


def check_choice(choice: str) -> str:
    if choice not in CHOICES:
        raise UserError(f"--attention: unknown choice '{choice}'; valid: {', '.join(CHOICES)}.")
    return choice


def attention_for(choice: str, schemes: Sequence[Scheme]) -> Attention:
    """The path of every run of a set of schemes under ``choice``."""
    check_choice(choice)
    if choice != "auto":
        return Attention(choice, choice, f"--attention {choice}")
    fa = sorted({s.name for s in schemes if s.qk != "bf16"})
    if fa:
        return Attention(choice, "flash", f"auto: Q.K^T quantized by {', '.join(fa)}")
    return Attention(choice, "stock", "auto: no scheme quantizes Q.K^T")


FLASH_PARTS = ("ops", "flash", "sites")
"""The installed parts the flash path of every run needs at this version (the runtime's bf16
flash route, ``QUANTPATCH_FLASH_BF16``, and the attention site that asks it)."""


def refuse_older_runtime(checkout: object, attention: Attention) -> None:
    """Refused where the runs are to take the flash path and the checkout's runtime is older
    than that needs (set up by an earlier quantpatch, not upgraded: its bf16 Q.K^T takes the
    stock attention, and the record would say flash): ``quantpatch upgrade`` first."""
    if attention.path != "flash":
        return
    from quantpatch.base.config import load_targets
    from quantpatch.checkout.parts import parts_status
    from quantpatch.git import repo as gitrepo

    assert isinstance(checkout, gitrepo.Checkout)
    older = [
        p.part
        for p in parts_status(checkout, load_targets(checkout.root), set_active=False)
        if p.part in FLASH_PARTS and p.status == "older"
    ]
    if older:
        raise UserError(
            f"{checkout.root}: its installed {', '.join(older)} part(s) are older than the "
            f"flash attention path of these runs needs ({attention.why}; the installed runtime "
            "would run the bf16 baseline on stock attention): run `quantpatch upgrade` there "
            "first (or give --attention stock)."
        )
