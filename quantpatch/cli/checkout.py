"""The checkout commands: ``check``, ``set``, ``restore``, ``saver``, ``init``, ``upgrade``,
``demo``."""

import sys
from pathlib import Path

import typer

from quantpatch.base.errors import CheckFailed
from quantpatch.base.values import value_list
from quantpatch.cli.app import (
    OPTS,
    VALUES,
    JsonOpt,
    RepoOpt,
    app,
    commit_note,
    emit_json,
    err,
    out,
    print_notes,
    repo_root,
)


@app.command()
def check(
    expect: str | None = typer.Option(
        None,
        "--expect",
        metavar="linear=X,qk=Y,pv=Z",
        help="Exit 1 unless the roles hold these values (fprop=, dgrad=, wgrad= for the linear "
        "GEMMs one by one).",
    ),
    repo: Path | None = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Show every site (role, file:line, function, value, form), git state, base and saver."""
    from quantpatch.checkout.switch import checking, parse_expect

    wanted = parse_expect(expect) if expect else None
    with checking(repo_root(repo), fresh=wanted is not None) as report_of:
        # imported while git status runs and a cold cache is filled beside this process
        from quantpatch.cli.render_check import print_check

        report = report_of()
    problems = report.problems(wanted)
    if json_ or OPTS.json:
        emit_json({**report.as_json(), "problems": problems})
    else:
        print_check(report, out)
    if problems:
        raise CheckFailed(" ".join(problems))


@app.command("set")
def set_(
    linear: str | None = typer.Option(
        None, "--linear", help=f"Value of the linear sites: {VALUES}."
    ),
    fprop: str | None = typer.Option(
        None, "--fprop", help="Value of the linear forward GEMM's site(s) (overrides --linear)."
    ),
    dgrad: str | None = typer.Option(
        None, "--dgrad", help="Value of the linear input-gradient GEMM's site(s)."
    ),
    wgrad: str | None = typer.Option(
        None, "--wgrad", help="Value of the linear weight-gradient GEMM's site(s)."
    ),
    qk: str | None = typer.Option(
        None,
        "--qk",
        help=f"Value of the Q.K^T site(s): {value_list('qk')} (the table: quantpatch list).",
    ),
    pv: str | None = typer.Option(
        None,
        "--pv",
        help=f"Value of the P.V site(s): {value_list('pv')} (the table: quantpatch list).",
    ),
    bf16_layers: str | None = typer.Option(
        None,
        "--bf16-layers",
        help="Transformer layers whose linear GEMMs stay BF16: first:N, last:N, layer numbers "
        "K or A-B, recipe (NVIDIA's proportion), output (the GEMMs outside every transformer "
        "layer: the output layer), none; e.g. first:2,last:8,output.",
    ),
    scheme: str | None = typer.Option(
        None,
        "--scheme",
        help="A named scheme (see `list`); --linear/--qk/--pv override its values.",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the unified diff; change nothing."
    ),
    no_branch: bool = typer.Option(
        False,
        "--no-branch",
        help="Edit in place (no branch, no commit); still all-or-nothing and restorable.",
    ),
    no_split: bool = typer.Option(
        False, "--no-split", help="Refuse instead of splitting a shared qk+pv site."
    ),
    allow_unknown: bool = typer.Option(
        False, "--allow-unknown", help="Write a value that is not a known quant type."
    ),
    config: Path | None = typer.Option(None, "--config", help="Extra schemes (TOML)."),
    repo: Path | None = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Rewrite the named roles; in git, on branch quantpatch/linear-X_qk-Y_pv-Z on the base."""
    from quantpatch.checkout.set_options import SetOptions, set_request
    from quantpatch.checkout.switch import set_values
    from quantpatch.launch.registry import scheme_values

    options = SetOptions(
        linear=linear,
        fprop=fprop,
        dgrad=dgrad,
        wgrad=wgrad,
        qk=qk,
        pv=pv,
        bf16_layers=bf16_layers,
        scheme=scheme_values(scheme, config) if scheme is not None else None,
        dry_run=dry_run,
        branch=not no_branch,
        split=not no_split,
        allow_unknown=allow_unknown,
    )
    result = set_values(repo_root(repo), set_request(options))
    if json_ or OPTS.json:
        emit_json(result.as_json(dry_run))
        return
    print_notes(result.notes)
    if dry_run:
        sys.stdout.write(result.diff)
        if not result.diff:
            err.print("no change: the checkout already holds these values.")
        return
    vals = " ".join(f"{r}={v}" for r, v in result.values.items())
    if result.branch:
        how = result.how or ("reused" if result.reused else "created")
        out.print(
            f"{vals}: {how} branch {result.branch} at {(result.commit or '')[:12]} "
            f"(base {result.base and (result.base.branch or 'detached')} @ "
            f"{result.base and str(result.base.commit)[:12]})"
        )
    else:
        out.print(
            f"{vals}: written in place ({len([e for e in result.edits if e.changed])} "
            "file(s)); 'quantpatch restore' puts the originals back."
        )


@app.command()
def restore(
    forget: bool = typer.Option(
        False,
        "--forget",
        help="Drop quantpatch's record (an unreadable one, say) without touching files or "
        "branches.",
    ),
    repo: Path | None = RepoOpt,
) -> None:
    """Put the checkout back on the recorded base, byte-identical, and clear the record."""
    from quantpatch.checkout.switch import restore as run_restore

    result = run_restore(repo_root(repo), forget=forget)
    if result.mode == "forget":
        print_notes(result.notes)
        return
    print_notes(result.notes)
    if result.mode == "branch" and result.base:
        b = result.base
        out.print(f"restored: {b.branch or 'detached HEAD'} @ {str(b.commit)[:12]}")
    else:
        out.print(f"restored the original bytes of {', '.join(result.files)}")


saver_app = typer.Typer(help="The tensor saver: install, remove, status.", no_args_is_help=True)
app.add_typer(saver_app, name="saver")


@saver_app.command("install")
def saver_install(
    force: bool = typer.Option(False, "--force", help="Replace a different tensor_saver.py."),
    repo: Path | None = RepoOpt,
) -> None:
    """Install megatron/core/tensor_saver.py and insert the marked saver calls."""
    from quantpatch.checkout.saver import install

    result = install(repo_root(repo), force=force)
    if not result.changed:
        out.print("the tensor saver is already installed; nothing to do.")
        return
    out.print(f"installed the tensor saver: {', '.join(result.files)}{commit_note(result.commit)}")


@saver_app.command("remove")
def saver_remove(repo: Path | None = RepoOpt) -> None:
    """Remove the saver: every instrumented file back to its exact bytes."""
    from quantpatch.checkout.saver import remove

    result = remove(repo_root(repo))
    if not result.changed:
        out.print("the tensor saver is not installed; nothing to do.")
        return
    out.print(f"removed the tensor saver: {', '.join(result.files)}{commit_note(result.commit)}")


@saver_app.command("status")
def saver_status_cmd(repo: Path | None = RepoOpt, json_: bool = JsonOpt) -> None:
    """Whether the saver is installed, and in which files."""
    from quantpatch.checkout.saver import status
    from quantpatch.git import repo as gitrepo

    st = status(gitrepo.find_checkout(repo_root(repo), need_git=False))
    if json_ or OPTS.json:
        emit_json(st.as_json())
        return
    if st.installed:
        note = "" if st.module_matches else " (module differs from this quantpatch's)"
        out.print(f"installed: {st.module}{note}; instrumented: {', '.join(st.files)}")
    else:
        from quantpatch.cli.render_check import saver_line

        out.print(saver_line(st))


@app.command("init")
def init_(
    remove: bool = typer.Option(False, "--remove", help="Restore the stock files exactly."),
    repo: Path | None = RepoOpt,
) -> None:
    """Insert fork-layout sites (bf16) and the quant ops module into a stock checkout."""
    from quantpatch.checkout.init import init

    result = init(repo_root(repo), remove=remove)
    print_notes(result.notes)
    what = "restored" if result.removed else "initialised"
    out.print(f"{what}: {', '.join(result.files)}{commit_note(result.commit)}")


@app.command()
def upgrade(
    force: bool = typer.Option(
        False, "--force", help="Overwrite installed files edited by hand (the edits are lost)."
    ),
    repo: Path | None = RepoOpt,
) -> None:
    """Bring every part an earlier quantpatch installed (runtime, codemods, saver) to this
    version, as one commit on the current branch."""
    from quantpatch.checkout.upgrade import upgrade as run_upgrade

    result = run_upgrade(repo_root(repo), force=force)
    print_notes(result.notes)
    if not result.changed:
        out.print("every installed part is this version's; nothing to upgrade.")
        return
    files = ", ".join(result.files) or "nothing left to write"
    out.print(f"upgraded: {files}{commit_note(result.commit)}")


@app.command()
def demo(
    directory: Path = typer.Argument(
        Path("quantpatch-demo"), help="Where to build the demo checkout (must be new or empty)."
    ),
    megatron_core: str = typer.Option("0.13.1", "--megatron-core", help="megatron-core release."),
) -> None:
    """Build a demo checkout from megatron-core and walk check, set, set again, restore."""
    from quantpatch.checkout.demo import build_checkout, walk
    from quantpatch.cli.render_check import print_check

    out.rule(f"building {directory} from megatron-core {megatron_core}")
    with err.status(f"fetching megatron-core {megatron_core} (about 19 MB, once) and building"):
        build_checkout(directory, megatron_core)
    walk(directory, out, print_check)
    out.rule("next")
    out.print(
        f"try: cd {directory} && quantpatch check; quantpatch saver install; "
        "quantpatch set --scheme FA_linear_mxfp8; quantpatch gen-scripts --out scripts; "
        "quantpatch restore"
    )
