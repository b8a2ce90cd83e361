"""Where a sweep's runs came from, for its report: the sweep (folder, dates, checkout,
launcher, Slurm job, layout, data and tokenizer) and each run (its scheme's values, source
commit, data prefix, tokenizer, GPUs, Slurm job and state), all from ``sweep.json`` and the
registry the sweep was made with."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RUN_COLUMNS = [
    "run", "state", "scheme", "linear", "qk", "pv", "bf16 layers", "attention", "commit", "data",
    "tokenizer", "gpus", "slurm",
]  # fmt: skip


def _layout(record: Mapping[str, Any]) -> str | None:
    layout = record.get("layout") or {}
    if not layout.get("gpus_per_node"):
        return None
    nodes = int(layout.get("nodes") or 1)
    return f"{nodes} node{'s' if nodes != 1 else ''} x {layout['gpus_per_node']} GPUs"


def header(sweep_dir: Path, record: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The sweep's facts, one (label, text) a line."""
    sel = record.get("selection") or {}
    env = (record.get("data") or {}).get("env") or {}
    launcher = str(record.get("launcher", "?"))
    jobs = sorted({str(r["slurm_job"]) for r in record["runs"] if r.get("slurm_job")})
    if jobs:
        launcher += f" (job array{'s' if len(jobs) > 1 else ''} {', '.join(jobs)})"
    mock = is_mock(record)
    data = (
        "mock data (MOCK_DATA=1: Megatron's --mock-data, no dataset)"
        if mock
        else env.get("DATA_PREFIX") or env.get("DATA_ROOT") or "the registry's prefixes"
    )
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    lay = _layout(record)
    lines = [
        ("sweep", str(sweep_dir.resolve())),
        ("created", str(record.get("created") or "?")),
        ("report written", stamp),
        ("checkout", str(record.get("checkout", "?"))),
        ("launcher", launcher),
        (
            "profile",
            str(sel.get("profile") or "?") + (f", {lay}" if (lay := _layout(record)) else ""),
        ),
        ("data", data),
        (
            "tokenizer",
            "none (mock data: Megatron's NullTokenizer)"
            if mock
            else env.get("TOKENIZER_MODEL") or "each model's own (tokenizer_model)",
        ),
    ]
    if sel.get("config"):
        lines.append(("config", str(sel["config"])))
    return lines


def is_mock(record: Mapping[str, Any]) -> bool:
    """Whether the sweep's runs trained on mock data (as their scripts decided: ``MOCK_DATA``
    or the profile's default; a record made before ``mock`` was kept: the variable alone)."""
    data = record.get("data") or {}
    if "mock" in data:
        return data["mock"] is True
    return (data.get("env") or {}).get("MOCK_DATA") == "1"


def _checked(record: Mapping[str, Any]) -> dict[tuple[str, str], Mapping[str, Any]]:
    found = (record.get("data") or {}).get("checked") or []
    return {(str(c.get("model")), str(c.get("dataset"))): c for c in found}


def _linear(values: Mapping[str, str]) -> str:
    if "linear" in values:
        return values["linear"]
    gemms = [f"{g}={values[g]}" for g in ("fprop", "dgrad", "wgrad") if g in values]
    return " ".join(gemms) or "?"


def run_rows(record: Mapping[str, Any], schemes: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row a run, keyed by ``RUN_COLUMNS``."""
    checked = _checked(record)
    env = (record.get("data") or {}).get("env") or {}
    mock = is_mock(record)
    layout = _layout(record)
    choice = (record.get("attention") or {}).get("choice")
    rows = []
    for r in record["runs"]:
        scheme = schemes.get(r.get("scheme"))
        values: Mapping[str, str] = scheme.values() if scheme is not None else {}
        data = checked.get((str(r.get("model")), str(r.get("dataset"))))
        slurm = ""
        if r.get("slurm_job"):
            slurm = f"{r['slurm_job']}_{r.get('array_task')}"
            if r.get("slurm_state"):
                slurm += f" {r['slurm_state']}"
        rows.append(
            {
                "run": r.get("name"),
                "state": r.get("state"),
                "scheme": r.get("scheme"),
                "linear": _linear(values) if values else "?",
                "qk": values.get("qk", "?"),
                "pv": values.get("pv", "?"),
                "bf16 layers": values.get("bf16_layers", "-"),
                # what the sweep asked for (the runs table says what each run's log names)
                "attention": f"{r['attention']} (sweep: {choice})" if r.get("attention") else "-",
                "commit": (r.get("commit") or "")[:12] or "-",
                "data": "mock" if mock else str(data["prefix"]) if data else "-",
                "tokenizer": (
                    "-"
                    if mock
                    else str(data["tokenizer"])
                    if data
                    else env.get("TOKENIZER_MODEL", "-")
                ),
                "gpus": r.get("gpus") or layout or "-",
                "slurm": slurm or "-",
            }
        )
    return rows
