"""Parallel layouts: what Megatron-LM derives from GPUs, nodes and parallel sizes, and the
combinations it would refuse, checked before anything is queued or launched.

``derive(plan)`` returns the layout (world size, data-parallel size, gradient-accumulation
steps, warnings) or raises ``LayoutError`` with one sentence that names the numbers and a valid
nearby choice. The rules mirror Megatron's own checks; each cites the one it mirrors. The same
function serves ``quantpatch layout``, ``gen-scripts`` (the profile's values) and the launch
scripts (which call ``quantpatch layout --line`` with their environment before launching).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from quantpatch.base.errors import UserError

SEQUENCE_PARALLEL = ("auto", "on", "off")
_CANONICAL = re.compile(r"[1-9][0-9]*")
IMPLEMENTATIONS = ("local", "transformer_engine")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
MAX_SIZE = 1 << 20


class LayoutError(UserError):
    """A layout Megatron would refuse (exit 2). A refusal of the rules keeps its parts apart,
    so that a command can name the fix its own way (``gen-scripts`` / ``sweep run``: the
    config table or option that sets the size, ``launch.scripts.plan_layout``)."""

    def __init__(
        self,
        message: str,
        said: str | None = None,
        fix: tuple[str, int | str] | None = None,
        verdict: str = "",
    ) -> None:
        super().__init__(message)
        self.said = said if said is not None else message
        """The refusal without its fix."""
        self.fix = fix
        """The field and the value that fix it (None: no single size)."""
        self.verdict = verdict
        """``would work`` or ``would pass this check``."""


@dataclass(frozen=True)
class Plan:
    """Everything a layout depends on. ``etp`` None = expert TP equals TP (Megatron's
    default); ``vpp`` 1 = no interleaving; ``query_groups`` None = one per head (no GQA);
    ``experts`` None = a dense model."""

    gpus_per_node: int
    nodes: int
    layers: int
    heads: int
    seq_length: int
    micro_batch: int
    global_batch: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int = 1
    query_groups: int | None = None
    experts: int | None = None
    sequence_parallel: str = "auto"
    """``auto`` (on when TP > 1 and the norms support it), ``on`` or ``off``."""
    transformer_impl: str = "local"
    """``local`` (the layers quantpatch patches) or ``transformer_engine``."""
    normalization: str = "LayerNorm"
    """Megatron's ``--normalization`` (its default is LayerNorm)."""

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def model_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.world // self.model_size

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def torch_norms(self) -> bool:
        """The local layer spec builds this model's norms as torch's (``WrappedTorchNorm``),
        which refuse sequence parallel: always for RMSNorm (``models/backends.py``
        ``LocalSpecProvider.layer_norm``), for LayerNorm unless apex is installed."""
        return self.transformer_impl == "local"

    @property
    def sp(self) -> bool:
        if self.sequence_parallel == "auto":
            return self.tp > 1 and not self.torch_norms
        return self.sequence_parallel == "on"

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step on each data-parallel rank (gradient accumulation)."""
        return self.global_batch // (self.micro_batch * self.dp)


@dataclass(frozen=True)
class Layout:
    plan: Plan
    warnings: tuple[str, ...]

    @property
    def world(self) -> int:
        return self.plan.world

    @property
    def dp(self) -> int:
        return self.plan.dp

    @property
    def grad_accum(self) -> int:
        return self.plan.micro_batches

    @property
    def sequence_parallel(self) -> bool:
        return self.plan.sp

    def line(self) -> str:
        """One line for a script's log header."""
        p = self.plan
        parts = [
            f"world {self.world} ({p.nodes} node{'s' if p.nodes > 1 else ''} x "
            f"{p.gpus_per_node} GPUs) = TP {p.tp} x PP {p.pp} x CP {p.cp} x DP {self.dp}",
        ]
        if p.vpp > 1:
            parts.append(f"VPP {p.vpp}")
        if p.experts is not None:
            parts.append(f"EP {p.ep} x expert TP {p.expert_tp} over {p.experts} experts")
        parts.append(f"sequence parallel {'on' if self.sequence_parallel else 'off'}")
        parts.append(
            f"global batch {p.global_batch} = micro batch {p.micro_batch} x DP {self.dp} "
            f"x {self.grad_accum} accumulation step{'s' if self.grad_accum > 1 else ''}"
        )
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "plan": {**asdict(self.plan), "expert_tp": self.plan.expert_tp},
            "world": self.world,
            "dp": self.dp,
            "grad_accum": self.grad_accum,
            "sequence_parallel": self.sequence_parallel,
            "warnings": list(self.warnings),
            "line": self.line(),
        }


@dataclass(frozen=True)
class _Rule:
    applies: Callable[[Plan], bool]
    holds: Callable[[Plan], bool]
    says: Callable[[Plan], str]
    """The failure, without the suggestion."""
    vary: tuple[str, ...]
    """The fields a nearby valid choice is searched on, in this order."""


def _s(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# Each rule mirrors a check that Megatron-LM makes at start-up (paths as in core_r0.13).
_RULES: tuple[_Rule, ...] = (
    # parallel_state.initialize_model_parallel: "world_size (...) is not divisible by
    # tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size";
    # training/arguments.py validate_args asserts the same.
    _Rule(
        lambda p: True,
        lambda p: p.world % p.model_size == 0,
        lambda p: (
            f"world size {p.world} ({_s(p.nodes, 'node')} x {p.gpus_per_node} GPUs) is not "
            f"divisible by TP {p.tp} x PP {p.pp} x CP {p.cp} = {p.model_size}"
        ),
        ("tp", "pp", "cp"),
    ),
    # transformer/attention.py Attention.__init__: divide(num_attention_heads, tp world size)
    _Rule(
        lambda p: True,
        lambda p: p.heads % p.tp == 0,
        lambda p: f"{p.heads} attention heads are not divisible by TP {p.tp}",
        ("tp",),
    ),
    # transformer/attention.py Attention.__init__: divide(num_query_groups, tp world size)
    _Rule(
        lambda p: p.query_groups is not None,
        lambda p: p.query_groups is not None and p.query_groups % p.tp == 0,
        lambda p: f"{p.query_groups} query groups are not divisible by TP {p.tp}",
        ("tp",),
    ),
    # training/arguments.py validate_args: sequence parallelism is dropped ("Disabling sequence
    # parallelism because tensor model parallelism is disabled"); quantpatch refuses instead,
    # since a run asked for it and would silently not get it.
    _Rule(
        lambda p: p.sequence_parallel == "on",
        lambda p: p.tp > 1,
        lambda p: "sequence parallel needs TP > 1 (TP is 1)",
        ("tp",),
    ),
    # transformer/torch_norm.py WrappedTorchNorm.__init__: "sequence parallel not supported by
    # torch LayerNorm". The local spec builds RMSNorm as that class, apex or not
    # (models/backends.py LocalSpecProvider.layer_norm), and LayerNorm too without apex.
    _Rule(
        lambda p: p.sequence_parallel == "on" and p.torch_norms and p.tp > 1,
        lambda p: p.normalization != "RMSNorm",
        lambda p: (
            "sequence parallel cannot run with the local layers: their RMSNorm is torch's norm "
            "(WrappedTorchNorm), which refuses it"
        ),
        ("sequence_parallel",),
    ),
    # tensor_parallel/mappings.py _split_along_first_dim: "First dimension of the tensor should
    # be divisible by tensor parallel size"; the sequence is first cut across CP ranks
    # (training/utils.py get_batch_on_this_cp_rank), then each rank's part across TP ranks
    _Rule(
        lambda p: p.sp,
        lambda p: (p.seq_length // p.cp) % p.tp == 0,
        lambda p: (
            f"sequence length {p.seq_length} / CP {p.cp} = {p.seq_length // p.cp} is not "
            f"divisible by TP {p.tp} (sequence parallel splits each CP rank's part of the "
            "sequence across TP ranks)"
        ),
        ("sequence_parallel", "tp"),
    ),
    # transformer/dot_product_attention.py DotProductAttention.__init__: "Context parallelism
    # is only supported by TEDotProductAttention!" (the local attention quantpatch patches)
    _Rule(
        lambda p: p.transformer_impl == "local",
        lambda p: p.cp == 1,
        lambda p: (
            f"CP {p.cp} needs Transformer Engine attention, but the local "
            "DotProductAttention (where the qk/pv sites live) supports only CP 1"
        ),
        ("cp",),
    ),
    # training/utils.py get_batch_on_this_cp_rank: the sequence is cut into 2 x CP chunks
    _Rule(
        lambda p: p.cp > 1,
        lambda p: p.seq_length % (2 * p.cp) == 0,
        lambda p: f"sequence length {p.seq_length} is not divisible by 2 x CP = {2 * p.cp}",
        ("cp",),
    ),
    # transformer/transformer_config.py __post_init__ and transformer_block.py
    # get_num_layers_to_build: num_layers % pipeline_model_parallel_size == 0
    _Rule(
        lambda p: True,
        lambda p: p.layers % p.pp == 0,
        lambda p: f"{p.layers} layers are not divisible by PP {p.pp}",
        ("pp",),
    ),
    # training/arguments.py validate_args: "pipeline-model-parallel size should be greater than
    # 1 with interleaved schedule"
    _Rule(
        lambda p: p.vpp > 1,
        lambda p: p.pp > 1,
        lambda p: f"VPP {p.vpp} (interleaved pipeline) needs PP > 1 (PP is {p.pp})",
        ("pp",),
    ),
    # transformer/transformer_config.py __post_init__: num_layers per pipeline stage must be
    # divisible by the virtual pipeline size
    _Rule(
        lambda p: p.vpp > 1,
        lambda p: p.layers % (p.pp * p.vpp) == 0,
        lambda p: (
            f"{p.layers} layers are not divisible by PP {p.pp} x VPP {p.vpp} = {p.pp * p.vpp}"
        ),
        ("vpp", "pp"),
    ),
    # training/arguments.py validate_args: "num_experts must be non None to use expert model
    # parallelism"
    _Rule(
        lambda p: p.experts is None,
        lambda p: p.ep == 1 and p.etp in (None, p.tp),
        lambda p: (
            (f"EP {p.ep}" if p.etp is None else f"EP {p.ep} / expert TP {p.etp}")
            + " needs a mixture-of-experts model (this one has no experts)"
        ),
        ("ep", "etp"),
    ),
    # transformer/moe/moe_layer.py BaseMoELayer: num_moe_experts % ep_size == 0
    _Rule(
        lambda p: p.experts is not None,
        lambda p: p.experts is not None and p.experts % p.ep == 0,
        lambda p: f"{p.experts} experts are not divisible by EP {p.ep}",
        ("ep",),
    ),
    # parallel_state.initialize_model_parallel: "decoder world_size (...) is not divisible by
    # expert_tensor_model_pipeline_parallel size" (expert TP x EP x PP must divide the world,
    # i.e. expert TP x EP must divide DP x CP x TP)
    _Rule(
        lambda p: p.experts is not None,
        lambda p: p.world % (p.expert_tp * p.ep * p.pp) == 0,
        lambda p: (
            f"EP {p.ep} x expert TP {p.expert_tp} = {p.ep * p.expert_tp} does not divide "
            f"DP {p.dp} x CP {p.cp} x TP {p.tp} = {p.dp * p.cp * p.tp}"
        ),
        ("ep",),
    ),
    # model_parallel_config.py ModelParallelConfig.__post_init__: "When using expert parallelism
    # and tensor parallelism, sequence parallelism must be used"; the local layers' torch norms
    # cannot (above), so there such a layout cannot be built at all
    _Rule(
        lambda p: p.experts is not None and p.ep > 1 and p.tp > 1,
        lambda p: p.sp,
        lambda p: (
            f"EP {p.ep} with TP {p.tp} needs sequence parallel, which the local layers cannot "
            "run (their RMSNorm is torch's norm, which refuses it)"
            if p.torch_norms and p.normalization == "RMSNorm"
            else f"EP {p.ep} with TP {p.tp} needs sequence parallel (it is off)"
        ),
        ("sequence_parallel", "tp", "ep"),
    ),
    # num_microbatches_calculator.py ConstantNumMicroBatchesCalculator: "global batch size (...)
    # is not divisible by micro batch size (...) times data parallel size (...)"
    _Rule(
        lambda p: True,
        lambda p: p.global_batch % (p.micro_batch * p.dp) == 0,
        lambda p: (
            f"global batch {p.global_batch} is not divisible by micro batch "
            f"{p.micro_batch} x DP {p.dp} = {p.micro_batch * p.dp}"
        ),
        ("global_batch",),
    ),
    # pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving: the
    # micro-batches of a step come in groups of microbatch_group_size_per_vp_stage (PP unless
    # set): "should range in [PP, M]", and a last group smaller than PP raises
    _Rule(
        lambda p: p.vpp > 1,
        lambda p: p.micro_batches >= p.pp and p.micro_batches % p.pp == 0,
        lambda p: (
            f"VPP {p.vpp} needs the micro-batches per step ({p.global_batch} / (micro batch "
            f"{p.micro_batch} x DP {p.dp}) = {p.micro_batches}) to be a multiple of PP {p.pp}, "
            "at least PP"
        ),
        ("global_batch", "vpp"),
    ),
)

_OPTION = {
    "etp": "expert TP",
    "tp": "TP",
    "pp": "PP",
    "cp": "CP",
    "ep": "EP",
    "vpp": "VPP",
    "global_batch": "global batch",
    "sequence_parallel": "sequence parallel",
}
_VARIABLE = {"global_batch": "GLOBAL_BATCH_SIZE", "sequence_parallel": "SEQUENCE_PARALLEL"}
"""Fields a person changes through another variable than a size: the fix names it, and the
option of ``quantpatch layout`` (which reads no variable) beside it."""
_FLAG = {"global_batch": "--global-batch", "sequence_parallel": "--sequence-parallel"}


def _broken(plan: Plan) -> _Rule | None:
    for rule in _RULES:
        if rule.applies(plan) and not rule.holds(plan):
            return rule
    return None


def _candidates(plan: Plan, field: str) -> Iterable[int | str]:
    """Values of ``field`` nearest to the current one first (smaller first on a tie)."""
    if field == "sequence_parallel":
        yield from (v for v in ("off", "on") if v != plan.sequence_parallel)
        return
    current: int = getattr(plan, field)
    if field == "global_batch":
        # whole steps of micro batch x DP, and of PP micro-batches under VPP
        step = plan.micro_batch * plan.dp * (plan.pp if plan.vpp > 1 else 1)
        low = max(step, current - current % step)
        yield from sorted({low, low + step}, key=lambda v: (abs(v - current), v))
        return
    top = max(plan.world, plan.layers, plan.heads, plan.experts or 1, 2 * current)
    for distance in range(1, top + 1):
        for value in (current - distance, current + distance):
            if 1 <= value <= top:
                yield value


def _choice(field: str, value: int | str) -> str:
    """``TP 2``; ``global batch 64 (--global-batch 64, GLOBAL_BATCH_SIZE=64)``: the option
    and the script's variable, as a size's refusal names ``--nodes (NNODES)``."""
    shown = f"{_OPTION[field]} {value}"
    if field not in _VARIABLE:
        return shown
    return f"{shown} ({_FLAG[field]} {value}, {_VARIABLE[field]}={value})"


def _nearby(plan: Plan, rule: _Rule) -> tuple[tuple[str, int | str] | None, str]:
    """A valid choice near the refused one: the nearest value of the rule's first field for
    which every rule holds (then its other fields); else the nearest size for which this rule
    holds. The field and value, and ``would work`` / ``would pass this check``."""
    only_this: tuple[str, int | str] | None = None
    for field in rule.vary:
        if getattr(plan, field) is None:
            continue
        for value in _candidates(plan, field):
            other = replace(plan, **{field: value})  # type: ignore[arg-type]
            if rule.applies(other) and not rule.holds(other):
                continue
            if _broken(other) is None:
                return (field, value), "would work"
            if only_this is None and field != "sequence_parallel":
                only_this = (field, value)
    if only_this is not None:
        return only_this, "would pass this check"
    return None, "no single size fixes it" if rule.vary else ""


def _check_sizes(plan: Plan) -> None:
    for f in fields(plan):
        value = getattr(plan, f.name)
        if f.name == "transformer_impl":
            if value not in IMPLEMENTATIONS:
                raise LayoutError(
                    f"transformer impl must be one of {', '.join(IMPLEMENTATIONS)} (got {value!r})."
                )
            continue
        if f.name == "normalization":
            if value not in NORMALIZATIONS:
                raise LayoutError(
                    f"normalization must be one of {', '.join(NORMALIZATIONS)} (got {value!r})."
                )
            continue
        if f.name == "sequence_parallel":
            if value not in SEQUENCE_PARALLEL:
                raise LayoutError(
                    f"sequence parallel must be one of {', '.join(SEQUENCE_PARALLEL)} "
                    f"(got {value!r})."
                )
            continue
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
            raise LayoutError(
                f"{TEXT_FIELDS.get(f.name, f.name)} must be an integer from 1 to {MAX_SIZE} "
                f"(got {value!r})."
            )
    if plan.world > MAX_SIZE:
        raise LayoutError(
            f"{plan.nodes} nodes x {plan.gpus_per_node} GPUs is more than {MAX_SIZE} GPUs."
        )


def derive(plan: Plan) -> Layout:
    """The layout Megatron would build from ``plan``, or ``LayoutError``."""
    _check_sizes(plan)
    rule = _broken(plan)
    if rule is not None:
        said = rule.says(plan)
        fix, verdict = _nearby(plan, rule)
        hint = f"; {_choice(*fix)} {verdict}" if fix is not None else (verdict and f"; {verdict}")
        raise LayoutError(f"{said}{hint}.", said, fix, verdict)
    warnings: list[str] = []
    if plan.sp and plan.torch_norms:
        warnings.append(
            "sequence parallel with the local LayerNorm needs apex (its FusedLayerNorm); "
            "torch's norm refuses it"
        )
    if plan.tp > plan.gpus_per_node:
        # allowed by Megatron; its all-reduces then cross the network on every layer
        warnings.append(
            f"TP {plan.tp} is larger than the {plan.gpus_per_node} GPUs of a node: "
            "tensor-parallel all-reduces will cross nodes"
        )
    return Layout(plan, tuple(warnings))


def parse_size(name: str, text: str | int | None) -> int | None:
    """A size given as text (from a script's environment); '' and None mean unset."""
    if text is None or text == "":
        return None
    if isinstance(text, int):
        return text
    # exactly what bash arithmetic reads the same way: no sign, space or leading zero (bash
    # takes 08 for octal), so a value the check accepts is the value the script passes on
    if not _CANONICAL.fullmatch(text) or len(text) > 7:
        raise LayoutError(
            f"{name} must be an integer from 1 to {MAX_SIZE}, written in plain digits without "
            f"a leading zero or spaces (got {text!r})."
        )
    return int(text)


def parse_sequence_parallel(text: str | None) -> str:
    """``auto``/``on``/``off``, also accepting 1/0, true/false, yes/no (shell habits)."""
    value = (text or "auto").strip().lower()
    value = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(
        value, value
    )
    if value not in SEQUENCE_PARALLEL:
        raise LayoutError(f"SEQUENCE_PARALLEL must be auto, on or off (or 1/0); got {text!r}.")
    return value


MODEL_FACTS = {
    "layers": "num-layers",
    "heads": "num-attention-heads",
    "query_groups": "num-query-groups",
    "experts": "num-experts",
    "seq_length": "seq-length",
    "micro_batch": "micro-batch-size",
    "global_batch": "global-batch-size",
}
"""Plan fields read from a model's args under a profile (Megatron flag names)."""


def model_facts(args: Mapping[str, object], who: str) -> dict[str, Any]:
    """The plan's model and batch fields from a model's merged Megatron args."""
    facts: dict[str, Any] = {
        "transformer_impl": str(args.get("transformer-impl", "local")),
        "normalization": str(args.get("normalization", "LayerNorm")),
    }
    for name, flag in MODEL_FACTS.items():
        value = args.get(flag)
        if name == "query_groups" and not args.get("group-query-attention"):
            value = None  # Megatron uses one group per head without --group-query-attention
        if value is None:
            if name in ("query_groups", "experts"):
                facts[name] = None
                continue
            raise LayoutError(f"{who}: args has no {flag}, which the parallel layout needs.")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"{who}: args.{flag} must be a positive integer (got {value!r}).")
        facts[name] = value
    return facts


TEXT_FIELDS = {
    "gpus_per_node": "--gpus-per-node (GPUS_PER_NODE)",
    "nodes": "--nodes (NNODES)",
    "tp": "--tp (TP)",
    "pp": "--pp (PP)",
    "cp": "--cp (CP)",
    "ep": "--ep (EP)",
    "etp": "--etp (ETP)",
    "vpp": "--vpp (VPP)",
    "micro_batch": "--micro-batch (MICRO_BATCH_SIZE)",
    "global_batch": "--global-batch (GLOBAL_BATCH_SIZE)",
    "layers": "--num-layers",
    "heads": "--heads",
    "query_groups": "--query-groups",
    "experts": "--experts",
    "seq_length": "--seq-length",
}
"""Plan fields given as text, with the name a refusal uses: the option of `quantpatch layout`
and, for the sizes a launch script takes from its environment, that variable."""
_REQUIRED = {
    "layers": "--num-layers",
    "heads": "--heads",
    "seq_length": "--seq-length",
    "micro_batch": "--micro-batch",
    "global_batch": "--global-batch",
}


def plan_from_text(
    given: Mapping[str, str | int | None],
    base: Plan | None = None,
    gpus: str | int | None = None,
) -> Plan:
    """A plan from values given as text (``None``/'' = not given), over ``base`` (a model's
    plan under a profile) when there is one. ``gpus`` (the total) sets the nodes from GPUs
    per node (8 unless given or the base says otherwise)."""
    values: dict[str, Any] = {}
    for name, label in TEXT_FIELDS.items():
        parsed = parse_size(label, given.get(name))
        if parsed is not None:
            values[name] = parsed
    for name in ("sequence_parallel", "transformer_impl", "normalization"):
        text = given.get(name)
        if text not in (None, ""):
            values[name] = (
                parse_sequence_parallel(str(text)) if name == "sequence_parallel" else str(text)
            )
    if given.get("etp") == "" and base is not None:
        values["etp"] = None  # ETP='' in a script: expert TP follows TP
    total = parse_size("--gpus", gpus)
    if total is not None:
        per_node = values.get("gpus_per_node", base.gpus_per_node if base else 8)
        if "nodes" in values:
            if values["nodes"] * per_node != total:
                raise LayoutError(
                    f"--gpus {total} does not match {_s(values['nodes'], 'node')} x {per_node} "
                    f"GPUs per node = {values['nodes'] * per_node}; give either --gpus or --nodes."
                )
        elif total < per_node:
            per_node, values["nodes"] = total, 1
        elif total % per_node:
            raise LayoutError(
                f"--gpus {total} is not a whole number of {per_node}-GPU nodes; "
                f"{total - total % per_node} or {total - total % per_node + per_node} GPUs "
                "would be."
            )
        else:
            values["nodes"] = total // per_node
        values["gpus_per_node"] = per_node
    if base is not None:
        return replace(base, **values)
    missing = [_REQUIRED[n] for n in _REQUIRED if n not in values]
    if missing:
        raise LayoutError(f"a layout needs --model or {', '.join(missing)}.")
    values.setdefault("gpus_per_node", 8)
    values.setdefault("nodes", 1)
    return Plan(**values)


LOCAL_HOSTS = ("", "localhost", "127.0.0.1", "::1")
_HOST = re.compile(r"[A-Za-z0-9_.:%\[\]-]{1,253}")
"""A host name, IPv4 or (bracketed) IPv6 address: what torchrun's rendezvous endpoint takes."""


def check_rendezvous(
    nodes: int, node_rank: str | None, master_addr: str | None, master_port: str | None = None
) -> None:
    """What a multi-node launch needs besides sizes: every node must reach ``MASTER_ADDR``
    (``localhost`` is each node's own), and a static rendezvous needs each node's own rank."""
    if master_addr is not None and master_addr and not _HOST.fullmatch(master_addr):
        raise LayoutError(
            f"MASTER_ADDR (--master-addr) must be a host name or an IP address (got "
            f"{master_addr!r})."
        )
    if nodes > 1 and master_addr is not None and master_addr.strip() in LOCAL_HOSTS:
        raise LayoutError(
            f"NNODES={nodes} needs MASTER_ADDR set to a host every node reaches (it is "
            f"{master_addr.strip() or 'empty'})."
        )
    if master_port is not None and (
        not re.fullmatch(r"[1-9][0-9]{0,4}", master_port) or int(master_port) > 65535
    ):
        raise LayoutError(f"MASTER_PORT must be a port from 1 to 65535 (got {master_port!r}).")
    if node_rank is not None and (
        not re.fullmatch(r"0|[1-9][0-9]{0,6}", node_rank) or int(node_rank) >= nodes
    ):
        raise LayoutError(
            f"NODE_RANK must be one of 0-{nodes - 1} for NNODES={nodes} (got {node_rank!r})."
        )
