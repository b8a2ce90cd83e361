"""The site record and role arithmetic, free of libcst so that cached reads stay light."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantpatch.base.config import GEMMS, ROLES
from quantpatch.base.edits import read_exact
from quantpatch.base.errors import UserError

SITE_ROLES = ("linear", "qk", "pv", "qk+pv", "unknown")


@dataclass(frozen=True)
class Site:
    """One assignment to ``custom_quant_type`` as the user sees it."""

    role: str
    """linear, qk, pv, qk+pv or unknown."""
    file: str
    """Relative to the checkout root, posix separators."""
    line: int
    """1-based line of the assignment."""
    function: str
    """Enclosing ``Class.function`` (``<module>`` at top level)."""
    value: str | None
    """The literal (or the environment default); ``None`` for a dynamic site."""
    form: str
    """literal, env, dynamic or label."""
    kind: str
    """literal, env or dynamic: how the value is written (``form`` says label instead)."""
    governs: tuple[str, ...]
    """The products (qk, pv, linear) of the dispatches this site governs."""
    source: str
    """The assignment's value as written."""
    knows: tuple[tuple[str, ...], ...] | None = None
    """For each dispatch this site governs, the values its branches are written for
    (``OPS_VALUES`` standing for those the checkout's ``quantpatch_ops.py`` declares);
    ``None`` where the site governs no dispatch or one that cannot be read."""
    knows_for: tuple[str, ...] = ()
    """The products of each dispatch in ``knows`` (``linear``, ``qk``, ``pv``, joined by ``+``
    where one dispatch holds several): a value is checked against the dispatches of its own
    role only."""
    gemm: str = ""
    """A linear site's GEMM: ``fprop``, ``dgrad`` or ``wgrad`` (empty: none, such as the
    constructor sites of ParetoQ's steps, which follow ``fprop``)."""

    @property
    def roles(self) -> tuple[str, ...]:
        """The contract roles (linear, qk, pv) this site's value feeds."""
        if self.role == "qk+pv":
            return ("qk", "pv")
        return (self.role,) if self.role in ROLES else ()

    def wanted(self, values: Mapping[str, str]) -> str | None:
        """The value ``values`` (keys: roles and GEMMs) gives this site, or None: a linear
        site takes its GEMM's value where one is given (a site of no GEMM the forward's),
        else the linear value."""
        if self.role == "linear":
            gemm = self.gemm or "fprop"
            return values.get(gemm, values.get("linear"))
        found = [values[r] for r in self.roles if r in values]
        return found[0] if found else None

    def as_json(self) -> dict[str, object]:
        return {
            "role": self.role,
            "gemm": self.gemm,
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "value": self.value,
            "form": self.form,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Site:
        knows = data.get("knows")
        if knows is not None:
            knows = tuple(tuple(str(v) for v in chain) for chain in knows)
        knows_for = tuple(str(v) for v in data.get("knows_for", ()))
        return cls(
            **{**data, "governs": tuple(data["governs"]), "knows": knows, "knows_for": knows_for}
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


POLICY_NAME = "quantpatch_bf16_layers"
RUNTIME_PACKAGE = "megatron.core.quantpatch"
"""The package the site code imports the runtime from (``init`` installs it as
``megatron/core/quantpatch/``; earlier releases put its modules in ``megatron.core``)."""
"""The module-level name whose string literal is the BF16 layer policy (``sites.policy``)."""


@dataclass(frozen=True)
class Policy:
    """The BF16 layer policy assignment of a linear file, as ``sites.policy.find_policy``
    finds it (here, free of libcst, so that the discovery cache can hold it)."""

    file: str
    line: int
    value: str | None
    """The literal's content; None where the assignment is not a string literal."""


def role_values(sites: Sequence[Site]) -> tuple[dict[str, str | None], dict[str, list[Site]]]:
    """The value of each role and of each linear GEMM (``None`` when it has no site or its
    sites disagree), and the sites of every role or GEMM whose sites disagree. The linear
    sites may differ from one GEMM to another (``set --fprop X --dgrad Y``): ``linear`` is
    then None but not a disagreement, as long as the sites of each GEMM agree (a site of no
    GEMM goes with ``fprop``)."""
    values: dict[str, str | None] = {}
    mismatched: dict[str, list[Site]] = {}
    for role in ROLES:
        members = [s for s in sites if role in s.roles and s.kind != "dynamic"]
        distinct = {s.value for s in members}
        if len(distinct) == 1:
            values[role] = distinct.pop()
        else:
            values[role] = None
            if len(distinct) > 1:
                mismatched[role] = members
    linear = [s for s in sites if s.role == "linear" and s.kind != "dynamic"]
    tagged = {s.gemm for s in linear} >= set(GEMMS)
    for gemm in GEMMS:
        members = [s for s in linear if (s.gemm or "fprop") == gemm] if tagged else []
        distinct = {s.value for s in members}
        values[gemm] = distinct.pop() if len(distinct) == 1 else values["linear"]
        if len(distinct) > 1:
            mismatched[gemm] = members
    if "linear" in mismatched and tagged and not any(g in mismatched for g in GEMMS):
        del mismatched["linear"]
    return values, mismatched


def read_target(root: Path, rel: str) -> str:
    text = read_exact(root / rel) if (root / rel).is_file() else None
    if text is None:
        raise UserError(f"{rel}: target file not found under {root}.")
    return text


def refuse_links(root: Path, rels: Sequence[str]) -> None:
    """Writing commands edit regular files only: writing through a symbolic link would
    change a file elsewhere, and replacing the link would break it."""
    for rel in rels:
        path = root / rel
        if path.is_symlink():
            raise UserError(
                f"{rel}: is a symbolic link (to {os.readlink(path)}); quantpatch edits regular "
                "files only: point the [tool.quantpatch] paths at the real file."
            )


# -- what a site's dispatch knows ---------------------------------------------------------------

OPS_VALUES = "<quantpatch_ops>"
"""In ``Site.knows``: a branch that hands the value to ``quantpatch_ops`` (``fmt=<site>``), so
every value the checkout's installed ``quantpatch_ops.py`` declares."""


@dataclass(frozen=True)
class OpsValues:
    """The values a checkout's ``quantpatch_ops.py`` declares: ``FORMATS``, and the bases
    of ``GROUPED_FORMATS`` that take a ``g<N>`` suffix (``w2g128``). ``readable`` False: the
    module is there but its tuples could not be read (then no value is refused for it)."""

    formats: frozenset[str] = frozenset()
    grouped: frozenset[str] = frozenset()
    readable: bool = True

    def declares(self, value: str) -> bool:
        if value in self.formats:
            return True
        base, sep, size = value.rpartition("g")
        return bool(sep) and base in self.grouped and size.isdigit() and int(size) > 0


NO_OPS = OpsValues()
"""A checkout without ``quantpatch_ops.py``: a branch that imports it cannot run."""


def _chains(site: Site, role: str | None) -> list[tuple[str, ...]]:
    """The dispatches of ``site`` that compute ``role``'s products (all of them where
    ``role`` is None or no dispatch is known to compute it)."""
    assert site.knows is not None
    if role is None or len(site.knows_for) != len(site.knows):
        return list(site.knows)
    mine = [c for c, f in zip(site.knows, site.knows_for, strict=True) if role in f.split("+")]
    return mine or list(site.knows)


def dispatch_knows(site: Site, value: str, ops: OpsValues, role: str | None = None) -> bool | None:
    """Whether every dispatch ``site`` governs (of ``role``'s products, where given) has a
    branch written for ``value``; None where that cannot be told (a label site, a dispatch
    that is not a plain chain of comparisons with literals, an unreadable ops module behind
    it)."""
    if site.knows is None:
        return None
    for chain in _chains(site, role):
        if value in chain:
            continue
        if OPS_VALUES in chain:
            if not ops.readable:
                return None
            if ops.declares(value):
                continue
        return False
    return True


def chain_values(site: Site, ops: OpsValues, role: str | None = None) -> list[str]:
    """The values every dispatch of ``site`` (of ``role``'s products) knows, for messages,
    the ops' own included."""
    common: set[str] | None = None
    for chain in _chains(site, role):
        values = {v for v in chain if v != OPS_VALUES}
        if OPS_VALUES in chain:
            values |= ops.formats | {f"{g}g<N>" for g in ops.grouped}
        common = values if common is None else common & values
    return sorted(common or ())


def unknown_to_dispatch(
    sites: Sequence[Site], values: Mapping[str, str], ops: OpsValues
) -> tuple[Site, str] | None:
    """The first site of a role in ``values`` whose dispatch (of that role's products) does
    not know that role's value: the site and the role (for a linear site the GEMM where
    ``values`` gives one), or None."""
    for site in sites:
        if site.role == "linear":
            key = next((k for k in (site.gemm or "fprop", "linear") if k in values), None)
            if key is not None and dispatch_knows(site, values[key], ops, "linear") is False:
                return site, key
            continue
        for role in site.roles:
            if role in values and dispatch_knows(site, values[role], ops, role) is False:
                return site, role
    return None


def unknown_sentence(site: Site, role: str, value: str, ops: OpsValues, where: str) -> str:
    """A sentence (without its full stop) naming the value, the site and what its
    dispatch does know."""
    known = ", ".join(chain_values(site, ops, role)) or "nothing"
    if ops.formats and any(OPS_VALUES in chain for chain in _chains(site, role)):
        # it hands values on to an installed ops module that lacks this one: an older one
        fix = "the installed quantpatch_ops.py is an earlier release's; 'quantpatch upgrade' "
        fix += "brings it to this version's values"
    else:
        fix = "'quantpatch init' teaches it the quantpatch values"
    return (
        f"{where}: the dispatch of the {site.role} site at {site.file}:{site.line} "
        f"({site.function}) knows {known}, not '{value}', which would silently run its "
        f"fallback branch; {fix}"
    )
