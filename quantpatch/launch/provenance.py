"""Where a sweep's runs came from, for its report: the sweep (folder, dates, checkout,
launcher, Slurm job, layout, data and tokenizer) and each run (its scheme's values, source
commit, data prefix, tokenizer, GPUs, Slurm job and state), all from ``sweep.json`` and the
registry the sweep was made with."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from quantpatch.launch.sweep_record import SweepRecord, SweepRun

RUN_COLUMNS = [
    "run", "state", "scheme", "linear", "qk", "pv", "bf16 layers", "scheme args", "attention",
    "commit", "data", "tokenizer", "gpus", "slurm",
]  # fmt: skip


def _layout(record: SweepRecord) -> str | None:
    if not record.gpus_per_node:
        return None
    nodes = int(record.nodes or 1)
    return f"{nodes} node{'s' if nodes != 1 else ''} x {record.gpus_per_node} GPUs"


def header(sweep_dir: Path, record: SweepRecord) -> list[tuple[str, str]]:
    """The sweep's facts, one (label, text) a line."""
    sel = record.selection
    env = record.data_env
    launcher = record.launcher or "?"
    jobs = sorted({str(r.slurm_job) for r in record.runs if r.slurm_job})
    if jobs:
        launcher += f" (job array{'s' if len(jobs) > 1 else ''} {', '.join(jobs)})"
    mock = is_mock(record)
    data = (
        "mock data (MOCK_DATA=1: Megatron's --mock-data, no dataset)"
        if mock
        else env.get("DATA_PREFIX") or env.get("DATA_ROOT") or "the registry's prefixes"
    )
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    lines = [
        ("sweep", str(sweep_dir.resolve())),
        ("created", record.created or "?"),
        ("report written", stamp),
        ("checkout", record.checkout if "checkout" in record.keys else "?"),
        ("launcher", launcher),
        (
            "profile",
            (sel.profile or "?") + (f", {lay}" if (lay := _layout(record)) else ""),
        ),
        ("data", data),
        (
            "tokenizer",
            "none (mock data: Megatron's NullTokenizer)"
            if mock
            else env.get("TOKENIZER_MODEL") or "each model's own (tokenizer_model)",
        ),
    ]
    if sel.config:
        lines.append(("config", sel.config))
    lines += _made_from(record)
    lines.append(("step times", EMULATION))
    return lines


EMULATION = (
    "emulation's, not the format's: each quantized product is quantized and dequantized in "
    "software and multiplied in BF16, so step times say what the emulation costs, and losses "
    "what the format's numerics do"
)
HYPERPARAMETERS = (
    "seq-length", "global-batch-size", "micro-batch-size", "train-iters", "lr", "min-lr",
    "lr-decay-style", "lr-warmup-iters", "weight-decay", "clip-grad", "adam-beta1",
    "adam-beta2", "num-layers", "eval-interval", "eval-iters", "seed",
)  # fmt: skip
"""The resolved arguments the header names (the profile's, with each model's own)."""


def _made_from(record: SweepRecord) -> list[tuple[str, str]]:
    """quantpatch's version, the checkout's Megatron release and base commit, and each
    model's hyperparameters, as ``sweep run`` recorded them (nothing for an older record)."""
    from quantpatch import __version__

    made = record.provenance or {}
    lines = [
        (
            "quantpatch",
            f"{made.get('quantpatch', '?')} ran the sweep; {__version__} wrote this report",
        )
    ]
    if made:
        base = made.get("base") or {}
        commit = base.get("commit") or "?"
        branch = f" ({base['branch']})" if base.get("branch") else ""
        lines.append(
            ("Megatron-LM", f"{made.get('megatron') or '?'}; base commit {commit}{branch}")
        )
    for model, args in sorted((made.get("args") or {}).items()):
        shown = [f"{k} {_arg(args[k])}" for k in HYPERPARAMETERS if k in args]
        extra = " ".join(str(e) for e in record.selection.extra)
        text = ", ".join(shown) + (f"; then {extra}" if extra else "")
        lines.append((f"hyperparameters: {model}", text))
    return lines


def _arg(value: Any) -> str:
    if value is True:
        return "(on)"
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


DATA_COLUMNS = ["model", "dataset", "prefix", "documents", "tokens", ".bin sha256",
                "tokenizer", "fingerprint", "vocabulary"]  # fmt: skip


def data_rows(record: SweepRecord) -> list[dict[str, Any]]:
    """One row a dataset the runs read: its manifest's counts and hashes, the tokenizer it
    was made with, its fingerprint and vocabulary size (none for mock data)."""
    if is_mock(record):
        return []
    rows = []
    for c in (record.data or {}).get("checked") or []:
        m = c.get("manifest") or {}
        sha = (m.get("sha256") or {}).get("bin") if isinstance(m.get("sha256"), dict) else None
        rows.append(
            {
                "model": c.get("model"),
                "dataset": c.get("dataset"),
                "prefix": str(c.get("prefix")),
                "documents": m.get("documents"),
                "tokens": m.get("tokens"),
                ".bin sha256": _short_hash(sha),
                "tokenizer": str(c.get("tokenizer")),
                "fingerprint": _short_hash(m.get("tokenizer_hash")),
                "vocabulary": m.get("vocab_size"),
            }
        )
    return rows


def _short_hash(value: object) -> str:
    if not isinstance(value, str):
        return "-"
    return value.removeprefix("sha256:")[:16]


LEGEND_COLUMNS = ["value", "family", "forward", "gradient", "block", "weight block", "scale",
                  "rht", "rounding", "reference"]  # fmt: skip


def legend_rows(record: SweepRecord, schemes: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every value the sweep's schemes use, its row of the values table and the reference it
    is bit-identical to (``quantpatch.base.values``)."""
    from quantpatch.base.values import TEXT_COLUMNS, text_rows, value_table

    table = value_table()
    cells = {row[0]: dict(zip(TEXT_COLUMNS, row, strict=True)) for row in text_rows()}
    used: list[str] = []
    for r in record.runs:
        scheme = schemes.get(r.scheme)
        if scheme is None:
            continue
        for role, value in scheme.values().items():
            if role != "bf16_layers" and value in table and value not in used:
                used.append(value)
    rows = []
    for name in used:
        c = cells[name]
        rows.append(
            {
                "value": name,
                "family": c["family"],
                "forward": c["element_forward"],
                "gradient": c["element_gradient"],
                "block": c["block"],
                "weight block": c["weight_block"],
                "scale": c["scale"],
                "rht": c["rht"],
                "rounding": c["gradient_rounding"],
                "reference": table[name]["reference"] or "-",
            }
        )
    return rows


def bf16_layer_lines(record: SweepRecord, schemes: Mapping[str, Any]) -> list[str]:
    """Each scheme's BF16 layer policy resolved to each model's layer numbers (its
    ``num-layers`` under the profile), one line a scheme and model."""
    from quantpatch.base.config import bf16_layer_numbers, layer_ranges

    args = (record.provenance or {}).get("args") or {}
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    for r in record.runs:
        scheme = schemes.get(r.scheme)
        if scheme is None:
            continue
        policy = scheme.values().get("bf16_layers")
        model = r.model
        if not policy or (scheme.name, model) in seen:
            continue
        seen.add((scheme.name, model))
        layers = (args.get(model) or {}).get("num-layers")
        if not isinstance(layers, int):
            out.append(f"{scheme.name} ({model}): {policy} (the model's layers unknown)")
            continue
        numbers = bf16_layer_numbers(str(policy), layers)
        output = " and the output layer" if "output" in str(policy).split(",") else ""
        out.append(
            f"{scheme.name} ({model}, {layers} layers): {policy} = layers "
            f"{layer_ranges(numbers) or 'none'}{output} in BF16"
        )
    return out


def is_mock(record: SweepRecord) -> bool:
    """Whether the sweep's runs trained on mock data (as their scripts decided: ``MOCK_DATA``
    or the profile's default; a record made before ``mock`` was kept: the variable alone)."""
    data = record.data or {}
    if "mock" in data:
        return data["mock"] is True
    return (data.get("env") or {}).get("MOCK_DATA") == "1"


def _checked(record: SweepRecord) -> dict[tuple[str, str], Mapping[str, Any]]:
    found = (record.data or {}).get("checked") or []
    return {(str(c.get("model")), str(c.get("dataset"))): c for c in found}


def _linear(values: Mapping[str, str]) -> str:
    if "linear" in values:
        return values["linear"]
    gemms = [f"{g}={values[g]}" for g in ("fprop", "dgrad", "wgrad") if g in values]
    return " ".join(gemms) or "?"


def _slurm_cell(r: SweepRun) -> str:
    if not r.slurm_job:
        return "-"
    return f"{r.slurm_job}_{r.array_task}" + (f" {r.slurm_state}" if r.slurm_state else "")


def _data_cells(
    data: Mapping[str, Any] | None, mock: bool, env: Mapping[str, Any]
) -> tuple[str, str]:
    """A run's data and tokenizer cells: mock, the prefix and tokenizer checked, or what the
    environment named."""
    if mock:
        return "mock", "-"
    if data:
        return str(data["prefix"]), str(data["tokenizer"])
    return "-", str(env.get("TOKENIZER_MODEL", "-"))


def run_rows(record: SweepRecord, schemes: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row a run, keyed by ``RUN_COLUMNS``."""
    checked = _checked(record)
    env = record.data_env
    mock = is_mock(record)
    layout = _layout(record)
    choice = (record.attention or {}).get("choice")
    rows = []
    for r in record.runs:
        scheme = schemes.get(r.scheme)
        values: Mapping[str, str] = scheme.values() if scheme is not None else {}
        data, tokenizer = _data_cells(checked.get((r.model, r.dataset)), mock, env)
        rows.append(
            {
                "run": r.name,
                "state": r.state.value,
                "scheme": r.scheme,
                "linear": _linear(values) if values else "?",
                "qk": values.get("qk", "?"),
                "pv": values.get("pv", "?"),
                "bf16 layers": values.get("bf16_layers", "-"),
                # the scheme's own Megatron arguments (a native scheme: TE's recipe), as recorded
                "scheme args": " ".join(map(str, r.args or [])) or "-",
                # what the sweep asked for (the runs table says what each run's log names)
                "attention": f"{r.attention} (sweep: {choice})" if r.attention else "-",
                "commit": (r.commit or "")[:12] or "-",
                "data": data,
                "tokenizer": tokenizer,
                "gpus": r.gpus or layout or "-",
                "slurm": _slurm_cell(r),
            }
        )
    return rows
