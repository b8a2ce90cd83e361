"""Rendering of plain results for people (rich tables); shared by the CLI and the demo."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from quantpatch.checkout.parts import PartStatus
from quantpatch.checkout.saver import SaverStatus
from quantpatch.checkout.switch import CheckReport
from quantpatch.sites.model import Site

NARROW = 120
"""Below this many columns the sites are listed, not tabled, so ``file:line`` stays whole."""


def _role(site: Site) -> str:
    """The role, with the GEMM of a linear site (``linear/wgrad``)."""
    return f"{site.role}/{site.gemm}" if site.gemm else site.role


def print_check(report: CheckReport, out: Console) -> None:
    """The site table, roles, git, base and saver lines of ``check``. On a narrow terminal
    each site is a line of its own (role, ``file:line``, value, form) with its function on
    the next, so that ``file:line`` is never cut."""
    if out.width < NARROW:
        out.print(f"custom_quant_type sites in {report.root}", markup=False)
        for s in report.sites:
            out.print(
                f"{_role(s):<6} {s.file}:{s.line}  {s.value or s.source} ({s.form})", markup=False
            )
            out.print(f"       in {s.function}", style="dim", markup=False)
    else:
        table = Table(title=f"custom_quant_type sites in {report.root}", title_justify="left")
        for col in ("role", "file:line", "function", "value", "form"):
            table.add_column(col, no_wrap=col != "function")
        for s in report.sites:
            table.add_row(_role(s), f"{s.file}:{s.line}", s.function, s.value or s.source, s.form)
        out.print(table)
    roles = "  ".join(f"{r}={v if v is not None else '?'}" for r, v in report.roles.items())
    out.print(f"roles: {roles}")
    if report.git:
        g = report.git
        head = g.head[:12] if g.head else "no commit"
        out.print(
            f"git: {g.branch or 'detached HEAD'} @ {head} ({'clean' if g.clean else 'dirty'})"
        )
    else:
        out.print("git: not a git repository")
    if report.base:
        b: dict[str, Any] = report.base.as_json()
        where = f"{b.get('branch') or 'detached'} @ {(b.get('commit') or '')[:12]}"
        out.print(
            f"base ({b['mode']}): {where}"
            if b["mode"] == "branch"
            else "base: in-place set active (originals kept under the state directory)"
        )
        if b.get("moved_to"):
            out.print(
                f"note: the base {b.get('branch')} moved on to {b['moved_to'][:12]} since this "
                "set; run set again to rebuild the scheme branch on it.",
                style="yellow",
            )
        if b.get("interrupted"):
            out.print(
                "note: a quantpatch command was interrupted; run set again, or restore.",
                style="yellow",
            )
    else:
        out.print("base: none (no set active)")
    out.print(f"tensor saver: {saver_line(report.saver)}")
    if report.parts:
        out.print(f"installed parts: {parts_line(report.parts)}", markup=False)
    for warning in report.warnings:
        out.print(f"warning: {warning}", style="yellow", markup=False)


def saver_line(saver: SaverStatus) -> str:
    if saver.installed and saver.replaced:
        return "installed (in place of the checkout's own)"
    if saver.installed:
        return "installed"
    if saver.other:
        return "a different tensor saver is installed (the checkout's own)"
    return "not installed"


def parts_line(parts: list[PartStatus]) -> str:
    """``ops current, kernels older, ...``; the first part not current says why."""
    line = ", ".join(f"{p.part} {p.status}" for p in parts)
    stale = [p for p in parts if p.status != "current"]
    if stale and stale[0].detail:
        line += f" ({stale[0].part}: {stale[0].detail})"
    return line
