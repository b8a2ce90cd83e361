"""The checks that refuse a native scheme before anything is written (``launch/native.py``),
driven directly: the format and compute capabilities each recipe's flags need, the training
Python as the scripts choose it, ``nvidia-smi``'s answer read or not, and each refusal's
sentence with its advice followed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from quantpatch.base.errors import UserError
from quantpatch.launch import native
from quantpatch.launch.registry import Scheme


def _exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.parametrize(
    ("argv", "need"),
    [
        ([], None),
        (["--fp8-recipe", "tensorwise"], None),  # no format: no FP8 run at all
        (["--fp8-format", "hybrid"], ("FP8 delayed", (8, 9), None)),  # Megatron's default
        (["--fp8-format=e4m3", "--fp8-recipe=tensorwise"], ("FP8 tensorwise", (8, 9), None)),
        (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"], ("FP8 blockwise", (9, 0), None)),
        (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], ("MXFP8", (10, 0), (12, 0))),
        (["--fp4-format", "e2m1"], ("NVFP4", (10, 0), None)),
        (["--fp4-recipe=nvfp4"], ("NVFP4", (10, 0), None)),
        # the last word wins, as argparse takes it
        (
            ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-recipe=blockwise"],
            ("FP8 blockwise", (9, 0), None),
        ),
    ],
)
def test_each_recipes_format_and_compute_capabilities(argv, need):
    assert native.needs(argv) == need


def test_the_training_python_is_chosen_as_the_scripts_choose_it(tmp_path):
    env = {"PATH": str(tmp_path / "bin")}
    # no PYTHON and no torchrun on PATH: python3
    assert native.run_python(env) == ["python3"]
    # TORCHRUN's interpreter, from its first line
    _exe(tmp_path / "bin" / "torchrun", "#!/opt/venv/bin/python3.11 -E\nimport sys\n")
    assert native.run_python(env) == ["/opt/venv/bin/python3.11", "-E"]
    # a torchrun that is no Python script (a shell wrapper): python3
    _exe(tmp_path / "bin" / "torchrun", "#!/bin/sh\nexec python -m torch.distributed.run\n")
    assert native.run_python(env) == ["python3"]
    # one named by TORCHRUN, off PATH
    other = _exe(tmp_path / "other" / "tr", "#!/usr/bin/env python3\n")
    assert native.run_python({**env, "TORCHRUN": str(other)}) == ["/usr/bin/env", "python3"]
    # an unreadable torchrun reads as no first line
    other.chmod(0o100)
    if os.geteuid() != 0:  # root reads it anyway
        assert native.run_python({**env, "TORCHRUN": str(other)}) == ["python3"]
    # PYTHON wins over everything
    assert native.run_python({**env, "PYTHON": "/x/py -X dev"}) == ["/x/py", "-X", "dev"]


def test_compute_capabilities_as_nvidia_smi_gives_them(tmp_path):
    bin_ = tmp_path / "bin"
    env = {"PATH": str(bin_)}
    assert native.compute_capabilities(env) is None  # no nvidia-smi: cannot tell
    smi = bin_ / "nvidia-smi"
    _exe(smi, "#!/bin/sh\nprintf '9.0\\n8.0\\n'\n")
    assert native.compute_capabilities(env) == [(9, 0), (8, 0)]
    for answer in ("'No devices were found\\n'", "''", "'9.x\\n'"):
        _exe(smi, f"#!/bin/sh\nprintf {answer}\n")
        assert native.compute_capabilities(env) is None
    _exe(smi, "#!/bin/sh\nprintf '9.0\\n'\nexit 9\n")  # failed: its answer is not read
    assert native.compute_capabilities(env) is None
    _exe(smi, "no shebang: exec fails\n")
    assert native.compute_capabilities(env) is None


def _native(name: str, flags: tuple[str, ...]) -> Scheme:
    return Scheme(name, "bf16", "bf16", "bf16", native=True, emulates="x", emulated_flags=flags)


TENSORWISE = _native(
    "native_tensorwise_hybrid", ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
)
MXFP8 = _native("native_mxfp8_e4m3", ("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"))


def _machine(tmp_path: Path, te: bool, caps: str | None) -> dict[str, str]:
    """A PATH whose python3 has TransformerEngine or not, and an nvidia-smi answering caps."""
    bin_ = tmp_path / "bin"
    code = 0 if te else 3
    _exe(bin_ / "python3", f"#!/bin/sh\nexit {code}\n")
    if caps is not None:
        _exe(bin_ / "nvidia-smi", f"#!/bin/sh\nprintf '{caps}'\n")
    return {"PATH": str(bin_)}


def test_no_native_scheme_nothing_is_asked(tmp_path):
    plain = Scheme("bf16", "bf16", "bf16", "bf16")
    native.refuse_unrunnable([plain], tmp_path, {"PATH": ""}, gpus=[])  # no TE layers: fine


def test_a_checkout_without_te_layers_is_refused(tmp_path):
    env = _machine(tmp_path, te=True, caps="9.0\n")
    with pytest.raises(UserError) as err:
        native.refuse_unrunnable([TENSORWISE], tmp_path, env, gpus=[])
    assert str(err.value).startswith("native_tensorwise_hybrid: native schemes run ")
    assert native.TE_LAYERS in str(err.value)
    # the advice followed: the checkout gets Megatron's TE layers
    (tmp_path / native.TE_LAYERS).parent.mkdir(parents=True)
    (tmp_path / native.TE_LAYERS).write_text("")
    native.refuse_unrunnable([TENSORWISE], tmp_path, env, gpus=[])


def test_no_transformer_engine_in_the_training_python_is_refused(tmp_path):
    env = _machine(tmp_path, te=False, caps=None)
    with pytest.raises(UserError) as err:
        native.refuse_unrunnable([TENSORWISE], None, env)
    text = str(err.value)
    assert "need TransformerEngine, which the training Python" in text
    assert f"({tmp_path / 'bin' / 'python3'}" not in text and "(python3," in text
    # the advice followed: PYTHON names a Python that has it
    good = _exe(tmp_path / "te" / "python", "#!/bin/sh\nexit 0\n")
    native.refuse_unrunnable([TENSORWISE], None, {**env, "PYTHON": str(good)})
    # a Python that cannot be started reads as one without TE
    with pytest.raises(UserError):
        native.refuse_unrunnable([TENSORWISE], None, {**env, "PYTHON": str(tmp_path / "none")})


def test_a_gpu_without_the_format_is_refused_and_the_advised_gpu_accepted(tmp_path):
    env = _machine(tmp_path, te=True, caps="8.0\n9.0\n")
    native.refuse_unrunnable([TENSORWISE], None, env)  # gpus None: the machine is not asked
    with pytest.raises(UserError) as err:
        native.refuse_unrunnable([TENSORWISE], None, env, gpus=["0"])
    assert "GPU 0 of this machine is 8.0; choose GPUs 1 with --gpus" in str(err.value)
    native.refuse_unrunnable([TENSORWISE], None, env, gpus=["1"])  # the advice followed
    # MXFP8 is below 12.0 only; no GPU of this machine has it
    env = _machine(tmp_path, te=True, caps="12.0\n9.0\n")
    with pytest.raises(UserError) as err:
        native.refuse_unrunnable([MXFP8], None, env, gpus=[], choose="with CUDA_VISIBLE_DEVICES")
    text = str(err.value)
    assert "10.0 or higher and below 12.0, and GPU 0 of this machine is 12.0" in text
    assert "run it on a machine with such GPUs (or --launcher slurm)" in text
    # a native scheme with no low-precision recipe needs no particular GPU
    bf16 = _native("native_bf16", ())
    native.refuse_unrunnable([bf16], None, env, gpus=[])
    # nvidia-smi cannot tell: not refused here (the run's own TE says so)
    (tmp_path / "bin" / "nvidia-smi").unlink()
    native.refuse_unrunnable([MXFP8], None, env, gpus=[])


def test_visible_gpus_are_indices_only():
    assert native.visible_gpus({}) == []
    assert native.visible_gpus({"CUDA_VISIBLE_DEVICES": "1, 3,GPU-abc"}) == ["1", "3"]
