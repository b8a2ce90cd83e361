"""End to end: a tiny megatron-core GPT (local layer spec, so the patched files are the code
that runs) trained from an initialised demo checkout under several schemes, one worktree each,
and a saving run.

Usage: python benchmarks/gpu_e2e.py [--device cuda|cpu] [--steps N] [--megatron-core VER]

Reports, per scheme, the final loss (all must be finite) and the median step time, with the
FA_linear_mxfp8 / bf16 step-time ratio (bar on a GPU: <= 1.3); then, for a bf16 run with the
tensor saver on for micro-steps 0-1, the files per layer and tensor kind and the layer numbers
seen. On CPU the model is smaller and Megatron's CUDA-only buffer and RNG tracker are replaced
by CPU equivalents (as in the tests); on CUDA the real ones run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import worker_pythonpath  # benchmarks/_timing.py, beside this script

WORKER = r"""
import json, os, statistics, sys, time, torch
cfg = json.loads(sys.argv[1])
dev = cfg["device"]
from quantpatch.runtime.megatron_single import init_single_process
init_single_process(dev)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
torch.manual_seed(0)
tc = TransformerConfig(num_layers=cfg["layers"], hidden_size=cfg["hidden"],
                       num_attention_heads=cfg["heads"], use_cpu_initialization=True,
                       attention_dropout=0.0, hidden_dropout=0.0, bias_dropout_fusion=False,
                       apply_rope_fusion=False, masked_softmax_fusion=False,
                       bf16=True, params_dtype=torch.bfloat16)
from megatron.core.transformer.module import Float16Module
gpt = GPTModel(tc, get_gpt_layer_local_spec(), vocab_size=cfg["vocab"],
               max_sequence_length=cfg["seq"])
model = Float16Module(tc, gpt).to(dev)  # bf16 weights and activations, as Megatron trains
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1)
data = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=gen).to(dev)
pos = torch.arange(cfg["seq"], device=dev).expand(cfg["batch"], cfg["seq"])
mask = torch.triu(torch.ones(1, 1, cfg["seq"], cfg["seq"], dtype=torch.bool, device=dev), 1)
losses, times = [], []
# ParetoQ values: the linear layers' learnable weight steps (the sum of each, after each step)
steps_of = [p for n, p in model.named_parameters() if n.endswith("weight_alpha")]
alpha_sums = []
for step in range(cfg["steps"]):
    if dev == "cuda":
        torch.cuda.synchronize()
    a = time.perf_counter()
    opt.zero_grad()
    loss = model(data[:, :-1], pos, mask, labels=data[:, 1:]).float().mean()
    loss.backward()
    opt.step()
    losses.append(float(loss))
    alpha_sums.append([float(p.float().sum()) for p in steps_of])
    if dev == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - a)
saved = None
if os.environ.get("TENSOR_SAVE_ENABLED") == "true":
    from megatron.core.quantpatch import tensor_saver
    saved = tensor_saver.flush()
from megatron.core.quantpatch import quantpatch_ops
# delayed scaling: each linear layer's scales (input, weight, output gradient) after training
delayed = [m.scale.tolist() for n, m in model.named_modules() if n.endswith("fp8_delayed")]
print(json.dumps({"losses": losses, "step": statistics.median(times[2:] or times),
                  "saved": saved, "kernels": quantpatch_ops.kernels_in_use(dev),
                  "alpha": {"count": len(steps_of), "first": alpha_sums[0],
                            "last": alpha_sums[-1]}, "delayed": delayed}))
"""

SCHEMES = (
    "bf16",
    "FA_mxfp8",
    "linear_mxfp4",
    "FA_linear_hifp8",
    "FA_linear_mxfp8",
    "FA_linear_nvfp4",
    "nvfp4_recipe",
    "paretoq_w1.58",
    "paretoq_w2",
)


def main() -> None:
    import torch

    from quantpatch.checkout.demo import build_checkout
    from quantpatch.checkout.saver import install
    from quantpatch.checkout.worktrees import ensure_worktree
    from quantpatch.launch.registry import load_registry

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--megatron-core", default="0.13.1")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    ap.add_argument("--no-saving-run", action="store_true", help="skip the tensor-saver run")
    ap.add_argument(
        "--schemes", default=",".join(SCHEMES), help="comma list of schemes (bf16 among them)"
    )
    args = ap.parse_args()
    chosen = [n for n in args.schemes.split(",") if n]
    if "bf16" not in chosen:
        ap.error("--schemes: bf16 is the reference every step time is divided by")
    gpu = args.device == "cuda"
    cfg = {
        "device": args.device,
        "steps": args.steps,
        "vocab": 1024 if gpu else 256,
        "layers": 4 if gpu else 2,
        "hidden": 1024 if gpu else 128,
        "heads": 16 if gpu else 4,
        "seq": 1024 if gpu else 64,
        "batch": 8 if gpu else 2,
    }
    tmp = Path(tempfile.mkdtemp(prefix="qp-e2e-"))
    try:
        root = build_checkout(tmp / "checkout", args.megatron_core)
        install(root)
        schemes = load_registry().schemes
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("TENSOR_SAVE") and k != "CUSTOM_QUANT_TYPE"
        }
        print(
            f"tiny GPT (megatron-core {args.megatron_core}, local spec): {cfg['layers']} layers, "
            f"hidden {cfg['hidden']}, seq {cfg['seq']}, batch {cfg['batch']}, bf16, "
            f"{args.device}; {args.steps} Adam steps"
        )
        print(
            f"{'scheme':18s} {'linear':>7s} {'qk':>6s} {'pv':>6s} {'first loss':>11s} "
            f"{'final loss':>11s} {'step ms':>9s}"
        )
        steps: dict[str, float] = {}
        losses: dict[str, list[float]] = {}
        kernels: set[str] = set()
        for name in chosen:
            s = schemes[name]
            wt = ensure_worktree(root, s.values())
            res = _worker(wt.path, cfg, env)
            steps[name] = res["step"]
            losses[name] = res["losses"]
            kernels.add(res["kernels"])
            finite = all(map(_finite, res["losses"]))
            print(
                f"{name:18s} {s.linear_text:>7s} {s.qk:>6s} {s.pv:>6s} "
                f"{res['losses'][0]:11.4f} "
                f"{res['losses'][-1]:11.4f} {res['step'] * 1e3:9.1f}"
                f"{'' if finite else '  NON-FINITE LOSS'}"
            )
        for name in ("FA_linear_mxfp8", "FA_linear_nvfp4", "nvfp4_recipe"):
            if name in steps:
                print(f"step time {name} / bf16: {steps[name] / steps['bf16']:.2f}")
        print(f"fake quant on {args.device} tensors: {', '.join(sorted(kernels))}")
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "config": cfg,
                        "kernels": sorted(kernels),
                        "step_s": steps,
                        "step_vs_bf16": {k: v / steps["bf16"] for k, v in steps.items()},
                        "losses": losses,
                        "all_finite": all(_finite(x) for ls in losses.values() for x in ls),
                    }
                )
            )
        if args.no_saving_run:
            return
        logs = tmp / "tensor_logs"
        wt = ensure_worktree(root, schemes["bf16"].values())
        saving = _worker(
            wt.path,
            {**cfg, "steps": 3},
            {
                **env,
                "TENSOR_SAVE_ENABLED": "true",
                "TENSOR_SAVE_DIR": str(logs),
                "TENSOR_SAVE_STEPS": "0-1",
            },
        )
        counts: collections.Counter[tuple[object, str, str]] = collections.Counter()
        for f in logs.glob("*.pt"):
            meta = torch.load(f)["metadata"]
            counts[(meta["layer_idx"], meta["module_kind"], meta["tensor_name"])] += 1
        print(
            f"saving run (micro-steps 0-1 of 3): {saving['saved']['files']} files, "
            f"{saving['saved']['bytes'] / 1e6:.1f} MB, dropped {saving['saved']['dropped']}; "
            f"layer numbers seen: {sorted({k[0] for k in counts}, key=str)}"
        )
        for key in sorted(counts, key=str):
            print(f"  layer {key[0]!s:>4s}  {key[1]:15s} {key[2]:16s} {counts[key]} file(s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _worker(path: Path, cfg: dict, env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(cfg)],
        cwd=path,
        env={**env, "PYTHONPATH": worker_pythonpath(path)},
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
