"""The data a selection of runs reads, checked before any GPU time: ``gen-scripts`` warns and
``sweep run`` refuses (before it starts or submits anything) when a run's dataset is missing,
unreadable, or was tokenized with another tokenizer than the one its script passes. The same
resolution as the scripts' (``MOCK_DATA``, ``DATA_PREFIX``, ``DATA_ROOT``,
``TOKENIZER_MODEL`` from the environment first); the scripts check existence themselves too."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from quantpatch.base.errors import UserError
from quantpatch.data_prep.layout import Need, data_prefix, tokenizer_for
from quantpatch.launch.registry import Registry, load_registry


def needs(
    reg: Registry,
    models: Sequence[str],
    datasets: Sequence[str],
    profile: str,
    env: Mapping[str, str],
    config: Path | None = None,
) -> list[Need]:
    """Every distinct dataset the runs read; none where they train on mock data (``config``:
    the --config file the registry was read with, which the commands that make them name)."""
    if mock_data(reg, profile, env):
        return []
    chosen = env.get("DATA_ROOT")
    root = (
        str(Path(chosen).expanduser().resolve()) if chosen and not env.get("DATA_PREFIX") else None
    )
    out: dict[tuple[str, str], Need] = {}
    for model in models:
        m = reg.models[model]
        for dataset in datasets:
            prefix = data_prefix(reg.datasets[dataset].prefix, model, env)
            tokenizer = tokenizer_for(m.tokenizer_model, env)
            cfg = str(config) if config else None
            given = bool(env.get("TOKENIZER_MODEL"))
            need = Need(model, dataset, prefix, tokenizer, root, cfg, given)
            out.setdefault((str(prefix), tokenizer), need)
    return list(out.values())


def mock_data(reg: Registry, profile: str, env: Mapping[str, str]) -> bool:
    """Whether a profile's scripts train on mock data: ``MOCK_DATA`` from the environment,
    else the profile's default (``--mock-data``, Megatron's NullTokenizer: no dataset, no
    tokenizer, whatever ``DATA_ROOT`` or ``TOKENIZER_MODEL`` say)."""
    if profile not in reg.profiles:
        return False
    mock = env.get("MOCK_DATA") or ("1" if reg.profiles[profile].mock_data else "0")
    return mock == "1"


def problems(found: Sequence[Need]) -> list[str]:
    return [p for p in (n.problem() for n in found) if p is not None]


def _advice(found: Sequence[Need]) -> str:
    """What to do: the tokenizer fixes of data made with another tokenizer (the variable, the
    config override, preparing again), and for the rest, how to make or find it."""
    fixes = [f for f in (n.fixes() for n in found) if f is not None]
    rest = sorted({n.command() for n in found if n.problem() is not None and n.fixes() is None})
    parts = []
    if fixes:
        parts.append("; ".join(fixes))
    if rest:
        parts.append(
            f"make them with `{'`, `'.join(rest)}` (quantpatch data prepare --help), point "
            "DATA_ROOT / DATA_PREFIX at them, or set MOCK_DATA=1"
        )
    return "; ".join(parts)


def gen_warning(
    reg: Registry, models: Sequence[str], datasets: Sequence[str], profile: str, launcher: str
) -> str | None:
    """One warning line for ``gen-scripts`` where the scripts' data is not ready here."""
    import os

    if launcher == "swift":  # ms-swift reads its own datasets
        return None
    found = needs(reg, models, datasets, profile, os.environ)
    bad = problems(found)
    if not bad:
        return None
    return (
        f"the scripts' data is not ready on this machine: {'; '.join(bad)}; "
        f"{_advice(found)} before running them."
    )


def refuse_missing(
    config: Path | None,
    models: Sequence[str] | None,
    datasets: Sequence[str] | None,
    profile: str,
    env: Mapping[str, str],
) -> list[Need]:
    """``sweep run``'s check of every combination, before anything starts or is submitted;
    what it checked (none for mock data)."""
    reg = load_registry(config)
    if profile not in reg.profiles:
        return []  # the script generation refuses it with its own sentence
    found = needs(
        reg,
        reg.pick("models", list(models) if models else None),
        reg.pick("datasets", list(datasets) if datasets else None),
        profile,
        env,
        Path(config).resolve() if config else None,
    )
    bad = problems(found)
    if bad:
        raise UserError(f"the sweep's data is not ready: {'; '.join(bad)}; {_advice(found)}.")
    return found


DATA_VARS = ("DATA_ROOT", "DATA_PREFIX", "TOKENIZER_MODEL", "MOCK_DATA")
"""The variables that say which data and tokenizer the scripts read (templates/pretrain.sh.j2)."""


def data_vars(env: Mapping[str, Any]) -> dict[str, str]:
    """The data variables among those a sweep recorded for its runs (``SweepRecord.data_env``;
    none for an older record)."""
    return {k: str(v) for k, v in env.items() if k in DATA_VARS}
