"""Every refusal that ``sweep run``, ``gen-scripts``, ``run`` and ``layout`` can give (each
``UserError(...)`` and ``LayoutError(...)`` of ``quantpatch/launch/`` and of their CLI
modules, read with libcst, and the advice those modules build for them), sorted two ways:
its advice followed by a test that shows it accepted (the tests named), or no advice (a fact
or a rule, nothing to follow). There is no third way: advice no test follows fails here, as
does a new refusal until it is sorted."""

from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path

import libcst as cst

ROOT = Path(__file__).resolve().parents[1]
SCOPE = (
    *sorted((ROOT / "quantpatch" / "launch").glob("*.py")),
    ROOT / "quantpatch" / "cli" / "launch.py",
    ROOT / "quantpatch" / "cli" / "sweep.py",
    ROOT / "quantpatch" / "data_prep" / "layout.py",  # the data fixes sweep run names
)
HINTS = "test_refusal_hints"

# advice (a fragment of its words) -> the tests that follow it and show it accepted
FOLLOWED: dict[str, tuple[str, ...]] = {
    # attention, native schemes
    "--attention: unknown choice": (f"{HINTS}::test_an_unknown_choice_followed_with_a_valid_one",),
    "run `quantpatch upgrade` there first (or give --attention stock)": (
        "test_report_trust::test_flash_runs_on_an_older_runtime_are_refused_before_anything_is_written",
    ),
    "run them from a Megatron-LM checkout that has it": (
        "test_native_refusals::test_a_checkout_without_te_layers_is_refused",
    ),
    "set PYTHON to a Python that has it": (
        "test_native_refusals::test_no_transformer_engine_in_the_training_python_is_refused",
        "test_te_recipes::test_the_native_twin_runs_beside_its_emulation_and_the_report_pairs_them",
    ),
    "TransformerEngine runs {} on compute capability": (
        "test_native_refusals::test_a_gpu_without_the_format_is_refused_and_the_advised_gpu_accepted",
        "test_te_recipes::test_the_native_twin_runs_beside_its_emulation_and_the_report_pairs_them",
    ),
    # choices
    "--launcher: unknown launcher": (f"{HINTS}::test_an_unknown_choice_followed_with_a_valid_one",),
    "--profile: unknown profile": (f"{HINTS}::test_an_unknown_choice_followed_with_a_valid_one",),
    "unknown {} {}; valid: {}{}": (
        f"{HINTS}::test_an_unknown_choice_followed_with_a_valid_one",
        "test_scripts::test_an_unknown_dataset_names_the_config_table_and_its_fields",
    ),
    "--scheme: unknown scheme": (f"{HINTS}::test_an_unknown_choice_followed_with_a_valid_one",),
    "--megatron-release: unknown release": (
        f"{HINTS}::test_an_unknown_choice_followed_with_a_valid_one",
    ),
    "which is no scheme; valid:": (f"{HINTS}::test_a_twin_that_is_no_scheme_followed",),
    # scheme tables and args
    "a field of Megatron's FP8 recipes": (f"{HINTS}::test_a_scheme_table_refusal_followed",),
    "drop first_last_layers_bf16.": (f"{HINTS}::test_a_scheme_table_refusal_followed",),
    "drop fp8_wgrad, or take a value of that recipe": (
        f"{HINTS}::test_a_scheme_table_refusal_followed",
    ),
    "where no site runs; leave out": (f"{HINTS}::test_a_scheme_table_refusal_followed",),
    "must not be set in args, since the script": (
        f"{HINTS}::test_a_flag_the_script_passes_itself_followed",
    ),
    "args must not set --{}, since the script": (
        f"{HINTS}::test_a_flag_the_script_passes_itself_followed",
    ),
    "use --launcher torchrun or slurm for it": ("test_launchers::test_swift_refusals_followed",),
    "give a wheel, an unpacked wheel or the site-packages": (
        "test_launchers::test_swift_refusals_followed",
    ),
    "takes --transformer_impl local and MEGATRON_LM_PATH (the 3.x line": (
        "test_launchers::test_swift_refusals_followed",
    ),
    "does not accept {}, checked against {}; {}.": (
        "test_scripts::test_older_release_and_unsupported_release",
        "test_scripts::test_a_flag_the_checkout_does_not_accept",
    ),
    # scripts
    "rename one of the datasets or schemes in the --config file": (
        f"{HINTS}::test_colliding_names_followed",
    ),
    "--force overwrites them": (f"{HINTS}::test_scripts_edited_by_hand_followed",),
    "set QUANTPATCH to its path": (f"{HINTS}::test_no_quantpatch_executable_followed",),
    "`quantpatch init --repo {}` adds them": (
        "test_fork::test_before_init_every_script_is_written_and_mla_ones_stop_before_torchrun",
    ),
    # layout
    "GPUs would be.": (f"{HINTS}::test_gpus_and_nodes_that_disagree_followed",),
    "a layout needs --model or": ("test_launchers::test_layout_command",),
    "needs MASTER_ADDR set to a host every node reaches": (
        "test_launchers::test_torchrun_two_nodes_and_a_bad_override",
    ),
    "{} ({} {}, {}={})": (f"{HINTS}::test_a_batch_the_layout_command_refuses_followed_both_ways",),
    "give --schemes without {} (their recipe passes": (
        f"{HINTS}::test_a_recipe_flag_the_checkout_does_not_accept_followed",
    ),
    "give either --gpus or --nodes": (f"{HINTS}::test_gpus_and_nodes_that_disagree_followed",),
    "would pass this check": (f"{HINTS}::test_a_size_that_passes_one_check_followed_to_the_end",),
    "instead of --{} {}": (f"{HINTS}::test_a_layout_refusal_of_gen_scripts_followed",),
    "{} = {} in the [profiles.{}.parallel] table of a --config": (
        f"{HINTS}::test_a_layout_refusal_of_gen_scripts_followed",
        f"{HINTS}::test_a_layout_refusal_of_sweep_run_followed",
    ),
    "{} = {} in the [{}] table of a --config": (
        f"{HINTS}::test_a_layout_refusal_of_gen_scripts_followed",
    ),
    # Slurm
    "scancel is not on PATH": (f"{HINTS}::test_no_scancel_on_path_followed",),
    "sbatch is not on PATH": (f"{HINTS}::test_no_sbatch_on_path_followed",),
    "give --gpus-per-node {} to sweep run or gen-scripts": (
        f"{HINTS}::test_the_partitions_gpus_and_nodes_followed",
        "test_sweep::test_a_slurm_sweep_is_checked_against_the_nodes_gpus",
    ),
    "give --nodes {} to sweep run or gen-scripts": (
        f"{HINTS}::test_the_partitions_gpus_and_nodes_followed",
    ),
    "set cpus_per_task = {} in the [slurm] table of a --config": (
        f"{HINTS}::test_the_cpus_a_node_offers_followed",
    ),
    'if the GPUs come with the node, gpu_request = "none" in the [slurm]': (
        f"{HINTS}::test_a_partition_without_gpus_followed",
    ),
    "choose a partition with GPUs, partition = ": (
        f"{HINTS}::test_a_partition_without_gpus_names_the_one_with_gpus_followed",
    ),
    "ask for one CPU per rank, cpus_per_task": (
        f"{HINTS}::test_sbatchs_node_configuration_refusal_followed",
    ),
    "the smallest request, `--gpus-per-node 1 --nodes 1` to sweep run": (
        f"{HINTS}::test_sbatchs_node_configuration_refusal_followed",
    ),
    # the sweep's record and runs
    "move it away to start a new sweep": (f"{HINTS}::test_the_record_refusals_followed",),
    "put it back, or move the file away to start a new sweep": (
        f"{HINTS}::test_the_record_refusals_followed",
    ),
    "give the sweep's selection (--models, --datasets, --schemes, --profile) to start one": (
        f"{HINTS}::test_a_new_sweep_without_a_selection_followed",
    ),
    "a local sweep runs on this machine only (use --launcher slurm)": (
        f"{HINTS}::test_a_local_sweep_on_several_nodes_followed",
    ),
    "drop --seed from the arguments after --": (
        f"{HINTS}::test_a_seed_among_the_megatron_arguments_followed",
    ),
    "give --launcher local, or one seed": (f"{HINTS}::test_a_sweep_options_refusal_followed",),
    "send it to another partition, partition = ": (
        f"{HINTS}::test_the_smallest_request_refused_names_another_gpu_partition_followed",
    ),
    "add `--gpus-per-node {} --nodes {}` to sweep run": (
        f"{HINTS}::test_a_node_gone_between_the_check_and_sbatch_followed",
    ),
    "run them from a Megatron-LM checkout that has": (
        "test_scripts::test_a_flag_the_script_passes_itself_unaccepted_followed",
    ),
    "name more with --gpus, or give --gpus-per-node": (
        f"{HINTS}::test_a_sweep_options_refusal_followed",
    ),
    "`quantpatch sweep cancel {}`, or give a new folder": (
        f"{HINTS}::test_the_record_refusals_followed",
    ),
    "stop it (kill -TERM -- -{}) first": (f"{HINTS}::test_a_run_left_running_followed",),
    "not a sweep (start one with sweep run)": (
        f"{HINTS}::test_status_of_a_folder_without_a_sweep_followed",
    ),
    # data
    "the sweep's data is not ready": (
        f"{HINTS}::test_data_that_is_not_ready_followed",
        f"{HINTS}::test_missing_data_followed_with_the_command_it_names",
        f"{HINTS}::test_data_elsewhere_followed_by_pointing_at_it",
    ),
    "make them with `": (f"{HINTS}::test_missing_data_followed_with_the_command_it_names",),
    "point DATA_ROOT / DATA_PREFIX at them": (
        f"{HINTS}::test_data_elsewhere_followed_by_pointing_at_it",
    ),
    "or set MOCK_DATA=1": (f"{HINTS}::test_data_that_is_not_ready_followed",),
    "put tokenizer_model = ": (
        f"{HINTS}::test_data_made_with_another_tokenizer_every_fix_followed",
    ),
    "or make it again with the scripts' ": (
        f"{HINTS}::test_data_made_with_another_tokenizer_every_fix_followed",
    ),
    "give --megatron-release {}, whose flag list has them all": (
        "test_scripts::test_older_release_and_unsupported_release",
    ),
    "set {} of a --config to leave them out": (
        "test_scripts::test_a_flag_the_checkout_does_not_accept",
        f"{HINTS}::test_a_flag_of_a_schemes_args_the_release_refuses_followed",
    ),
    "export TOKENIZER_MODEL={} (the tokenizer it was made with)": (
        f"{HINTS}::test_data_made_with_another_tokenizer_every_fix_followed",
        "test_sweep::test_your_own_tokenizer_names_every_fix_and_a_resume_remembers_it",
    ),
}

# a refusal with nothing to follow (a fact, or the form a value must take) -> kind
NO_ADVICE: dict[str, str] = {
    "cannot be read": "a file the user cannot read",
    "must be a table": "the form of a config table",
    "is unknown (known:": "a config key, with the known ones",
    "must be a positive integer": "the form of a value",
    "must be auto, on or off": "the form of a value",
    "must be one word of letters": "the form of a value",
    "slurm.gpu_request must be one of": "the form of a value",
    "must be a flag name without dashes": "the form of a value",
    "must be a list of pretrain_gpt.py's words": "the form of a value",
    "holds a newline or NUL": "the form of a value",
    "must be 0 or more": "the form of a value",
    "which needs one value of a Megatron recipe": "the fields te_recipe needs",
    "emulates names a twin for native schemes only": "the field's meaning",
    "has unknown field": "a config key, with the known ones",
    "has the wrong type": "the form of a value",
    "is missing field": "a required field",
    "config file not found": "a path",
    "not valid TOML": "a file",
    "not UTF-8 text": "a file",
    "nested too deeply": "a file",
    "unknown table": "a config table, with the known ones",
    "is not an identifier": "the form of a name",
    "EXTRA_ARGS cannot be split as bash words": "the variable's text",
    "(from EXTRA_ARGS or the arguments after --), checked against": "the flags named are the "
    "user's own",
    "the output directory cannot be written": "a path",
    "sinfo shows no other partition with GPUs": "sbatch refused the smallest request on the "
    "only GPU partition: the cluster's own reason",
    "sbatch refused the sweep": "sbatch's own words (the node hints are sorted above)",
    "scancel refused to cancel": "scancel's own words",
    "--gpus must be GPU indices": "the form of a value",
    "--gpus names a GPU twice": "the form of a value",
    "--parallel must be from 1 to 64": "a range",
    "--seeds must be from 1 to": "a range",
    "cannot be read as UTF-8 text": "a file",
    ".py does not parse": "a file",
    "no such ms-swift wheel or directory": "a path",
    "not a wheel (zip) or a directory holding swift/": "a path",
    "holds no ms-swift (no swift/version.py).": "a path",
    "found none of": "an ms-swift quantpatch does not know",
    "; read from {}.": "an ms-swift's own refusal (the advice it carries is sorted above)",
    "--swift: {} does not exist": "a path",
    "which the swift scripts pass": "an ms-swift that lacks arguments",
    "no run of the sweep has written a log yet": "a state",
    "holds no sweep.json: not a sweep.": "a path",
    "must be one of {} (got {})": "a choice, with the known ones",
    "must be an integer from 1 to": "a range",
    "GPUs is more than": "a range",
    "which the parallel layout needs": "a model entry without a size it needs",
    "MASTER_ADDR (--master-addr) must be a host name": "the form of a value",
    "MASTER_PORT must be a port from 1 to 65535": "a range",
    "NODE_RANK must be one of": "a range",
}


def _text(node: cst.CSTNode) -> str:
    """The literal words of a call or expression, ``{}`` for each value put in."""
    out: list[str] = []

    class Words(cst.CSTVisitor):
        def visit_SimpleString(self, n: cst.SimpleString) -> None:
            value = n.evaluated_value
            out.append(value if isinstance(value, str) else "")

        def visit_FormattedStringText(self, n: cst.FormattedStringText) -> None:
            out.append(n.value)

        def visit_FormattedStringExpression(self, n: cst.FormattedStringExpression) -> bool:
            out.append("{}")
            return False

    node.visit(Words())
    return "".join(out)


@functools.cache
def _refusals() -> tuple[list[tuple[str, str]], list[str]]:
    """Each UserError's words (file, text; empty where it passes on a sentence built
    elsewhere), and every string of the modules (the sentences built for them)."""
    calls: list[tuple[str, str]] = []
    strings: list[str] = []
    for path in SCOPE:
        module = cst.parse_module(path.read_text(encoding="utf-8"))

        class Calls(cst.CSTVisitor):
            def __init__(self, name: str) -> None:
                super().__init__()
                self.name = name

            def visit_Call(self, n: cst.Call) -> None:
                if isinstance(n.func, cst.Name) and n.func.value in ("UserError", "LayoutError"):
                    calls.append((self.name, _text(n)))

            def visit_SimpleString(self, n: cst.SimpleString) -> None:
                strings.append(_text(n))

            def visit_FormattedString(self, n: cst.FormattedString) -> None:
                strings.append(_text(n))

            def visit_ConcatenatedString(self, n: cst.ConcatenatedString) -> bool:
                strings.append(_text(n))
                return True

        module.visit(Calls(path.name))
    return calls, strings


def test_every_refusal_is_sorted_once():
    """Each UserError (LayoutError too) with words of its own in exactly one of the three;
    those without (``UserError(sentence)``) pass on a sentence built elsewhere, whose words
    are sorted as built advice."""
    calls, _strings = _refusals()
    sorts = {"followed": FOLLOWED, "no advice": NO_ADVICE}
    wrong = []
    passing = 0
    for name, text in calls:
        if not re.search(r"[a-z]{2}", text.replace("{}", "")):
            passing += 1  # UserError(sentence), or "{model}/{profile}: {sentence}"
            continue
        found = [kind for kind, table in sorts.items() if any(k in text for k in table)]
        if len(found) != 1:
            wrong.append(f"{name}: {text} -> {found or 'none'}")
    assert not wrong, "refusals not sorted once:\n" + "\n".join(wrong)
    assert passing == 7  # the MLA and Slurm-fit sentences, the layout rules with their fix


def test_every_sorted_refusal_still_exists():
    _calls, strings = _refusals()
    gone = [k for k in (*FOLLOWED, *NO_ADVICE) if not any(k in s for s in strings)]
    assert not gone, gone


def test_the_tests_that_follow_them_exist():
    for named in FOLLOWED.values():
        assert named
        for ref in named:
            module, name = ref.split("::")
            assert callable(getattr(importlib.import_module(f"tests.{module}"), name)), ref
