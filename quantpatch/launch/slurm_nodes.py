"""What a Slurm partition's nodes offer, against what a sweep's scripts ask for.

``sweep run --launcher slurm`` asks ``sinfo`` (``%D %G %c %m``: nodes, generic resources,
CPUs, memory of each group of alike nodes) and ``scontrol show partition`` (the default
partition, ``MaxNodes``) before it writes or submits anything, and refuses a request no node
can meet with one sentence that names the nodes' GPUs and the option that fits them, rather
than sbatch's ``Requested node configuration is not available``. Where Slurm's commands are
not there or do not answer, nothing is checked (sbatch still has its word, with the same
hint). The parsers are plain functions over Slurm's text.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_NODE_CONFIG = "node configuration is not available"


@dataclass(frozen=True)
class NodeGroup:
    """One line of ``sinfo -h -o '%D %G %c %m'``: ``count`` nodes alike."""

    count: int
    gres: str
    gpus: int
    cpus: int | None = None
    memory_mb: int | None = None


@dataclass(frozen=True)
class Partition:
    name: str | None
    groups: tuple[NodeGroup, ...]
    max_nodes: int | None = None
    """``MaxNodes`` of ``scontrol show partition`` (None: ``UNLIMITED`` or unknown)."""

    @property
    def most_gpus(self) -> int:
        return max((g.gpus for g in self.groups), default=0)

    def nodes_with(self, gpus: int) -> int:
        return sum(g.count for g in self.groups if g.gpus >= gpus)

    def describe(self) -> str:
        """``1 node with gpu:2`` / ``4 nodes with gpu:a100:4, 2 with no GPU``."""
        parts = []
        for i, g in enumerate(self.groups):
            what = g.gres if g.gpus else "no GPU"
            noun = ("node" if g.count == 1 else "nodes") if i == 0 else ""
            parts.append(" ".join(w for w in (str(g.count), noun, "with", what) if w))
        return ", ".join(parts) or "no node"


def gpus_of_gres(text: str) -> int:
    """The GPUs one node declares in sinfo's ``%G``: ``gpu:2``, ``gpu:a100:4(S:0-1)``,
    ``gpu:a100:2,gpu:h100:2`` (4), ``(null)`` (0)."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", text).split(","):
        fields = item.strip().split(":")
        if fields[0] != "gpu":
            continue
        count = fields[-1] if len(fields) > 1 else "1"
        if count.isdigit():
            total += int(count)
        elif len(fields) == 2:  # gpu:a100 (a type, no count): one
            total += 1
    return total


def _int(text: str) -> int | None:
    m = re.match(r"[0-9]+", text)
    return int(m[0]) if m else None


def parse_sinfo(text: str) -> list[NodeGroup]:
    """The groups of ``sinfo -h -o '%D %G %c %m'`` (lines that do not parse are skipped)."""
    groups = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 2 or _int(fields[0]) is None:
            continue
        count = _int(fields[0]) or 0
        gres = fields[1]
        cpus = _int(fields[2]) if len(fields) > 2 else None
        memory = _int(fields[3]) if len(fields) > 3 else None
        groups.append(NodeGroup(count, gres, gpus_of_gres(gres), cpus, memory))
    return groups


def parse_partitions(text: str) -> list[dict[str, str]]:
    """``scontrol show partition -o``: one ``Key=Value`` mapping per partition."""
    out = []
    for line in text.splitlines():
        kv = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if "PartitionName" in kv:
            out.append(kv)
    return out


def choose_partition(
    partitions: Sequence[Mapping[str, str]], name: str | None
) -> Mapping[str, str] | None:
    """The named partition, else the default one (``Default=YES``), else the only one."""
    if name:
        return next((p for p in partitions if p["PartitionName"] == name), None)
    default = [p for p in partitions if p.get("Default") == "YES"]
    if default:
        return default[0]
    return partitions[0] if len(partitions) == 1 else None


def refusal(
    partition: Partition,
    gpus_per_node: int,
    nodes: int,
    *,
    gpu_request: str,
    profile: str,
    cpus: int | None = None,
    gpu_partitions: Sequence[str] = (),
) -> str | None:
    """One sentence where no placement of the request fits the partition, else None;
    ``gpu_partitions``: the partitions sinfo shows with GPUs (named where this one has none)."""
    where = f"partition {partition.name}" if partition.name else "the default partition"
    offers = f"{where} has {partition.describe()}"
    asks = f"the {profile} profile asks Slurm for {nodes} node(s) with {gpus_per_node} GPU(s) each"
    if gpu_request != "none" and gpus_per_node > partition.most_gpus:
        most = partition.most_gpus
        if most == 0:
            if gpu_partitions:
                return (
                    f"{asks}, but {offers} (sinfo shows no gpu GRES): choose a partition with "
                    f'GPUs, partition = "{gpu_partitions[0]}" in the [slurm] table of a --config '
                    f"(sinfo shows gpu GRES in {', '.join(gpu_partitions)}), or, if the GPUs "
                    'come with the node, gpu_request = "none" in the [slurm] table of a --config.'
                )
            return (
                f"{asks}, but {offers} (sinfo shows gpu GRES in no partition): if the GPUs come "
                'with the node, gpu_request = "none" in the [slurm] table of a --config.'
            )
        return (
            f"{asks}, but {offers}: give --gpus-per-node {most} to sweep run or gen-scripts "
            f"(or gpus_per_node = {most} in the [profiles.{profile}] table of a --config)."
        )
    fit = partition.nodes_with(gpus_per_node if gpu_request != "none" else 0)
    if partition.max_nodes is not None:
        fit = min(fit, partition.max_nodes)
    if nodes > fit:
        return (
            f"{asks}, but {offers}"
            + (f" (MaxNodes={partition.max_nodes})" if partition.max_nodes is not None else "")
            + f": give --nodes {fit} to sweep run or gen-scripts "
            f"(or nodes = {fit} in the [profiles.{profile}.parallel] table of a --config)."
        )
    if cpus is not None:
        needed = gpus_per_node if gpu_request != "none" else 0
        offered = [g.cpus for g in partition.groups if g.cpus is not None and g.gpus >= needed]
        most = max(offered, default=0)
        if offered and cpus > most:
            return (
                f"{asks} and {cpus} CPUs for each node's task (--cpus-per-task), but {offers} "
                f"and at most {most} CPUs a node: set cpus_per_task = {most} in the [slurm] "
                "table of a --config."
            )
    return None


def _ask(cmd: Sequence[str]) -> str | None:
    exe = shutil.which(cmd[0])
    if exe is None:
        return None
    try:
        res = subprocess.run(
            [exe, *cmd[1:]],
            capture_output=True,
            text=True,
            errors="replace",  # a node's or partition's name in another encoding
            check=False,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def gpu_partitions() -> list[str]:
    """The partitions whose nodes sinfo shows with gpu GRES, in its order (empty where it
    does not say)."""
    names: list[str] = []
    for line in (_ask(["sinfo", "-h", "-o", "%P %G"]) or "").splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and gpus_of_gres(parts[1]) > 0:
            name = parts[0].rstrip("*")  # the default partition is starred
            if name not in names:
                names.append(name)
    return names


def query(name: str | None, env: Mapping[str, str] = os.environ) -> Partition | None:
    """What the partition the scripts go to (``[slurm] partition``, else ``SBATCH_PARTITION``,
    else Slurm's default) offers, or None where Slurm's commands do not say."""
    name = name or env.get("SBATCH_PARTITION") or None
    found = parse_partitions(_ask(["scontrol", "show", "partition", "-o"]) or "")
    chosen = choose_partition(found, name)
    if chosen is not None:
        name = chosen["PartitionName"]
    cmd = ["sinfo", "-h", "-o", "%D %G %c %m"]
    if name:
        cmd[2:2] = ["-p", name]
    groups = parse_sinfo(_ask(cmd) or "")
    if not groups:
        return None
    max_nodes = chosen.get("MaxNodes", "") if chosen is not None else ""
    # MaxNodes=0 is Slurm's "no limit" as UNLIMITED is
    limit = int(max_nodes) if max_nodes.isdigit() and int(max_nodes) > 0 else None
    return Partition(name, tuple(groups), limit)


def sbatch_hint(
    message: str,
    gpus_per_node: int | None,
    nodes: int | None,
    partition: Partition | None,
    *,
    profile: str | None = None,
    cpus: int | None = None,
    gpu_request: str = "gpus-per-node",
    gpu_partitions: Sequence[str] = (),
) -> str:
    """For sbatch's ``Requested node configuration is not available``: what the scripts asked
    for, what the nodes have, and a request that fits, with its values ("" for another
    refusal). Where sinfo says the request fits (or says nothing), the change that keeps the
    runs as they are comes first: one CPU per rank (Slurm often gives each CPU its share of a
    node's memory), else the smallest GPU request, else another of ``gpu_partitions`` (those
    sinfo shows with GPUs)."""
    if _NODE_CONFIG not in message.lower():
        return ""
    if gpus_per_node is None or nodes is None:
        return (
            " (the scripts ask for more than a node offers: `sinfo -o '%D %G %c %m'` shows "
            "what the nodes have)"
        )
    asked = f"the scripts ask for {nodes} node(s) with {gpus_per_node} GPU(s) each"
    if cpus is not None:
        asked += f" and {cpus} CPUs for each node's task"
    name = profile or "NAME"
    if partition is not None:
        where = f"partition {partition.name}" if partition.name else "the default partition"
        has = f"{where} has {partition.describe()}"
        gpus = gpus_per_node if gpu_request == "none" else min(gpus_per_node, partition.most_gpus)
        fit = partition.nodes_with(gpus if gpu_request != "none" else 0)
        if partition.max_nodes is not None:
            fit = min(fit, partition.max_nodes)
        n = min(nodes, fit)
        if (gpus, n) != (gpus_per_node, nodes) and gpus > 0 and n > 0:
            return (
                f" ({asked}, but {has}: add `--gpus-per-node {gpus} --nodes {n}` to sweep run "
                f"or gen-scripts, or set gpus_per_node = {gpus} in the [profiles.{name}] table "
                f"and nodes = {n} in the [profiles.{name}.parallel] table of a --config)"
            )
        asked += f"; {has}, which sinfo says fits"
    else:
        asked += "; sinfo does not say what the nodes have"
    if cpus is not None and cpus > gpus_per_node > 0:
        return (
            f" ({asked}: ask for one CPU per rank, cpus_per_task = {gpus_per_node} in the "
            "[slurm] table of a --config, since Slurm often gives each CPU its share of a "
            "node's memory)"
        )
    if gpus_per_node > 1 or nodes > 1:
        return (
            f" ({asked}: the smallest request, `--gpus-per-node 1 --nodes 1` to sweep run, "
            "fits any GPU node)"
        )
    others = [p for p in gpu_partitions if partition is None or p != partition.name]
    if others:
        return (
            f' ({asked}: send it to another partition, partition = "{others[0]}" in the '
            f"[slurm] table of a --config (sinfo shows gpu GRES in {', '.join(others)}))"
        )
    return (
        f" ({asked}, the smallest request there is, and sinfo shows no other partition with "
        "GPUs: the reason is the cluster's own, `scontrol show partition` and the cluster's "
        "administrators tell it)"
    )
