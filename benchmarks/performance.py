"""Regenerate the figures of ``docs/performance.md`` from the benchmarks, in one command.

Usage::

    python benchmarks/performance.py                      # the fast CPU benchmarks, then the doc
    python benchmarks/performance.py --only cli,sweep     # some of them (the others' blocks kept)
    python benchmarks/performance.py --slow               # also saver_overhead (CPU) and tensors
    python benchmarks/performance.py --save DIR           # keep each benchmark's output in DIR
    python benchmarks/performance.py --from DIR           # no run: the outputs saved in DIR
    python benchmarks/performance.py --only gpu --gpu-results benchmarks/results/h100-2026-11-24

Each benchmark is run as its own process (the interpreter running this script) and its printed
report is written, as it printed it, into the block of ``docs/performance.md`` between
``<!-- BEGIN name -->`` and ``<!-- END name -->``, under a line that names the command, the
machine (CPU model, cores, Python, torch), the commit and the date. Blocks of benchmarks not
run keep their text, and everything outside the blocks is left as it is. The ``gpu`` block is
filled from a ``benchmarks/gpu_suite.py`` result directory (``gpu_suite.md`` and its
``README.md``, which names the card and the commit), never from this machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOC = ROOT / "docs" / "performance.md"


@dataclass(frozen=True)
class Bench:
    name: str
    args: tuple[str, ...]
    slow: bool = False


BENCHES: tuple[Bench, ...] = (
    Bench("cli", ("cli_timing.py", "--runs", "9")),
    Bench("gen-scripts", ("gen_scripts.py", "--runs", "7")),
    Bench("quant-ops", ("quant_ops.py", "--device", "cpu")),
    Bench("sweep", ("sweep_overhead.py", "--parallel", "2")),
    Bench("saver-writer", ("saver_writer.py", "--reps", "15")),
    Bench("saver-overhead", ("saver_overhead.py", "--device", "cpu"), slow=True),
    Bench("tensors", ("tensors.py",), slow=True),
)
GPU_BLOCK = "gpu"
_BLOCK = re.compile(
    r"(<!-- BEGIN (?P<name>[a-z-]+) -->\n)(?P<body>.*?)(<!-- END (?P=name) -->)", re.DOTALL
)


def blocks(text: str) -> dict[str, str]:
    """The generated blocks of ``text``: name -> body."""
    return {m["name"]: m["body"] for m in _BLOCK.finditer(text)}


def replace_blocks(text: str, new: dict[str, str], where: Path = DOC) -> str:
    """``text`` with the body of each block named in ``new`` replaced; a name without a block
    in ``text`` is an error (the doc and this script must name the same blocks)."""
    missing = sorted(set(new) - set(blocks(text)))
    if missing:
        raise SystemExit(f"{where}: no block for {', '.join(missing)}")
    return _BLOCK.sub(
        lambda m: m[1] + new[m["name"]] + m[4] if m["name"] in new else m[0],
        text,
    )


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "no torch"
    load = ""
    if hasattr(os, "getloadavg"):
        load = f", load average {os.getloadavg()[0]:.1f} as it started"
    return (
        f"{cpu}, {os.cpu_count()} cores{load}, Python {platform.python_version()}, "
        f"torch {torch_version}"
    )


def commit() -> str:
    res = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return res.stdout.strip() or "unknown"


def render(command: str, output: str, where: str) -> str:
    return f"`{command}` on {where}:\n\n```text\n{output.rstrip()}\n```\n"


def run_bench(bench: Bench) -> str:
    """The benchmark's printed report (stdout), or a SystemExit naming why it failed."""
    cmd = [sys.executable, str(HERE / bench.args[0]), *bench.args[1:]]
    print(f"== {' '.join(['python', 'benchmarks/' + bench.args[0], *bench.args[1:]])}", flush=True)
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"{bench.args[0]} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    print(res.stdout, end="", flush=True)
    return res.stdout


def gpu_block(results: Path) -> str:
    """The GPU suite's Markdown table, under the line its README gives (card, commit)."""
    table = (results / "gpu_suite.md").read_text()
    note = results / "README.md"
    head = note.read_text().splitlines()[0].lstrip("# ").strip() if note.exists() else ""
    title = re.match(r"# (?:quantpatch GPU suite: )?(.*)\n+", table)
    card = title[1] if title else "unknown card"
    table = table[title.end() :] if title else table  # the line written above names the card
    table = re.sub(r"^#+ ", "", table, flags=re.MULTILINE)
    shown = results.relative_to(ROOT) if results.is_relative_to(ROOT) else results
    date = re.search(r"\d{4}-\d{2}-\d{2}", results.name)
    measured = f", measured {date[0]}" if date else ""
    return (
        f"{card}{measured}, from `{shown}` ({head}); its `README.md` names the commit and the "
        f"runs behind it.\n\n{table.rstrip()}\n"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--only", help="comma list of: " + ", ".join([*(b.name for b in BENCHES), GPU_BLOCK])
    )
    ap.add_argument("--slow", action="store_true", help="also the slow CPU benchmarks")
    ap.add_argument("--from", dest="source", type=Path, help="read <name>.txt outputs from here")
    ap.add_argument("--save", type=Path, help="also write each output to <DIR>/<name>.txt")
    ap.add_argument("--gpu-results", type=Path, help="a gpu_suite.py result directory")
    ap.add_argument("--out", type=Path, default=DOC, help="the document to rewrite")
    args = ap.parse_args(argv)

    known = {b.name: b for b in BENCHES}
    if args.only is not None:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in known and n != GPU_BLOCK]
        if unknown or not names:
            ap.error(
                f"--only: unknown benchmark(s) {', '.join(unknown) or '(none given)'}; known: "
                f"{', '.join([*known, GPU_BLOCK])}"
            )
        if GPU_BLOCK in names and args.gpu_results is None:
            ap.error("--only gpu takes its figures from --gpu-results DIR")
        chosen = [known[n] for n in names if n != GPU_BLOCK]
    elif args.source:
        chosen = [b for b in BENCHES if (args.source / f"{b.name}.txt").exists()]
    else:
        chosen = [b for b in BENCHES if args.slow or not b.slow]

    new: dict[str, str] = {}
    for bench in chosen:
        command = " ".join(["python", "benchmarks/" + bench.args[0], *bench.args[1:]])
        if args.source:
            path = args.source / f"{bench.name}.txt"
            text = path.read_text()
            # a saved output carries its own first line: "# <machine, commit, date>"
            first, _, rest = text.partition("\n")
            new[bench.name] = render(command, rest, first.lstrip("# ").strip() or "unknown")
            continue
        # the load is taken as each benchmark starts: on a shared machine it says what the
        # figures competed with
        where = f"{machine()}, commit {commit()}, {datetime.date.today().isoformat()}"
        output = run_bench(bench)
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            (args.save / f"{bench.name}.txt").write_text(f"# {where}\n{output}")
        new[bench.name] = render(command, output, where)
    if args.gpu_results:
        new[GPU_BLOCK] = gpu_block(args.gpu_results.resolve())
    if not new:
        raise SystemExit("nothing to write: no benchmark chosen and no --gpu-results")
    text = args.out.read_text()
    args.out.write_text(replace_blocks(text, new, args.out))
    print(f"rewrote {', '.join(new)} in {args.out}")


if __name__ == "__main__":
    main()
