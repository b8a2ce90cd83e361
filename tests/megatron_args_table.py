"""Regenerate ``tests/data/megatron-args-<release>.json`` from a Megatron-LM checkout.

The table holds what ``megatron/training/arguments.py``'s parser declares for each option
(option strings, dest, action kind, nargs, type name, const, default, choices): the facts the
start-up test needs to rebuild ``pretrain_gpt.py``'s argument namespace on CPU, where no
Megatron-LM training code can be installed (PyPI's megatron-core holds ``megatron/core`` only).
No Megatron source is copied.

    python tests/megatron_args_table.py /path/to/Megatron-LM core_v0.13.1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return repr(value)


def table(checkout: Path) -> list[dict[str, Any]]:
    sys.path.insert(0, str(checkout))
    sys.argv = ["pretrain_gpt.py"]
    captured: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_known_args

    def grab(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        captured.append(self)
        return original(self, *args, **kwargs)

    argparse.ArgumentParser.parse_known_args = grab  # type: ignore[method-assign]
    from megatron.training.arguments import parse_args

    parse_args()
    rows = []
    for action in captured[0]._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        rows.append(
            {
                "options": list(action.option_strings),
                "dest": action.dest,
                "kind": type(action).__name__,
                "nargs": action.nargs,
                "type": getattr(action.type, "__name__", None),
                "const": _plain(action.const),
                "default": _plain(action.default),
                "choices": _plain(list(action.choices)) if action.choices else None,
            }
        )
    return rows


if __name__ == "__main__":
    root, release = Path(sys.argv[1]), sys.argv[2]
    out = Path(__file__).with_name("data") / f"megatron-args-{release}.json"
    out.write_text(json.dumps(table(root), indent=0, sort_keys=True) + "\n")
    print(f"{out}: {len(json.loads(out.read_text()))} options")
