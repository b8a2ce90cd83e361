"""``quantpatch layout`` for people: the derived sizes as a rich table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from quantpatch.launch.layout import Layout


def print_layout(layout: Layout, out: Console) -> None:
    """``quantpatch layout``: the derived sizes as a table, then the one-line summary."""
    p = layout.plan
    table = Table(title="parallel layout", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value")
    rows = [
        ("world", f"{layout.world} = {p.nodes} node(s) x {p.gpus_per_node} GPUs"),
        ("TP / PP / CP", f"{p.tp} / {p.pp} / {p.cp}"),
        ("DP", f"{layout.dp} = {layout.world} / ({p.tp} x {p.pp} x {p.cp})"),
        ("VPP", str(p.vpp)),
        ("sequence parallel", "on" if layout.sequence_parallel else "off"),
        (
            "batch",
            f"global {p.global_batch} = micro {p.micro_batch} x DP {layout.dp} x "
            f"{layout.grad_accum} accumulation step(s)",
        ),
        ("model", f"{p.layers} layers ({p.layers // p.pp} per pipeline stage), {p.heads} heads"),
    ]
    if p.query_groups is not None:
        rows.append(("query groups", f"{p.query_groups} ({p.query_groups // p.tp} per TP rank)"))
    if p.experts is not None:
        rows.append(
            (
                "experts",
                f"{p.experts} over EP {p.ep} ({p.experts // p.ep} per rank), expert TP "
                f"{p.expert_tp}, expert DP {layout.world // (p.ep * p.expert_tp * p.pp)}",
            )
        )
    for row in rows:
        table.add_row(*row)
    out.print(table)
    out.print(layout.line(), markup=False)
