"""Every Triton launch of the runtime compiled for every supported GPU generation, on a CPU.

Usage::

    python benchmarks/kernel_resources.py                 # all cases; print the table
    python benchmarks/kernel_resources.py --write-doc     # ... and into docs/performance.md
    python benchmarks/kernel_resources.py --fast --json OUT.json   # a representative subset

The runtime's own entry points (``quantpatch_ops.fake_quant``, ``quant_matmul`` as the linear
layer's forward, dgrad and wgrad call it, ``quant_bmm``, ``quant_flash_attention`` forward and
backward, ``nvfp4-rht`` through the Hadamard kernels, the FP8 kernels) run over every value, the
three dtypes and the widths of the registered models (``quantpatch/data/models.toml``) with a
stand-in for Triton's CUDA driver: each launch is specialized exactly as on a GPU (argument
types, 16-byte alignment, integer specialization, constexprs, and every configuration the
autotuner would try), then handed to ``triton.compile`` for each generation instead of
launched. Triton's wheel ships ``ptxas``, so each launch ends as a cubin; ``ptxas -v`` gives
its registers and spills, Triton's metadata its shared memory, and the generation's limits the
occupancy those allow. Nothing is launched: the tensors are CPU tensors whose contents are
never read.

Distinct launches are deduplicated: one compilation per kernel, argument types, constexprs,
alignment and launch options. This runs in its own process (the kernels must be compiled, not
interpreted, so it must import Triton before anything sets ``TRITON_INTERPRET`` for it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- kernel-resources: begin -->", "<!-- kernel-resources: end -->"


@dataclass(frozen=True)
class Generation:
    """A GPU generation's limits per SM (CUDA's occupancy calculator's figures)."""

    cc: int
    name: str
    max_threads: int  # resident threads per SM
    smem: int  # shared memory per SM, bytes
    smem_block: int  # the most one block may take (opt-in), bytes
    regs: int = 65536
    max_blocks: int = 32


GENERATIONS = (
    Generation(80, "A100", 2048, 167936, 166912),
    Generation(86, "RTX 30xx / A40", 1536, 102400, 101376),
    Generation(89, "L4 / L40 / RTX 40xx", 1536, 102400, 101376),
    Generation(90, "H100 / H200", 2048, 233472, 232448),
    Generation(100, "B200 / GB200", 2048, 233472, 232448),
    Generation(120, "RTX 50xx / RTX PRO", 1536, 102400, 101376),
)
SUPPORTED_CC = tuple(g.cc for g in GENERATIONS)


@dataclass
class Launch:
    """One distinct specialization of a kernel, as the JIT would compile it."""

    kernel: str
    cc: int
    signature: dict[str, str]
    constants: dict[Any, Any]
    attrs: dict[Any, Any]
    options: dict[str, Any]
    fn: Any = field(repr=False, compare=False)
    count: int = 0  # the launches that asked for it

    def key(self) -> str:
        return repr(
            (self.kernel, self.cc, sorted(self.signature.items()),
             sorted(self.constants.items(), key=str), sorted(self.attrs.items(), key=str),
             sorted(self.options.items()))
        )  # fmt: skip

    def family(self) -> str:
        """The kernel, its launch options and constexprs (not alignment or argument types):
        the rows of the table."""
        tiles = {
            k: v for k, v in self.constants.items()
            if isinstance(k, tuple) and isinstance(v, int | float | bool)
        }  # fmt: skip
        return repr(
            (self.kernel, self.cc, sorted(tiles.items(), key=str), sorted(self.options.items()))
        )


# -- the stand-in for Triton's CUDA driver ---------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.launches: dict[str, Launch] = {}
        self.total = 0
        self.cc = 90

    def hook(self, *, key: Any, repr: str, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        self.total += 1
        options = {
            "num_warps": compile["num_warps"],
            "num_stages": compile["num_stages"],
            "num_ctas": compile["num_ctas"],
        }
        launch = Launch(
            kernel=fn.name,
            cc=self.cc,
            signature=dict(compile["signature"]),
            constants=dict(compile["constants"]),
            attrs=dict(compile["configs"][0]),
            options=options,
            fn=fn.jit_function,
        )
        known = self.launches.setdefault(launch.key(), launch)
        known.count += 1
        return True  # compiled later, for its generation; never launched


class _Driver:
    """What ``JITFunction.run`` and the autotuner ask of the active driver, for a GPU that is
    not there: device 0, stream 0, the target, and a benchmarker that launches each
    configuration once (the launch is recorded, not run) and calls them all equally fast."""

    def __init__(self) -> None:
        self.target: Any = None

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_benchmarker(self) -> Callable[..., list[float]]:
        def bench(kernel_call: Callable[[], None], quantiles: Any = None, **_: Any) -> list[float]:
            kernel_call()
            return [1.0, 1.0, 1.0]

        return bench


class StandIn:
    """Triton with the recording driver, and the runtime imported with compiled (not
    interpreted) kernels, routing CPU tensors to them as it routes CUDA tensors, on a device
    of the generation :meth:`generation` names (``torch.cuda.get_device_capability``)."""

    def __init__(self) -> None:
        if "quantpatch.runtime.quantpatch_kernels" in sys.modules or "triton" in sys.modules:
            raise RuntimeError("kernel_resources must import Triton and the runtime itself")
        os.environ.pop("TRITON_INTERPRET", None)
        import triton
        import triton.experimental.gluon  # imported while Triton compiles, not interprets
        from triton import knobs
        from triton.runtime.driver import driver

        knobs.runtime.interpret = False  # JIT functions, compiled ...
        os.environ.update(
            TRITON_INTERPRET="1",  # ... and the runtime's dispatch sends CPU tensors to them
            QUANTPATCH_KERNELS="triton",
            QUANTPATCH_FLASH="1",
            QUANTPATCH_WEIGHT_CACHE="0",
            TRITON_DEFAULT_FP_FUSION="1",
        )
        self.recorder = _Recorder()
        self.driver = _Driver()
        driver.set_active(self.driver)
        knobs.runtime.jit_cache_hook = self.recorder.hook
        import torch

        from quantpatch.runtime import quantpatch_flash, quantpatch_gemm_kernels, quantpatch_kernels

        assert isinstance(quantpatch_kernels._mx_kernel.fn, triton.runtime.jit.JITFunction)
        for tuned_module in (quantpatch_kernels, quantpatch_gemm_kernels):
            tuned_module._interpreting = lambda: False  # type: ignore[attr-defined]  # a GPU's
        blocks = quantpatch_flash.blocks
        quantpatch_flash.blocks = lambda d, dv, device: blocks(d, dv, torch.device("cuda"))
        torch.cuda.get_device_capability = lambda device=None: divmod(self.recorder.cc, 10)
        self.tuned = [
            getattr(module, name)
            for module in (quantpatch_kernels, quantpatch_gemm_kernels)
            for name in dir(module)
            if isinstance(getattr(module, name), triton.runtime.autotuner.Autotuner)
        ]

    def generation(self, cc: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.recorder.cc = cc
        self.driver.target = GPUTarget("cuda", cc, 32)
        for tuner in self.tuned:  # each generation prunes and tries its own configurations
            tuner.cache.clear()


# -- the cases: the runtime's entry points over values, dtypes and model shapes --------------


def model_shapes() -> list[dict[str, int]]:
    """Hidden, FFN and head widths of the registered models."""
    import tomllib

    data = tomllib.loads((ROOT / "quantpatch" / "data" / "models.toml").read_text())
    out = []
    for name, model in data["models"].items():
        args = model["args"]
        heads = int(args["num-attention-heads"])
        hidden = int(args["hidden-size"])
        head = int(args.get("kv-channels", args.get("qk-head-dim", hidden // heads)))
        if "qk-pos-emb-head-dim" in args:
            head += int(args["qk-pos-emb-head-dim"])
        groups = (
            int(args.get("num-query-groups", heads)) if args.get("group-query-attention") else heads
        )
        out.append({
            "name": name, "hidden": hidden, "ffn": int(args["ffn-hidden-size"]), "heads": heads,
            "groups": groups, "head": head, "vhead": int(args.get("v-head-dim", head)),
        })  # fmt: skip
    return out


def quant_values() -> tuple[str, ...]:
    """The values the Triton kernels compute (the spec's; delayed scaling and ParetoQ run in
    PyTorch)."""
    from quantpatch.runtime import quantpatch_formats as formats

    return tuple(
        f.name for f in formats.SPECS
        if f.roles and f.family not in ("none", "fp8-delayed", "paretoq")
    )  # fmt: skip


def drive_fast() -> None:
    """The representative case: ``fake_quant`` of a bf16 activation in ``fp8-tensor``."""
    import torch

    from quantpatch.runtime import quantpatch_ops as ops

    ops.fake_quant(torch.empty(64, model_shapes()[0]["hidden"], dtype=torch.bfloat16), "fp8-tensor")


def _aligned(width: int) -> int:
    """The smallest width that specializes as ``width`` does (divisibility by 16), at 256."""
    return 256 if width % 16 == 0 else 256 + width % 16


def drive() -> None:
    """Every entry point over the cases: each value, dtype and registered model's widths,
    forward and backward, the separate and the fused GEMM (tokens kept few: alignment and the
    constexprs decide what is compiled, and the contents are never read)."""
    import torch

    from quantpatch.runtime import quantpatch_ops as ops
    from quantpatch.runtime.quantpatch_formats import spec_of

    shapes = model_shapes()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        # the linear layers: every registered width is a multiple of 16, so each compiles as
        # 256 does (a launch sees its sizes only through their divisibility by 16); 40 is
        # the unaligned case
        widths = sorted({_aligned(w) for s in shapes for w in (s["hidden"], s["ffn"])} | {40})
        for width in widths:
            for hidden in {_aligned(s["hidden"]) for s in shapes}:
                tokens = 64
                w = torch.nn.Parameter(torch.empty(width, hidden, dtype=dtype))
                x = torch.empty(tokens, hidden, dtype=dtype)
                g = torch.empty(tokens, width, dtype=dtype)
                for fmt in quant_values():
                    if spec_of(fmt).rht and width % 16:
                        continue  # refused up front: a reduction not a multiple of 16
                    for backward in (False, True):
                        ops.fake_quant(x, fmt, dim=-1, backward=backward)
                        ops.fake_quant(w.detach(), fmt, dim=0, backward=backward)
                    for gemm in ("separate", "fused"):
                        os.environ["QUANTPATCH_GEMM"] = gemm
                        with torch.no_grad():
                            ops.quant_matmul(x, w.t(), fmt, roles=("input", "weight"))  # forward
                            ops.quant_matmul(g, w, fmt, roles=("grad_output", "weight"))  # dgrad
                            ops.quant_matmul(g.t(), x, fmt, backward=True)  # wgrad
        for shape in shapes:  # attention: each model's own head dims and groups
            heads, groups, d, dv = shape["heads"], shape["groups"], shape["head"], shape["vhead"]
            seq = 64
            for fmt in ("bf16", *quant_values()):
                if fmt != "bf16" and spec_of(fmt).rht:
                    continue  # Q.K^T of the FA schemes: not a value of theirs
                os.environ["QUANTPATCH_GEMM"] = "fused"
                with torch.no_grad():  # the unfused attention's Q.K^T
                    ops.quant_bmm(
                        torch.empty(heads, seq, d, dtype=dtype),
                        torch.empty(heads, d, seq, dtype=dtype),
                        fmt,
                    )
                if dtype == torch.float32:
                    continue  # the flash kernels take bf16 and fp16
                for causal in (True, False):
                    q = torch.empty(seq, 1, heads, d, dtype=dtype, requires_grad=True)
                    k = torch.empty(seq, 1, groups, d, dtype=dtype, requires_grad=True)
                    v = torch.empty(seq, 1, groups, dv, dtype=dtype, requires_grad=True)
                    out = ops.quant_flash_attention(
                        q, k, v, fmt=fmt, causal=causal, softmax_scale=d**-0.5
                    )
                    out.backward(torch.empty_like(out))


# -- compiling -----------------------------------------------------------------------------

_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_LAUNCHES: list[Launch] = []


def _compile(job: tuple[int, int]) -> dict[str, Any]:
    """Compile launch ``index`` for ``cc``: its resources, or the compiler's error."""
    from triton import compile as triton_compile
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    index, cc = job
    launch = _LAUNCHES[index]  # this generation's, in the process that drove it
    knobs.nvidia.dump_ptxas_log = True
    src = ASTSource(launch.fn, launch.signature, launch.constants, launch.attrs)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton_compile(src, target=GPUTarget("cuda", cc, 32), options=launch.options)
    except Exception as exc:  # the compiler's refusal is the result
        first = str(exc).strip().splitlines()
        return {
            "index": index,
            "cc": cc,
            "error": f"{type(exc).__name__}: {first[0] if first else ''}",
        }
    regs, spills = _REGS.search(log.getvalue()), _SPILLS.search(log.getvalue())
    if regs is None or spills is None:
        return {"index": index, "cc": cc, "error": "no ptxas report (a cached compilation?)"}
    return {
        "index": index,
        "cc": cc,
        "regs": int(regs[1]),
        "spill_stores": int(spills[1]),
        "spill_loads": int(spills[2]),
        "shared": int(kernel.metadata.shared),
        "cubin_bytes": len(kernel.asm["cubin"]),
        "seconds": time.perf_counter() - start,
    }


def occupancy(gen: Generation, regs: int, shared: int, warps: int) -> int:
    """Resident warps per SM those resources allow (registers allocated per warp in units of
    256, shared memory per block in units of 128 bytes)."""
    threads = 32 * warps
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (gen.regs // (per_warp * warps)) if per_warp * warps else gen.max_blocks
    by_threads = gen.max_threads // threads
    by_smem = gen.smem // (-(-shared // 128) * 128 + 1024) if shared else gen.max_blocks
    blocks = min(by_regs, by_threads, by_smem, gen.max_blocks)
    return blocks * warps


_HEAVY = ("KIND", "SR", "TWO_D", "RCEIL", "CAUSAL")


def heaviness(launch: Launch) -> int:
    """How much a launch's constexprs add to its kernel's live values: the operand kinds (the
    higher, the more: NVFP4's amax, block maxima and random bits), stochastic rounding,
    2-D tiles, the RCEIL rule, the causal mask."""
    names = launch.fn.arg_names
    return sum(
        int(v) for k, v in launch.constants.items()
        if isinstance(k, tuple) and isinstance(v, int | bool) and names[k[0]].endswith(_HEAVY)
    )  # fmt: skip


def sample(launches: list[Launch]) -> list[int]:
    """One bf16 launch per kernel, generation, launch options and tile sizes: every autotune
    configuration of every kernel, once per generation, each with its heaviest constexpr set
    (:func:`heaviness`; the first the runtime made among equals)."""
    best: dict[str, int] = {}
    for i, launch in enumerate(launches):
        names = launch.fn.arg_names
        if any(v == "*bf16" for v in launch.signature.values()) or "bf16" not in str(
            launch.signature
        ):
            tiles = sorted(
                (names[k[0]], v) for k, v in launch.constants.items()
                if isinstance(k, tuple) and names[k[0]].startswith(("BLOCK", "TILE"))
            )  # fmt: skip
            fam = repr((launch.kernel, launch.cc, sorted(launch.options.items()), tiles))
            if fam not in best or heaviness(launch) > heaviness(launches[best[fam]]):
                best[fam] = i
    return sorted(best.values())


def representatives(launches: list[Launch]) -> list[int]:
    """One launch per family and argument-type signature: the one with the most alignment
    (the vectorized form, which takes the most registers)."""
    best: dict[str, int] = {}
    for i, launch in enumerate(launches):
        fam = launch.family() + repr(sorted(launch.signature.items()))
        if fam not in best or len(str(launch.attrs)) > len(str(launches[best[fam]].attrs)):
            best[fam] = i
    return sorted(best.values())


_STAND_IN: list[StandIn] = []


def _generation(job: tuple[int, bool, str, bool]) -> dict[str, Any]:
    """One generation, in this process: the runtime driven with its autotune configurations,
    then its chosen launches compiled one after another (what a worker of the pool does)."""
    cc, fast, mode, dry = job
    stand_in = _STAND_IN[0]
    stand_in.recorder = _Recorder()
    stand_in.generation(cc)
    knobs_hook(stand_in)
    start = time.perf_counter()
    drive_fast() if fast else drive()
    launches = list(stand_in.recorder.launches.values())
    _LAUNCHES[:] = launches
    chosen = {
        "exhaustive": lambda: list(range(len(launches))),
        "representatives": lambda: representatives(launches),
        "sample": lambda: sample(launches),
    }[mode]()
    driven = time.perf_counter() - start
    results = [] if dry else [_compile((i, cc)) for i in chosen]
    rows = []
    for r in results:
        launch = launches[r["index"]]
        constants = {str(k): v for k, v in launch.constants.items() if isinstance(v, int | float)}
        rows.append(
            {**r, "kernel": launch.kernel, "options": launch.options, "constants": constants}
        )
    return {
        "launches": stand_in.recorder.total,
        "distinct": len(launches),
        "compiled": len(chosen),
        "kernels": sorted({launch.kernel for launch in launches}),
        "seconds_driving": driven,
        "rows": rows,
    }


def knobs_hook(stand_in: StandIn) -> None:
    """Point Triton's JIT hook at the stand-in's (new) recorder."""
    from triton import knobs

    knobs.runtime.jit_cache_hook = stand_in.recorder.hook


def run(
    fast: bool, mode: str, jobs: int, ccs: tuple[int, ...], dry: bool = False
) -> dict[str, Any]:
    """Each generation driven (pruning its own autotune configurations) and its distinct
    launches (or one representative of each family) compiled for it, ``jobs`` generations at
    a time in forked processes (the runtime is imported once, before the fork); one Triton
    cache for the run, whose keys hold the target, so no compilation is reused across
    generations and each runs ptxas (its report)."""
    start = time.perf_counter()
    if not _STAND_IN:
        _STAND_IN.append(StandIn())
    work = [(cc, fast, mode, dry) for cc in ccs]
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        if jobs > 1:
            import multiprocessing

            context = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(min(jobs, len(work)), mp_context=context) as pool:
                parts = list(pool.map(_generation, work))
        else:
            parts = [_generation(job) for job in work]
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return {
        "launches": sum(p["launches"] for p in parts),
        "distinct": sum(p["distinct"] for p in parts),
        "compiled": sum(p["compiled"] for p in parts),
        "generations": list(ccs),
        "kernels": sorted({k for p in parts for k in p["kernels"]}),
        "seconds_driving": sum(p["seconds_driving"] for p in parts),
        "seconds": time.perf_counter() - start,
        "cpu_seconds": sum(u.ru_utime + u.ru_stime for u in used),  # ptxas and the workers too
        "rows": [r for p in parts for r in p["rows"]],
    }


def problems(report: dict[str, Any]) -> list[str]:
    """What fails the check: a compiler error, a spill, shared memory above a block's limit."""
    limits = {g.cc: g for g in GENERATIONS}
    out = []
    for r in report["rows"]:
        where = f"{r['kernel']} {r['constants']} {r['options']} on sm_{r['cc']}"
        if "error" in r:
            out.append(f"{where}: {r['error']}")
        elif r["spill_stores"] or r["spill_loads"]:
            out.append(f"{where}: spills {r['spill_stores']} / {r['spill_loads']} bytes")
        elif r["shared"] > limits[r["cc"]].smem_block:
            out.append(f"{where}: {r['shared']} bytes of shared memory")
    return out


def table(report: dict[str, Any]) -> str:
    """Per kernel and generation: the most registers, spills, shared memory, and the least
    occupancy over its compiled launches."""
    gens = {g.cc: g for g in GENERATIONS}
    agg: dict[tuple[str, int], dict[str, Any]] = {}
    for r in report["rows"]:
        if "error" in r:
            continue
        a = agg.setdefault(
            (r["kernel"], r["cc"]), {"n": 0, "regs": 0, "spill": 0, "shared": 0, "occ": 10**9}
        )
        a["n"] += 1
        a["regs"] = max(a["regs"], r["regs"])
        a["spill"] = max(a["spill"], r["spill_stores"] + r["spill_loads"])
        a["shared"] = max(a["shared"], r["shared"])
        warps = r["options"]["num_warps"]
        occ = occupancy(gens[r["cc"]], r["regs"], r["shared"], warps)
        a["occ"] = min(a["occ"], occ * 100 // (gens[r["cc"]].max_threads // 32))
    lines = [
        "| kernel | sm | compiled | registers (most) | spilled bytes | shared KiB (most) "
        "| occupancy (least) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (kernel, cc), a in sorted(agg.items()):
        lines.append(
            f"| `{kernel}` | {cc} | {a['n']} | {a['regs']} | {a['spill']} | "
            f"{a['shared'] / 1024:.1f} | {a['occ']} % |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="the representative case only")
    parser.add_argument(
        "--compile",
        choices=("sample", "representatives", "exhaustive"),
        default="sample",
        help="sample: each kernel's every configuration once per generation (bf16); "
        "representatives: also each format, dtype and argument types (the most aligned); "
        "exhaustive: every distinct launch",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cc", default=",".join(map(str, SUPPORTED_CC)))
    parser.add_argument("--dry", action="store_true", help="count the launches only")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)
    ccs = tuple(int(c) for c in args.cc.split(","))
    report = run(args.fast, args.compile, args.jobs, ccs, args.dry)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    text = table(report)
    print(
        f"{report['launches']} launches, {report['distinct']} distinct specializations of "
        f"{len(report['kernels'])} kernels, {report['compiled']} compiled for "
        f"{len(ccs)} generations in {report['seconds']:.0f} s ({report['cpu_seconds']:.0f} s of "
        "CPU)"
    )
    print(text)
    bad = problems(report)
    for line in bad:
        print("PROBLEM:", line)
    if args.write_doc:
        doc = DOC.read_text()
        head, rest = doc.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        DOC.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
