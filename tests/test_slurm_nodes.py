"""What a partition's nodes offer (sinfo / scontrol text as Slurm prints
it) against what the scripts ask for, and the sentence that names the option that fits."""

from __future__ import annotations

import pytest

from quantpatch.launch.slurm_nodes import (
    NodeGroup,
    Partition,
    choose_partition,
    gpus_of_gres,
    parse_partitions,
    parse_sinfo,
    refusal,
    sbatch_hint,
)

# `sinfo -h -o '%D %G %c %m'` of a one-node cluster whose node declares 2 GPUs, and of a
# mixed partition (typed GPUs with sockets, a CPU-only group)
ONE_NODE = "1 gpu:2 8 64000\n"
MIXED = "4 gpu:a100:4(S:0-1) 64 512000\n2 (null) 32 128000+\n1 gpu:a100:2,gpu:h100:2 16 256000\n"
# `scontrol show partition -o`
PARTITIONS = (
    "PartitionName=debug AllowGroups=ALL Default=YES MaxNodes=UNLIMITED State=UP TotalNodes=1\n"
    "PartitionName=big AllowGroups=ALL Default=NO MaxNodes=2 State=UP TotalNodes=7\n"
)


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [
        ("gpu:2", 2),
        ("gpu:a100:4(S:0-1)", 4),
        ("gpu:a100:2,gpu:h100:2", 4),
        ("gpu:tesla:2,mps:200", 2),
        ("(null)", 0),
        ("gpu:a100", 1),
    ],
)
def test_gpus_of_gres(gres, gpus):
    assert gpus_of_gres(gres) == gpus


def test_parse_sinfo_and_partitions():
    assert parse_sinfo(ONE_NODE) == [NodeGroup(1, "gpu:2", 2, 8, 64000)]
    groups = parse_sinfo(MIXED + "garbage line\n")
    assert [(g.count, g.gpus) for g in groups] == [(4, 4), (2, 0), (1, 4)]
    found = parse_partitions(PARTITIONS + "JobId=1 JobState=RUNNING\n")
    assert [p["PartitionName"] for p in found] == ["debug", "big"]
    assert choose_partition(found, None)["PartitionName"] == "debug"  # Default=YES
    assert choose_partition(found, "big")["MaxNodes"] == "2"
    assert choose_partition(found, "nope") is None


def test_the_fast_profile_on_a_two_gpu_node_names_the_option():
    part = Partition("debug", tuple(parse_sinfo(ONE_NODE)))
    said = refusal(part, 8, 1, gpu_request="gpus-per-node", profile="fast")
    assert said == (
        "the fast profile asks Slurm for 1 node(s) with 8 GPU(s) each, but partition debug has "
        "1 node with gpu:2: give --gpus-per-node 2 to sweep run or gen-scripts (or "
        "gpus_per_node = 2 in the [profiles.fast] table of a --config)."
    )
    assert refusal(part, 2, 1, gpu_request="gpus-per-node", profile="fast") is None
    # two nodes on a one-node partition
    said = refusal(part, 2, 2, gpu_request="gres", profile="fast")
    assert said is not None and "give --nodes 1 to sweep run" in said
    # gpu_request none: the GPUs are not asked for, only the nodes count
    assert refusal(part, 8, 1, gpu_request="none", profile="fast") is None


def test_mixed_partitions_count_the_nodes_that_fit_and_max_nodes():
    part = Partition("big", tuple(parse_sinfo(MIXED)), max_nodes=2)
    assert part.describe() == (
        "4 nodes with gpu:a100:4(S:0-1), 2 with no GPU, 1 with gpu:a100:2,gpu:h100:2"
    )
    assert refusal(part, 4, 2, gpu_request="gpus-per-node", profile="full") is None
    said = refusal(part, 4, 3, gpu_request="gpus-per-node", profile="full")
    assert said is not None and "(MaxNodes=2): give --nodes 2" in said
    cpu = Partition("cpu", (NodeGroup(3, "(null)", 0),))
    said = refusal(cpu, 1, 1, gpu_request="gpus-per-node", profile="smoke")
    assert said is not None and "sinfo shows gpu GRES in no partition" in said


def test_the_hint_for_sbatchs_node_configuration_refusal():
    part = Partition("debug", tuple(parse_sinfo(ONE_NODE)))
    msg = "Batch job submission failed: Requested node configuration is not available"
    hint = sbatch_hint(msg, 8, 1, part, profile="fast", cpus=24)
    assert hint == (
        " (the scripts ask for 1 node(s) with 8 GPU(s) each and 24 CPUs for each node's task, "
        "but partition debug has 1 node with gpu:2: add `--gpus-per-node 2 --nodes 1` to sweep "
        "run or gen-scripts, or set gpus_per_node = 2 in the [profiles.fast] table and nodes = "
        "1 in the [profiles.fast.parallel] table of a --config)"
    )
    # what sinfo shows fits: one CPU a rank; sinfo silent and one CPU a rank: the least GPUs
    fits = sbatch_hint(msg, 2, 1, part, profile="smoke", cpus=6)
    assert (
        "which sinfo says fits: ask for one CPU per rank, cpus_per_task = 2 in the [slurm]" in fits
    )
    assert "`--gpus-per-node 1 --nodes 1` to sweep run" in sbatch_hint(msg, 2, 2, None, cpus=2)
    # nothing smaller to ask for: another partition sinfo shows with GPUs, else the cluster's
    assert 'partition = "big" in the [slurm] table' in sbatch_hint(
        msg, 1, 1, part, cpus=1, gpu_partitions=["debug", "big"]
    )
    alone = sbatch_hint(msg, 1, 1, part, cpus=1, gpu_partitions=["debug"])
    assert "sinfo shows no other partition with GPUs" in alone and "partition =" not in alone
    assert sbatch_hint("Invalid account", 8, 1, part) == ""
