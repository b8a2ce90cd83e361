"""``check``, ``set`` and ``restore``: plain functions over typed inputs and outputs.

``set`` in branch mode (the default) records the base (branch + commit) the first time, plans
the new sources from the *base* files (so switches never stack), creates or reuses the branch
``<prefix>/linear-X_qk-Y_pv-Z`` on the base's current tip with git's plumbing (see
``scheme_branch``), records the intent before it changes anything, and checks the branch out
without ever forcing. ``restore`` checks the base out again and clears the record.
``--no-branch`` (in-place) mode keeps the original bytes under the state directory instead.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantpatch import __version__
from quantpatch.base.config import (
    GEMMS,
    KEYS,
    ROLES,
    Targets,
    is_paretoq,
    load_targets,
    per_gemm,
    validate_bf16_layers,
    validate_value,
)
from quantpatch.base.edits import (
    Edit,
    apply_edits,
    journaled,
    read_exact,
    sha256_text,
    unified_diff,
    write_exact,
)
from quantpatch.base.errors import UserError
from quantpatch.checkout.parts import LAYERS_MODULE, PartStatus, parts_status, runtime_source
from quantpatch.checkout.saver import SaverStatus
from quantpatch.checkout.saver import status as saver_status
from quantpatch.git import repo as gitrepo
from quantpatch.git.installs import upgrade_interrupted
from quantpatch.git.state import (
    Base,
    CheckoutState,
    Current,
    HistoryEntry,
    KeptFile,
    Mode,
    Pending,
)
from quantpatch.sites import cache as site_cache
from quantpatch.sites.model import Site, refuse_links, role_values

if TYPE_CHECKING:  # libcst is imported only by the commands that rewrite
    from quantpatch.sites.discovery import FileSites


# -- check ----------------------------------------------------------------------------------


@dataclass
class CheckReport:
    root: Path
    sites: list[Site]
    roles: dict[str, str | None]
    mismatched: dict[str, list[Site]]
    git: gitrepo.GitInfo | None
    base: BaseStatus | None
    saver: SaverStatus
    warnings: list[str] = field(default_factory=list)
    """What is wrong around the sites (an unreadable record, an interrupted write)."""
    parts: list[PartStatus] = field(default_factory=list)
    """Every installed part: current, older or edited (``quantpatch.checkout.parts``)."""

    def problems(self, expect: Mapping[str, str] | None = None) -> list[str]:
        """Why the check does not hold (empty when it does)."""
        out = []
        for role, members in self.mismatched.items():
            where = ", ".join(f"{s.file}:{s.line}={s.value}" for s in members)
            out.append(f"the {role} sites disagree ({where}).")
        for role, want in (expect or {}).items():
            if role == "parts":
                out += [
                    f"the installed part {p.part} is {p.status}, expected current"
                    + (f" ({p.detail})." if p.detail else ".")
                    for p in self.parts
                    if p.status != "current"
                ]
            elif self.roles.get(role) != want:
                out.append(f"{role} is {self.roles.get(role)}, expected {want}.")
        if expect and not out:
            out += self._unknown_to_dispatch(expect)
        return out

    def _unknown_to_dispatch(self, expect: Mapping[str, str]) -> list[str]:
        """A value that is written but that a site's dispatch has no branch for does not
        hold: the run would silently compute its fallback (the stock bf16 product)."""
        from quantpatch.sites.model import (
            NO_OPS,
            OPS_VALUES,
            OpsValues,
            unknown_sentence,
            unknown_to_dispatch,
        )

        ops: OpsValues = NO_OPS
        doubtful = [
            s
            for s in self.sites
            if s.knows is not None
            and any(r in expect and expect[r] not in c for r in s.roles for c in s.knows)
        ]
        if any(OPS_VALUES in c for s in doubtful for c in s.knows or ()):
            from quantpatch.sites.discovery import (
                read_ops_values,  # libcst: only where it is needed
            )

            ops = read_ops_values(*ops_text_in(self.root))
        found = unknown_to_dispatch(doubtful, expect, ops)
        if found is None:
            return []
        site, role = found
        return [unknown_sentence(site, role, expect[role], ops, f"--expect {role}") + "."]

    def as_json(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "sites": [s.as_json() for s in self.sites],
            "roles": {r: self.roles.get(r) for r in ROLES},
            "gemms": {g: self.roles.get(g) for g in GEMMS},
            "bf16_layers": self.roles.get("bf16_layers"),
            "mismatched": sorted(self.mismatched),
            "git": self.git.as_json() if self.git else None,
            "base": self.base.as_json() if self.base else None,
            "saver": self.saver.as_json(),
            "parts": [p.as_json() for p in self.parts],
            "warnings": self.warnings,
        }


def parse_expect(text: str) -> dict[str, str]:
    """``linear=X,qk=Y,pv=Z`` (any subset; ``fprop``/``dgrad``/``wgrad`` for the linear
    GEMMs one by one, ``bf16_layers=first:2,last:8`` or ``none`` for the layer policy) into a
    mapping; bad keys are refused."""
    out: dict[str, str] = {}
    parts: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part and parts and parts[-1].startswith("bf16_layers="):
            parts[-1] += "," + part  # bf16_layers=first:2,last:8: the policy's own commas
        else:
            parts.append(part)
    for part in parts:
        role, sep, value = part.partition("=")
        if role == "parts" and value == "current":  # every installed part this version's
            out[role] = value
            continue
        if role == "bf16_layers" and sep:
            out[role] = validate_bf16_layers(value, "--expect bf16_layers") or "none"
            continue
        if not sep or role not in KEYS or not value:
            raise UserError(
                f"--expect: '{part}' is not role=value with a role among {', '.join(KEYS)} "
                "(or parts=current)."
            )
        out[role] = validate_value(
            value,
            allow_unknown=False,
            where=f"--expect {role}",
            role="linear" if role in GEMMS else role,
        )
    return out


def _no_sites(targets: Targets) -> UserError:
    return UserError(
        f"{', '.join(targets.all_files)}: no custom_quant_type sites found; run "
        "'quantpatch init' to add them to this stock checkout."
    )


def _discover_checked(root: Path, targets: Targets) -> list[FileSites]:
    from quantpatch.sites.discovery import discover

    files = discover(root, targets)
    if not any(f.sites for f in files):
        raise _no_sites(targets)
    return files


def check(path: Path | None, *, fresh: bool = False) -> CheckReport:
    """The sites and state of a checkout. ``fresh`` reads every target file anew instead of
    believing the discovery cache: what ``check --expect`` (the verification each launch
    script runs) does, so no cache entry, however it was altered, can make it pass."""
    with checking(path, fresh=fresh) as report:
        return report()


@contextlib.contextmanager
def checking(path: Path | None, *, fresh: bool = False) -> Iterator[Callable[[], CheckReport]]:
    """``check`` in two halves: entering starts what can run beside this process (``git
    status``, and the parsing of whatever the discovery cache lacks, in a forked child);
    calling what it yields waits for both and makes the report. What the caller does in
    between (the CLI imports rich there) costs no time of its own.

    ``fresh`` never reads the checkout's cache: the child then fills a private directory,
    made for this call and removed after it, which holds nothing but what it parsed now."""
    checkout = gitrepo.find_checkout(path, need_git=False)
    targets = load_targets(checkout.root)
    with contextlib.ExitStack() as stack:
        cache, ahead = stack.enter_context(
            site_cache.parsed_ahead(
                checkout.root, targets, None if fresh else checkout.state_dir / "cache"
            )
        )
        git_info = None
        if checkout.has_git:  # git status runs while the target files are read
            git_info = stack.enter_context(gitrepo.git_info_started(checkout))
        yield lambda: _check(checkout, targets, git_info, cache, ahead)


def policy_in(root: Path, targets: Targets) -> Any:
    """The BF16 layer policy of the checkout's linear file (None: it has none)."""
    from quantpatch.sites.policy import POLICY_NAME, find_policy

    for rel in targets.linear:
        text = read_exact(root / rel) if (root / rel).is_file() else None
        if text is not None and POLICY_NAME in text:
            return find_policy(text, rel)
    return None


def _check(
    checkout: gitrepo.Checkout,
    targets: Targets,
    git_info: Callable[[], gitrepo.GitInfo] | None,
    cache: Path | None,
    ahead: site_cache.Ahead | None,
) -> CheckReport:
    found = site_cache.read_found(checkout.root, targets, cache, ahead)
    sites = [s for file_found in found for s in file_found.sites]
    if not sites:
        raise _no_sites(targets)
    roles, mismatched = role_values(sites)
    policy = site_cache.policy_of(targets, found)  # cached with the sites: no libcst here
    if policy is not None:
        roles["bf16_layers"] = policy.value or "none"
    problems_found: list[str] = []
    try:
        state = gitrepo.load_state(checkout)
    except UserError as exc:  # a read-only command still reports what it can
        state = None
        problems_found.append(str(exc))
    upgrading = upgrade_interrupted(checkout)
    if upgrading:  # whether killed while writing its files or after: upgrade finishes it
        problems_found.append(
            "a quantpatch upgrade was interrupted; run 'quantpatch upgrade' again to finish it."
        )
    elif gitrepo.journal_dir(checkout).exists():
        problems_found.append(
            "a quantpatch write was interrupted; the next set or restore finishes it."
        )
    try:
        parts = parts_status(checkout, targets, set_active=bool(state), upgrading=upgrading)
    except UserError as exc:  # an unreadable install record
        parts = []
        problems_found.append(str(exc))
    base = None
    if state:
        base = BaseStatus(state)
        if checkout.has_git and state.mode is Mode.BRANCH:
            branch = state.base.branch
            tip = (branch and gitrepo.branch_tip_plain(checkout, branch)) or state.base.commit
            if tip != state.base.commit:
                base.moved_to = tip
    return CheckReport(
        root=checkout.root,
        sites=sites,
        roles=roles,
        mismatched=mismatched,
        git=git_info() if git_info else None,
        base=base,
        saver=saver_status(checkout),
        warnings=problems_found,
        parts=parts,
    )


@dataclass
class BaseStatus:
    """The active set as ``check`` shows it: its mode and base, its scheme branch, where the
    base branch has moved to since (None: nowhere), and the intent of an interrupted set."""

    state: CheckoutState
    moved_to: str | None = None

    def as_json(self) -> dict[str, object]:
        state = self.state
        return {
            "mode": state.mode.value,
            **state.base.as_dict(),
            "current": state.current.branch if state.current else None,
            "moved_to": self.moved_to,
            "interrupted": state.pending.as_dict() if state.pending else None,
        }


# -- set ------------------------------------------------------------------------------------


@dataclass
class SetRequest:
    values: dict[str, str]
    """The roles named on the command line (the others keep their current values)."""
    dry_run: bool = False
    branch: bool = True
    split: bool = True
    allow_unknown: bool = False
    bf16_layers: str | None = None
    """The BF16 layer policy to write (None: keep the checkout's; '' or 'none': no policy)."""


@dataclass
class SetResult:
    values: dict[str, str]
    edits: list[Edit]
    diff: str
    branch: str | None = None
    commit: str | None = None
    base: Base | None = None
    reused: bool = False
    how: str = ""
    """created, reused or rebuilt (branch mode)."""
    notes: list[str] = field(default_factory=list)

    def as_json(self, dry_run: bool) -> dict[str, Any]:
        """What ``set --json`` prints."""
        return {
            "values": self.values,
            "branch": self.branch,
            "commit": self.commit,
            "base": self.base.as_dict() if self.base else None,
            "reused": self.reused,
            "dry_run": dry_run,
            "diff": self.diff,
            "notes": self.notes,
        }


def _resolve_values(requested: Mapping[str, str], sites: Sequence[Site]) -> dict[str, str]:
    """The values the sites will hold: those named, the current ones for the rest. The
    linear GEMMs (``--fprop``/``--dgrad``/``--wgrad``) need a site each; the result holds
    ``linear`` where they agree and the three GEMMs where they differ (``per_gemm``)."""
    current, mismatched = role_values(sites)
    named_gemms = [g for g in GEMMS if g in requested]
    linear_sites = [s for s in sites if s.role == "linear" and s.kind != "dynamic"]
    tagged = bool(linear_sites) and {s.gemm for s in linear_sites} >= set(GEMMS)
    present = {r for s in sites for r in s.roles}
    out = {
        role: value
        for role in ROLES
        if (value := _role_value(role, requested, current, mismatched, present, named_gemms))
        is not None
    }
    if named_gemms and not tagged:
        where = linear_sites[0].file if linear_sites else "the checkout"
        raise UserError(
            f"--{named_gemms[0]}: {where} has no linear site of its own for each of the forward, "
            "input-gradient and weight-gradient GEMMs, so they cannot differ; use --linear."
        )
    if tagged and "linear" not in requested and (named_gemms or current["linear"] is None):
        out.update(_values_of(GEMMS, requested, current, mismatched))
    elif named_gemms:
        out.update({g: requested[g] for g in named_gemms})
    resolved = per_gemm(out)
    if any(is_paretoq(resolved[g]) for g in GEMMS if g in resolved):
        raise UserError(
            "--fprop/--dgrad/--wgrad: a ParetoQ value quantizes the layer's weight once for all "
            f"three GEMMs ({', '.join(f'{g}={resolved[g]}' for g in GEMMS)}); use --linear."
        )
    return resolved


def _values_of(
    names: Sequence[str],
    requested: Mapping[str, str],
    current: Mapping[str, str | None],
    mismatched: Mapping[str, Sequence[Site]],
) -> dict[str, str]:
    """Each GEMM's value (``_own_value``), those that have one."""
    found = {g: _own_value(g, requested, current, mismatched) for g in names}
    return {g: v for g, v in found.items() if v is not None}


def _own_value(
    name: str,
    requested: Mapping[str, str],
    current: Mapping[str, str | None],
    mismatched: Mapping[str, Sequence[Site]],
) -> str | None:
    """A role's (or GEMM's) value: the one named, else its sites' one (refused where they
    disagree), else None."""
    if name in requested:
        return requested[name]
    if name in mismatched:
        where = ", ".join(f"{s.file}:{s.line}" for s in mismatched[name])
        raise UserError(f"the {name} sites disagree ({where}); name --{name} to set them all.")
    return current[name]


def _role_value(
    role: str,
    requested: Mapping[str, str],
    current: Mapping[str, str | None],
    mismatched: Mapping[str, Sequence[Site]],
    present: set[str],
    named_gemms: Sequence[str],
) -> str | None:
    """A role's value (``_own_value``); a named role needs a site, and linear sites that
    differ by GEMM keep ``linear`` unset (the GEMMs say) unless it is named."""
    if role in requested and role not in present:
        raise UserError(f"--{role}: the checkout has no {role} site to set.")
    if role == "linear" and role not in requested and (named_gemms or role not in mismatched):
        return current[role]
    return _own_value(role, requested, current, mismatched)


def _plan(
    files: Sequence[FileSites],
    values: Mapping[str, str],
    targets: Targets,
    split: bool,
    cache_dir: Path,
) -> dict[str, str]:
    """New text per file, each proven by re-discovery (whose result primes the cache)."""
    from quantpatch.sites.codemods.set_value import keep_bom, plan_module, verify_rewrite
    from quantpatch.sites.policy import find_policy

    planned = {}
    for fs in files:
        module = plan_module(fs, values, split=split)
        new_text = fs.text if module is None else keep_bom(fs.text, module.code)
        kind = targets.kind_of(fs.rel)
        if kind == "linear":
            with_policy = _planned_policy(new_text, fs.rel, values.get("bf16_layers", ""))
            if with_policy != new_text:
                new_text, module = with_policy, None
        new = (
            verify_rewrite(fs, new_text, values, kind, module=module) if new_text != fs.text else fs
        )
        policy = find_policy(new_text, fs.rel, new.module) if kind == "linear" else None
        site_cache.store(cache_dir, fs.rel, kind, new_text, new.sites, policy)
        planned[fs.rel] = new_text
    return planned


def _planned_policy(text: str, rel: str, spec: str) -> str:
    """``text`` with its BF16 layer policy literal holding ``spec`` (unchanged where it has
    none: ``_with_policy`` refuses a policy there)."""
    from quantpatch.sites.policy import find_policy, write_policy

    policy = find_policy(text, rel)
    if policy is None or policy.value == spec:
        return text
    return write_policy(text, rel, spec)


def _with_policy(
    values: dict[str, str],
    requested: str | None,
    files: Sequence[FileSites],
    targets: Targets,
) -> dict[str, str]:
    """``values`` with the BF16 layer policy in force (``bf16_layers``: the one requested,
    else the checkout's), refused before anything changes where no code would honour it: no
    policy site (a checkout ``init`` has not seen), a linear dispatch whose branch for a
    GEMM's value does not go through ``quantpatch_ops`` (a fork's own op), ParetoQ values."""
    from quantpatch.sites.policy import POLICY_NAME, find_policy, unhonoured

    linear = [f for f in files if targets.kind_of(f.rel) == "linear"]
    policies = [p for f in linear if (p := find_policy(f.text, f.rel)) is not None]
    current = policies[0].value if policies else None
    spec = validate_bf16_layers(current or "" if requested is None else requested)
    out = {k: v for k, v in values.items() if k != "bf16_layers"}
    if not spec:
        return out
    if not policies:
        where = linear[0].rel if linear else "the linear file"
        raise UserError(
            f"--bf16-layers: {where} has no {POLICY_NAME} policy, so nothing would keep those "
            "layers in BF16; 'quantpatch init' adds it and routes the linear dispatches "
            "through quantpatch_ops, which honours it."
        )
    for f in linear:
        why = unhonoured(f.text, f.rel, out)
        if why:
            raise UserError(f"--bf16-layers: {why}.")
    if any(is_paretoq(v) for k, v in out.items() if k in ("linear", *GEMMS)):
        raise UserError(
            "--bf16-layers: ParetoQ layers quantize their own weights, which the policy does "
            "not reach; use another linear value or no policy."
        )
    return {**out, "bf16_layers": spec}


def _discover_text(text: str, rel: str, targets: Targets) -> FileSites:
    from quantpatch.sites.discovery import discover_source

    return discover_source(text, rel, targets.kind_of(rel))


OpsTexts = tuple[str | None, str | None]
"""The checkout's installed ``quantpatch_ops.py`` and ``quantpatch_formats.py`` (the format
spec it takes its values from), each None where it is not there."""


def ops_text_at(repo: Any, commit: str) -> OpsTexts:
    """The checkout's installed ops module and format spec at ``commit`` (in the package, or
    where a release before it put them: the modules its site code imports)."""
    from quantpatch.checkout.parts import FORMATS_MODULE, OPS_MODULE

    def read(rel: str) -> str | None:
        try:
            return gitrepo.read_at(repo, commit, rel)
        except (UserError, UnicodeDecodeError):
            return None

    return _installed(read, OPS_MODULE), _installed(read, FORMATS_MODULE)


def ops_text_in(root: Path) -> OpsTexts:
    """The checkout's installed ops module and format spec in the work tree."""
    from quantpatch.checkout.parts import FORMATS_MODULE, OPS_MODULE

    def read(rel: str) -> str | None:
        return read_exact(root / rel) if (root / rel).is_file() else None

    return _installed(read, OPS_MODULE), _installed(read, FORMATS_MODULE)


def _installed(read: Callable[[str], str | None], rel: str) -> str | None:
    """The runtime file ``rel`` as ``read`` finds it in the package, else where the releases
    before the package installed it (a checkout not upgraded yet: its sites import that one)."""
    from quantpatch.checkout.parts import flat

    text = read(rel)
    return read(flat(rel)) if text is None else text


def refuse_unknown_to_dispatch(
    files: Sequence[FileSites], values: Mapping[str, str], ops_texts: OpsTexts
) -> None:
    """Refuse (before anything changes) a value that a site's dispatch has no branch for:
    in a fork's explicit ``if custom_quant_type == 'mxfp8': ... else: <stock>`` chain it
    would silently run the stock bf16 product. Label sites, and dispatches that are not a
    plain chain of comparisons with literals, are never refused: what they accept cannot be
    read. The ops module is read only where a chain hands values on to it."""
    from quantpatch.sites.model import NO_OPS, OPS_VALUES, unknown_sentence, unknown_to_dispatch

    sites = [s for f in files for s in f.sites]
    ops = NO_OPS
    if any(OPS_VALUES in chain for s in sites for chain in s.knows or ()):
        from quantpatch.sites.discovery import read_ops_values

        ops = read_ops_values(*ops_texts)
    found = unknown_to_dispatch(sites, values, ops)
    if found is not None:
        site, role = found
        raise UserError(
            unknown_sentence(site, role, values[role], ops, f"--{role}")
            + " (--allow-unknown writes it anyway)."
        )
    refuse_paretoq_without_steps(sites, values.get("linear"))


def refuse_paretoq_without_steps(sites: Sequence[Site], linear: str | None) -> None:
    """A ParetoQ value needs its steps (alpha) created by the parallel linear layers' constructors
    (``init`` adds those sites): without them the products pass the weight through as the
    layer would have quantized it, so the run would train unquantized weights, silently."""
    from quantpatch.base.config import is_paretoq
    from quantpatch.sites.codemods.init_sites import STEP_CONSTRUCTORS

    if linear is None or not is_paretoq(linear):
        return
    linear_sites = [s for s in sites if s.role == "linear"]
    have = {s.function for s in linear_sites if s.function in STEP_CONSTRUCTORS}
    if linear_sites and have != set(STEP_CONSTRUCTORS):
        missing = " and ".join(f for f in STEP_CONSTRUCTORS if f not in have)
        raise UserError(
            f"--linear: '{linear}' trains learnable steps that the parallel linear layers "
            f"create in their constructors, and {linear_sites[0].file} has no site in "
            f"{missing}, so its layers would run unquantized weights; 'quantpatch init' adds "
            "them (--allow-unknown writes it anyway)."
        )


def plan_from_base(
    repo: Any,
    commit: str,
    targets: Targets,
    values: Mapping[str, str],
    split: bool,
    cache_dir: Path,
    current_files: Sequence[FileSites] = (),
    *,
    known: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """The target files at ``commit`` and their planned, verified new texts. ``known``:
    the values that each of their sites' dispatches must know (``refuse_unknown_to_dispatch``
    at ``commit``)."""
    base_texts = {rel: gitrepo.read_at(repo, commit, rel) for rel in targets.all_files}
    current_by_rel = {fs.rel: fs for fs in current_files}
    base_files = [
        current_by_rel[rel]
        if rel in current_by_rel and current_by_rel[rel].text == text  # same bytes: same sites
        else _discover_text(text, rel, targets)
        for rel, text in base_texts.items()
    ]
    if not any(f.sites for f in base_files):
        raise _no_sites(targets)
    if known:
        refuse_unknown_to_dispatch(base_files, known, ops_text_at(repo, commit))
    if values.get("bf16_layers"):
        _with_policy(dict(values), values["bf16_layers"], base_files, targets)

        def read(rel: str) -> str | None:
            try:
                return gitrepo.read_at(repo, commit, rel)
            except UserError:
                return None  # no policy runtime: _with_policy refused the checkout already

        refuse_older_policy(values["bf16_layers"], _installed(read, LAYERS_MODULE))
    return base_texts, _plan(base_files, values, targets, split, cache_dir)


def refuse_older_policy(spec: str, installed: str | None) -> None:
    """A policy with ``output`` needs the policy runtime of this version: an earlier one
    refuses the item when the linear file imports it (at training time); refused here
    instead, naming the command that installs it."""
    if "output" not in spec.split(",") or installed is None:
        return
    if installed != runtime_source(LAYERS_MODULE):
        raise UserError(
            f"--bf16-layers: 'output' needs the policy runtime of quantpatch {__version__}, "
            "but the checkout's quantpatch_layers.py is another one; run 'quantpatch "
            "upgrade' (or leave out output)."
        )


def set_values(path: Path | None, req: SetRequest) -> SetResult:
    for role, value in req.values.items():
        validate_value(
            value,
            allow_unknown=req.allow_unknown,
            where=f"--{role}",
            role="linear" if role in GEMMS else role,
        )
    checkout = gitrepo.find_checkout(path, need_git=req.branch, no_branch_hint=True)
    targets = load_targets(checkout.root)
    if req.dry_run:
        with checkout:  # its git processes end with it, as the lock's end does below
            return _set_unlocked(checkout, targets, req)
    with gitrepo.locked(checkout):
        gitrepo.recover(checkout)
        return _set_unlocked(checkout, targets, req)


def _must_know(req: SetRequest) -> dict[str, str]:
    """The values the sites' dispatches must know: those named, unless --allow-unknown."""
    return {} if req.allow_unknown else dict(req.values)


def _set_unlocked(checkout: gitrepo.Checkout, targets: Targets, req: SetRequest) -> SetResult:
    from quantpatch.git.installs import refuse_pending_upgrade

    refuse_pending_upgrade(checkout, "a set")
    refuse_links(checkout.root, targets.all_files)
    current_files = _discover_checked(checkout.root, targets)
    values = _resolve_values(req.values, [s for f in current_files for s in f.sites])
    values = _with_policy(values, req.bf16_layers, current_files, targets)
    if values.get("bf16_layers"):
        root = checkout.root
        installed = _installed(
            lambda rel: read_exact(root / rel) if (root / rel).is_file() else None, LAYERS_MODULE
        )
        refuse_older_policy(values["bf16_layers"], installed)
    state = gitrepo.load_state(checkout)
    if state and state.mode is not (Mode.BRANCH if req.branch else Mode.IN_PLACE):
        other = "--no-branch" if state.mode is Mode.IN_PLACE else "branch"
        raise UserError(
            f"a {other} set is active on this checkout; run 'quantpatch restore' first."
        )
    if req.branch:
        return _set_branch(checkout, targets, req, values, current_files, state)
    return _set_in_place(checkout, targets, req, values, current_files, state)


def _refuse_dirty(repo: Any, targets: Targets) -> None:
    dirty = gitrepo.dirty_paths(repo, targets.all_files)
    if dirty:
        raise UserError(f"uncommitted changes to {', '.join(dirty)}; commit or stash them first.")


def _base_of(
    repo: Any, targets: Targets, state: CheckoutState | None, head: str, notes: list[str]
) -> Base:
    """The base of this set: the record's, or the checkout as it is. A scheme branch with no
    record (a set killed before it wrote one, by an older quantpatch) is never taken as the
    base: the base is recovered from its quantpatch commit, or the set is refused."""
    from quantpatch.git import scheme_branch  # GitPython: only commands that write load it

    if state:
        return state.base
    branch = gitrepo.active_branch(repo)
    if not scheme_branch.is_scheme_branch(branch, targets.branch_prefix):
        if branch is None:
            notes.append(f"HEAD is detached at {head[:12]}; restore will check that commit out.")
        return Base(branch, head)
    for commit in repo.iter_commits(head, max_count=50, first_parent=True):
        recovered = scheme_branch.base_from_commit(repo, commit.hexsha)
        if recovered is None and str(commit.message).startswith(scheme_branch.SUBJECT_PREFIX):
            recovered = Base(None, commit.parents[0].hexsha)
        if recovered is not None:
            notes.append(
                f"{branch} is a scheme branch with no quantpatch record; recovered the base "
                f"{recovered.branch or 'detached'} @ {str(recovered.commit)[:12]} from its commit."
            )
            return recovered
    raise UserError(
        f"HEAD is on the scheme branch {branch} and no quantpatch record says where it came "
        "from; check out your own branch ('git checkout <branch>') and run set again."
    )


def base_tip(repo: Any, base: Base) -> str:
    """The commit a scheme branch must sit on: the base branch as it is now (the recorded
    commit when the base is a detached HEAD or its branch is gone)."""
    tip = gitrepo.branch_tip(repo, base.branch) if base.branch else None
    return tip or str(base.commit)


def _set_branch(
    checkout: gitrepo.Checkout,
    targets: Targets,
    req: SetRequest,
    values: dict[str, str],
    current_files: Sequence[FileSites],
    state: CheckoutState | None,
) -> SetResult:
    from quantpatch.git import scheme_branch

    repo = checkout.git()
    head = gitrepo.head_commit(repo)
    if head is None:
        raise UserError(
            f"{checkout.root}: the repository has no commit yet; commit the sources first."
        )
    _refuse_dirty(repo, targets)
    scheme_branch.check_prefix(repo, targets)
    notes: list[str] = []
    base = _base_of(repo, targets, state, head, notes)
    tip = base_tip(repo, base)
    if tip != base.commit:
        notes.append(
            f"the base {base.branch} moved on ({str(base.commit)[:12]} -> {tip[:12]}); the "
            "scheme branch is built on its new tip."
        )
    base = replace(base, commit=tip)
    _, planned = plan_from_base(
        repo,
        tip,
        targets,
        values,
        req.split,
        checkout.state_dir / "cache",
        current_files,
        known=_must_know(req),
    )
    edits = [Edit(fs.rel, fs.text, planned[fs.rel]) for fs in current_files]
    result = SetResult(values=values, edits=edits, diff=unified_diff(edits), base=base, notes=notes)
    name = scheme_branch.branch_name(values, targets.branch_prefix)
    result.branch = name
    if req.dry_run:
        return result

    history = state.history if state else []
    record = CheckoutState(
        mode=Mode.BRANCH,
        base=base,
        current=state.current if state else None,
        history=history,
    )
    # objects only (a refusal here changes nothing anyone can see)
    plan = scheme_branch.plan_scheme_commit(repo, name, base, tip, planned, values)
    # the intent before the first visible change: whatever happens next, the record names
    # the real base
    gitrepo.save_state(checkout, replace(record, pending=Pending("set", name)))
    previous = gitrepo.active_branch(repo)
    try:
        if gitrepo.active_branch(repo) == name:
            if plan.moves:  # rebuilt under the user's feet: move with their local changes kept
                gitrepo.run_git(repo, "reset", "--quiet", "--keep", plan.commit)
        else:
            scheme_branch.move_ref(repo, plan)
            gitrepo.run_git(repo, "checkout", "--quiet", name)
            _written_or_back(repo, targets, previous, head)
    except UserError as exc:
        if gitrepo.active_branch(repo) == name and gitrepo.head_commit(repo) == plan.commit:
            # git switched and then a hook of the user's failed: the switch stands
            notes.append(f"{exc} (the branch was checked out all the same)")
        else:  # nothing visible happened: the branch and the record go back as they were
            scheme_branch.unmove_ref(repo, plan)
            if state:
                gitrepo.save_state(checkout, state)
            else:
                gitrepo.clear_state(checkout)
            raise UserError(f"{exc}\nNothing was changed.") from None
    result.commit = plan.commit
    result.reused = plan.state == "reused"
    result.how = plan.state
    if plan.state == "rebuilt":
        notes.append(
            f"rebuilt {name} on {base.branch or 'the base'} @ {tip[:12]}"
            + (f", carrying {len(plan.carried)} commit(s) of yours" if plan.carried else "")
            + "."
        )
    history.append(HistoryEntry(time=time.time(), values=values, branch=name, commit=plan.commit))
    gitrepo.save_state(checkout, replace(record, current=Current(name, values, commit=plan.commit)))
    return result


def _set_in_place(
    checkout: gitrepo.Checkout,
    targets: Targets,
    req: SetRequest,
    values: dict[str, str],
    current_files: Sequence[FileSites],
    state: CheckoutState | None,
) -> SetResult:
    kept = dict(state.files or {}) if state else {}
    if state:
        changed = [fs.rel for fs in current_files if sha256_text(fs.text) != kept[fs.rel].written]
        if changed:
            raise UserError(
                f"{', '.join(changed)} changed since quantpatch wrote them; "
                "restore or revert them first."
            )
    elif checkout.repo is not None:
        _refuse_dirty(checkout.repo, targets)
    if _must_know(req):
        refuse_unknown_to_dispatch(current_files, _must_know(req), ops_text_in(checkout.root))
    planned = _plan(current_files, values, targets, req.split, checkout.state_dir / "cache")
    edits = [Edit(fs.rel, fs.text, planned[fs.rel]) for fs in current_files]
    result = SetResult(values=values, edits=edits, diff=unified_diff(edits))
    if req.dry_run:
        return result
    if not state:
        originals = checkout.state_dir / "originals"
        for fs in current_files:
            dest = originals / fs.rel
            write_exact(dest, fs.text)
            original = str(dest.relative_to(checkout.state_dir))
            kept[fs.rel] = KeptFile(original, "", original_sha=sha256_text(fs.text))
    for rel, text in planned.items():
        kept[rel] = replace(kept[rel], written=sha256_text(text))
    history = [*(state.history if state else []), HistoryEntry(time=time.time(), values=values)]
    new_state = CheckoutState(
        mode=Mode.IN_PLACE,
        base=Base(None, None),
        current=Current(None, values),
        files=kept,
        history=history,
    )
    # journal (old texts + the record that marks completion) before the first replacement:
    # a kill anywhere below is rolled back, or found complete, by the next command
    record = checkout.state_dir / "state.json"
    with journaled(
        gitrepo.journal_dir(checkout), checkout.root, edits, record, gitrepo.state_text(new_state)
    ):
        apply_edits(checkout.root, edits)
        gitrepo.save_state(checkout, new_state)
    return result


# -- restore --------------------------------------------------------------------------------


@dataclass
class RestoreResult:
    mode: str
    base: Base | None
    files: list[str]
    notes: list[str] = field(default_factory=list)


def restore(path: Path | None, *, forget: bool = False) -> RestoreResult:
    """Back to the recorded base; with ``forget``, drop an unreadable or unwanted record and
    change no file or branch (the repair the state errors name)."""
    checkout = gitrepo.find_checkout(path, need_git=False)
    state_dir = checkout.state_dir
    if forget and (state_dir.is_symlink() or (state_dir.exists() and not state_dir.is_dir())):
        # quantpatch's state directory replaced by a file: set it aside (never deleted)
        aside = state_dir.with_name(f"{state_dir.name}.not-a-directory.{int(time.time())}")
        state_dir.rename(aside)
        return RestoreResult("forget", None, [], [f"moved {state_dir} aside to {aside}"])
    with gitrepo.locked(checkout):
        if forget:
            return _forget(checkout)
        gitrepo.recover(checkout)
        state = gitrepo.load_state(checkout)
        if not state:
            raise UserError(f"{checkout.root}: nothing to restore (no active quantpatch set).")
        targets = load_targets(checkout.root)
        if state.mode is Mode.IN_PLACE:
            return _restore_in_place(checkout, state)
        result = _restore_branch(checkout, targets, state)
        gitrepo.clear_state(checkout)
        return result


def _forget(checkout: gitrepo.Checkout) -> RestoreResult:
    record = checkout.state_dir / "state.json"
    if not record.exists() and not gitrepo.journal_dir(checkout).exists():
        raise UserError(f"{checkout.root}: no quantpatch record to forget.")
    gone = []
    if record.is_dir():
        shutil.rmtree(record)
    elif record.exists():
        record.unlink()
    gone.append(str(record))
    if gitrepo.journal_dir(checkout).exists():
        shutil.rmtree(gitrepo.journal_dir(checkout))
        gone.append(str(gitrepo.journal_dir(checkout)))
    return RestoreResult("forget", None, [], [f"dropped {', '.join(gone)}"])


def _restore_in_place(checkout: gitrepo.Checkout, state: CheckoutState) -> RestoreResult:
    edits = []
    for rel, info in (state.files or {}).items():
        current = read_exact(checkout.root / rel)
        if current is None or sha256_text(current) != info.written:
            raise UserError(f"{rel} changed since quantpatch wrote it; revert it first.")
        original_path = checkout.state_dir / info.original
        original = read_exact(original_path)
        if original is None or (info.original_sha and sha256_text(original) != info.original_sha):
            # a missing or altered copy is an error, never a reason to delete the file
            raise UserError(
                f"{original_path}: the kept original of {rel} is missing or altered, so "
                f"quantpatch cannot restore it; {rel} was left as it is."
            )
        edits.append(Edit(rel, current, original))
    record = checkout.state_dir / "state.json"
    with journaled(gitrepo.journal_dir(checkout), checkout.root, edits, record, None):
        written = apply_edits(checkout.root, edits)
        gitrepo.clear_state(checkout)
    return RestoreResult("in-place", state.base, written)


def _restore_branch(
    checkout: gitrepo.Checkout, targets: Targets, state: CheckoutState
) -> RestoreResult:
    repo = checkout.git()
    _refuse_dirty(repo, targets)
    base = state.base
    notes = []
    target = str(base.commit)  # a branch set's record always names it (load_state)
    if base.branch:
        tip = gitrepo.branch_tip(repo, base.branch)
        if tip is None:
            notes.append(f"branch {base.branch} no longer exists; checked out {target[:12]}.")
        else:
            target = base.branch
            if tip != base.commit:
                notes.append(
                    f"{base.branch} moved on since the set ({str(base.commit)[:12]} "
                    f"-> {tip[:12]}); it is checked out as it is now."
                )
    # never --force: the user's uncommitted changes in other files are carried as git does
    if gitrepo.active_branch(repo) != target:
        previous, before = gitrepo.active_branch(repo), gitrepo.head_commit(repo)
        gitrepo.run_git(repo, "checkout", "--quiet", target)
        try:
            _written_or_back(repo, targets, previous, str(before))
        except UserError as exc:
            raise UserError(f"{exc} Nothing was restored; the record is kept.") from None
    return RestoreResult("branch", base, list(targets.all_files), notes)


def _written_or_back(repo: Any, targets: Targets, previous: str | None, before: str) -> None:
    """After a checkout from commit ``before``: git reports success even when it could not
    replace a file (a read-only directory), so the target files are compared with the new
    HEAD. When one was not written, HEAD and the index go back to ``previous`` (a branch, or
    the commit itself) without touching that file (it still holds ``before``'s bytes); the
    files the checkout did write, which differ between the two commits and so held no change
    of the user's, are put back too. Then refuse, naming the file."""
    stale = gitrepo.dirty_paths(repo, targets.all_files)
    if not stale:
        return
    now = gitrepo.head_commit(repo)
    changed = [
        p for p in gitrepo.run_git(repo, "diff", "--name-only", before, str(now)).splitlines() if p
    ]
    if previous is not None and gitrepo.branch_exists(repo, previous):
        gitrepo.run_git(repo, "symbolic-ref", "HEAD", f"refs/heads/{previous}")
    else:
        gitrepo.run_git(repo, "update-ref", "--no-deref", "HEAD", before)
    if changed:
        gitrepo.run_git(repo, "reset", "--quiet", "--", *changed)
    written = [p for p in changed if p not in stale]
    if written:
        gitrepo.run_git(repo, "checkout", "--quiet", before, "--", *written)
    raise UserError(
        f"git switched branches but could not write {', '.join(stale)} (is its directory "
        "read-only?); switched back."
    )
