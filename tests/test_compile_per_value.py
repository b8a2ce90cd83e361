"""``QUANTPATCH_COMPILE=1``: one compiled function per value and direction, each with a code
object of its own. Dynamo keeps at most ``recompile_limit`` (8) graphs per code object; every
value shared one (a lambda), so from the ninth value on it ran eagerly without a word.

Dynamo's bookkeeping is the same whatever backend turns its graphs into code, so these tests
compile with the ``eager`` backend (seconds, where inductor takes minutes on CPU), and make a
hit of the limit an error (``fail_on_recompile_limit_hit``): a value run eagerly fails them.
The inductor's results are compared bit for bit with the eager ones in
``tests/test_quant_ops.py::test_compiled_path_is_bit_identical``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

SCRIPT = """
import functools, sys, torch, torch._dynamo
torch.compile = functools.partial(torch.compile, backend="eager")
torch._dynamo.config.fail_on_recompile_limit_hit = True
limit = int(sys.argv[1])
if limit:
    torch._dynamo.config.recompile_limit = limit
from quantpatch.runtime import quantpatch_ops as ops
from quantpatch.runtime import quantpatch_quantize as qz
assert qz._COMPILE
x = (torch.randn(64, 96) * torch.logspace(-8, 8, 96)).to(torch.bfloat16)
x[0, 3] = float("nan")
values = [v.split(":") for v in sys.argv[2:]]
for fmt, direction in values:
    backward = direction == "backward"
    want = qz._fake_quant(x, fmt, -1, backward)
    got = ops.fake_quant(x, fmt, backward=backward)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), fmt
print("compiled", len(qz._COMPILED), "values")
"""


def _compiled(limit: int, values: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(limit), *values],
        capture_output=True,
        text=True,
        env={**os.environ, "QUANTPATCH_COMPILE": "1"},
        timeout=600,
    )


def test_each_value_and_direction_gets_one_function_with_its_own_code_object():
    """Made once and kept; compiled lazily (nothing is traced here)."""
    from quantpatch.runtime import quantpatch_quantize as qz

    keys = [(f, b) for f in ("mxfp8", "hifp8", "fp8-block") for b in (False, True)]
    made = [qz._compiled(f, b) for f, b in keys]
    assert [qz._compiled(f, b) for f, b in keys] == made
    codes = {fn._torchdynamo_orig_callable.__code__ for fn in made}  # type: ignore[attr-defined]
    assert len(codes) == len(keys)


@pytest.mark.slow  # about 10 s: torch and Dynamo in a subprocess
def test_each_value_has_its_own_compiled_code():
    """With the limit lowered to 1, a second value on a shared code object is a hit."""
    res = _compiled(1, ["mxfp8:forward", "hifp8:forward"])
    assert res.returncode == 0 and "compiled 2 values" in res.stdout, res.stderr[-3000:]


@pytest.mark.slow  # about 30 s of Dynamo tracing
def test_more_values_than_the_recompile_limit_all_run_compiled():
    values = [
        f"{fmt}:{direction}"
        for fmt in ("mxfp8", "mxfp4", "hifp8", "fp8-tensor", "fp8-block")
        for direction in ("forward", "backward")
    ]
    res = _compiled(0, values)  # Dynamo's own limit (8)
    assert res.returncode == 0 and "compiled 10 values" in res.stdout, res.stderr[-3000:]
