"""Writing launch scripts as shell: the Jinja environment over ``templates/``, the one quoting
filter, the shell expressions quantpatch itself writes, and the default rendezvous port of a
run. Shared by the Megatron scripts (``scripts``) and the ms-swift ones (``swift``).
"""

from __future__ import annotations

import hashlib
import shlex
from functools import cache
from importlib import resources
from pathlib import Path

import jinja2


def template_dir() -> Path:
    """``templates/`` inside the installed package, or beside it in a source checkout."""
    packaged = Path(str(resources.files("quantpatch"))) / "templates"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "templates"


class ShellExpr(str):
    """A value the template writes as it is: a shell expansion quantpatch itself wrote
    (``"$MICRO_BATCH_SIZE"``), never a user's text."""


BATCH_VARIABLES = {"micro-batch-size": "MICRO_BATCH_SIZE", "global-batch-size": "GLOBAL_BATCH_SIZE"}
"""Args a script takes from its environment (default: the profile's value), since they are
the ones people change with the layout."""


def shell_quote(value: object) -> str:
    """The one quoting filter: any value becomes one shell word, taken literally."""
    if isinstance(value, ShellExpr):
        return str(value)
    if isinstance(value, bool):
        value = int(value)
    text = str(value)
    quoted = shlex.quote(text)
    if quoted == text and "," in text:  # legal unquoted, but reads as a list (SC2054)
        quoted = f"'{text}'"
    return quoted


@cache
def template_environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = shell_quote
    return env


def master_port(run_name: str) -> int:
    """A default port per combination, so that jobs on one node do not collide by default."""
    return 6000 + int(hashlib.sha256(run_name.encode()).hexdigest(), 16) % 2000
