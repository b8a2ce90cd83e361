"""Step time of a stack of the real patched Megatron linear layers (forward + backward) with the
tensor saver not installed / installed but disabled / enabled / stats-only, and with a
synchronous reference saver (the seed's behaviour: per tensor .cpu(), four .item() statistics,
torch.save), next to two physical references measured in the same run: a host copy (pinned
device-to-host on CUDA) of the same bytes and a raw sequential file write of the same bytes.

Usage: python benchmarks/saver_overhead.py [--device cpu|cuda] [--layers N] [--hidden H]
                                           [--tokens T] [--steps K]

Defaults: on CUDA 8 layers 4096 -> 4096, 8192 tokens, bf16 (~1.6 GB saved per step); on CPU
8 layers 512 -> 512, 512 tokens (bf16 matrix products on a CPU without bf16 units take about
2 s a step; with 2048 tokens a run took 7 minutes). Bars: disabled <= 1 % over not
installed; on a saving step the training-stream stall <= 3x the copy time; the background
writer sustains >= 50 % of the raw write throughput; after flush() every expected file
exists, bit-exact. The CPU writer against the raw write, without the matrix products around
it, is measured by ``saver_writer.py``. It also prints the training thread's time inside the
saver's ``save()`` for each step, the first (warm-up) included: on an H100 that showed the
pinning of fresh host memory (550, 218, 177, 127, 74 ms in the first steps, against 15-21 ms
once a step's buffers existed), which a median of the steps hid as a 5.4x stall.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _timing import worker_pythonpath  # benchmarks/_timing.py, beside this script

WORKER = r"""
import json, os, sys, time, statistics, torch
args = json.loads(sys.argv[1])
dev, n, h, t = args["device"], args["layers"], args["hidden"], args["tokens"]
steps = args["steps"]
from megatron.core.tensor_parallel import layers
L = layers.LinearWithGradAccumulationAndAsyncCommunication
import inspect
vals = {"bias": None, "gradient_accumulation_fusion": False, "allreduce_dgrad": False,
        "async_grad_allreduce": False, "sequence_parallel": False, "grad_output_buffer": None,
        "wgrad_deferral_limit": 0, "tp_group": None}
extra = [vals[k] for k in list(inspect.signature(L.forward).parameters)[3:]]
saver = None
if args["variant"] != "not_installed":
    from megatron.core.quantpatch import tensor_saver as saver
if args["variant"] == "sync_reference":
    def reference_save(tensor, layer_type, operation, quant_type, name, layer_idx, metadata):
        c = tensor.detach().cpu()  # synchronises the stream
        info = {"min": c.float().min().item(), "max": c.float().max().item(),
                "mean": c.float().mean().item(), "std": c.float().std().item()}
        saver._SAVER.counter += 1
        torch.save({"tensor": c, "tensor_info": info}, os.path.join(
            os.environ["TENSOR_SAVE_DIR"], f"{saver._SAVER.counter:06d}_{name}.pt"))
    os.makedirs(os.environ["TENSOR_SAVE_DIR"], exist_ok=True)
    saver._SAVER.save = reference_save
in_save = [0.0]  # the training thread's time inside the saver's save(), this step
if args["variant"] in ("enabled", "stats_only"):
    from megatron.core.quantpatch.quantpatch_saver import writer
    real_save = writer.Saver.save
    def timed_save(self, *a, **k):
        s0 = time.perf_counter()
        try:
            return real_save(self, *a, **k)
        finally:
            in_save[0] += time.perf_counter() - s0
    writer.Saver.save = timed_save
torch.manual_seed(0)
ws = [(torch.randn(h, h, device=dev) * h ** -0.5).to(torch.bfloat16).requires_grad_()
      for _ in range(n)]
x0 = torch.randn(t, 1, h, device=dev).to(torch.bfloat16).requires_grad_()
def sync():
    if dev == "cuda":
        torch.cuda.synchronize()
def step():
    y = x0
    for w in ws:
        y = L.apply(y, w, *extra)
    y.float().pow(2).mean().backward()
times, flushes, saves = [], [], []
for i in range(steps + 1):
    in_save[0] = 0.0
    sync(); a = time.perf_counter(); step(); sync(); b = time.perf_counter()
    saves.append(in_save[0])
    if saver is not None and args["variant"] in ("enabled", "stats_only"):
        saver.flush()
    c = time.perf_counter()
    if i:  # the first step warms up
        times.append(b - a); flushes.append(c - b)
nbytes = n * 2 * (t * h * 2 + h * h * 2)  # per layer: input + weight, grad_output + weight
guard = None
if saver is not None:  # the inserted test itself, as the patched code runs it
    mod = layers._qp_saver
    k = 1_000_000
    a = time.perf_counter()
    for _ in range(k):
        if mod.ENABLED:
            pass
    guard = (time.perf_counter() - a) / k
print(json.dumps({"step": statistics.median(times), "flush": statistics.median(flushes),
                  "in_save": saves,
                  "bytes_per_step": nbytes, "guard": guard}))
"""


def run_variant(checkout: Path, variant: str, cfg: dict, logdir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env["PYTHONPATH"] = worker_pythonpath(checkout)
    if variant in ("enabled", "stats_only", "sync_reference"):
        env.update(TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=str(logdir / variant))
    if variant == "stats_only":
        env["TENSOR_SAVE_STATS_ONLY"] = "true"
    out = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps({**cfg, "variant": variant})],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=checkout,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def physical(nbytes: int, device: str, tmp: Path) -> tuple[float, float]:
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    if device == "cuda":
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        a = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        copy_s = time.perf_counter() - a
    else:
        dst = torch.empty_like(src)
        dst.copy_(src)
        a = time.perf_counter()
        dst.copy_(src)
        copy_s = time.perf_counter() - a
    data = dst.view(torch.uint8).numpy().tobytes()
    path = tmp / "raw.bin"
    a = time.perf_counter()
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    write_s = time.perf_counter() - a
    path.unlink()
    return copy_s, write_s


def main() -> None:
    import torch

    from quantpatch.checkout.demo import build_checkout
    from quantpatch.checkout.saver import install

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="runs of the two disabled variants")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    args = ap.parse_args()
    gpu = args.device == "cuda"
    cfg = {
        "device": args.device,
        "layers": args.layers,
        "steps": args.steps,
        "hidden": args.hidden or (4096 if gpu else 512),
        "tokens": args.tokens or (8192 if gpu else 512),
    }
    tmp = Path(tempfile.mkdtemp(prefix="qp-saver-"))
    try:
        plain = build_checkout(tmp / "plain")  # init'd: sites and ops, no saver
        saved = tmp / "saved"
        shutil.copytree(plain, saved)
        install(saved)
        logdir = tmp / "logs"
        res: dict[str, dict] = {}
        # the two disabled variants alternate, several times, to see past machine noise
        samples: dict[str, list[float]] = {"not_installed": [], "disabled": []}
        guard = 0.0
        for _ in range(args.repeats):
            samples["not_installed"].append(
                run_variant(plain, "not_installed", cfg, logdir)["step"]
            )
            disabled_run = run_variant(saved, "disabled", cfg, logdir)
            samples["disabled"].append(disabled_run["step"])
            guard = disabled_run["guard"]
        for v in ("enabled", "stats_only", "sync_reference"):
            res[v] = run_variant(saved, v, cfg, logdir)
        nbytes = res["enabled"]["bytes_per_step"]
        copy_s, write_s = physical(nbytes, args.device, tmp)
        base = statistics.median(samples["not_installed"])
        disabled = statistics.median(samples["disabled"])
        print(
            f"{cfg['layers']} linear layers {cfg['hidden']}->{cfg['hidden']}, {cfg['tokens']} "
            f"tokens, bf16, {args.device}; {nbytes / 1e6:.1f} MB saved per step; "
            f"median of {args.steps} steps"
        )
        print(f"{'variant':22s} {'step ms':>9s} {'vs not installed':>17s} {'flush ms':>9s}")
        print(f"{'not installed':22s} {base * 1e3:9.1f} {'':>17s}")
        print(
            f"{'installed, disabled':22s} {disabled * 1e3:9.1f} "
            f"{100 * (disabled / base - 1):+16.2f}%"
        )
        guards = 2 * cfg["layers"]  # forward and input-gradient call sites per layer
        print(
            f"{'':22s} the guard itself: {guard * 1e9:.0f} ns x {guards} call sites = "
            f"{100 * guard * guards / base:.5f}% of a step"
        )
        for v in ("enabled", "stats_only", "sync_reference"):
            r = res[v]
            print(
                f"{v.replace('_', ' '):22s} {r['step'] * 1e3:9.1f} "
                f"{100 * (r['step'] / base - 1):+16.1f}% {r['flush'] * 1e3:9.1f}"
            )
        stall = max(res["enabled"]["step"] - disabled, 0.0)
        writer_s = stall + res["enabled"]["flush"]
        print(
            f"physical: copy of the same bytes {copy_s * 1e3:.1f} ms; raw sequential write "
            f"{write_s * 1e3:.1f} ms ({nbytes / write_s / 1e6:.0f} MB/s)"
        )
        print(
            f"stall on a saving step (enabled - disabled): {stall * 1e3:.1f} ms = "
            f"{stall / copy_s:.1f}x the copy; synchronous reference stalls "
            f"{(res['sync_reference']['step'] - disabled) * 1e3:.1f} ms"
        )
        print(
            f"writer throughput: {nbytes / writer_s / 1e6:.0f} MB/s = "
            f"{100 * (nbytes / writer_s) / (nbytes / write_s):.0f}% of the raw write"
        )
        for v in ("enabled", "stats_only"):
            ms = ", ".join(f"{x * 1e3:.1f}" for x in res[v]["in_save"])
            print(f"training thread inside save(), per step from the first ({v}): {ms} ms")
        files = list((logdir / "enabled").glob("*.pt"))
        expected = (args.steps + 1) * cfg["layers"] * 4
        exact = _check_files(files, cfg)
        print(f"files after flush: {len(files)} of {expected} expected; bit-exact: {exact}")
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "config": cfg,
                        "bytes_per_step": nbytes,
                        "step_not_installed_s": base,
                        "step_disabled_s": disabled,
                        "disabled_overhead_pct": 100 * (disabled / base - 1),
                        "guard_pct_of_step": 100 * guard * guards / base,
                        "stall_s": stall,
                        "copy_s": copy_s,
                        "stall_vs_copy": stall / copy_s,
                        "in_save_s": res["enabled"]["in_save"],
                        "raw_write_s": write_s,
                        "writer_pct_of_raw_write": 100 * (nbytes / writer_s) / (nbytes / write_s),
                        "files": len(files),
                        "files_expected": expected,
                        "bit_exact": exact,
                    }
                )
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_files(files: list[Path], cfg: dict) -> bool:
    """The weights are the seeded ones: every saved weight equals its regenerated value."""
    import torch

    torch.manual_seed(0)
    h, dev = cfg["hidden"], cfg["device"]  # CUDA's generator differs from the CPU's
    ws = [
        (torch.randn(h, h, device=dev) * h**-0.5).to(torch.bfloat16).cpu()
        for _ in range(cfg["layers"])
    ]
    weights = [torch.load(f)["tensor"] for f in sorted(files) if f.name.endswith("_weight.pt")]
    return bool(weights) and all(any(torch.equal(w, r) for r in ws) for w in weights)


if __name__ == "__main__":
    main()
