"""The checkout's typed records: state.json as a CheckoutState, and set's options merged by
a plain function (the CLI only parses and prints)."""

from __future__ import annotations

import json

import pytest

from quantpatch.base.errors import UserError
from quantpatch.checkout.set_options import SetOptions, set_request
from quantpatch.git.repo import state_text
from quantpatch.git.state import CheckoutState, Current, Mode, why_malformed

SHA = "b" * 64
BRANCH = {
    "version": 1,
    "mode": "branch",
    "base": {"branch": "main", "commit": "a" * 40},
    "current": {"branch": "quantpatch/linear-mxfp8", "commit": "c" * 40,
                "values": {"linear": "mxfp8"}},
    "history": [{"time": 1.5, "values": {"linear": "mxfp8"}, "branch": "quantpatch/x",
                 "commit": "c" * 40}],
    "pending": {"op": "set", "branch": "quantpatch/linear-mxfp8"},
}  # fmt: skip
IN_PLACE = {
    "version": 1,
    "mode": "in-place",
    "base": {"branch": None, "commit": None},
    "current": {"branch": None, "values": {"qk": "hifp8"}},
    "files": {
        "megatron/core/a.py": {"original": "originals/megatron/core/a.py", "original_sha": SHA,
                               "written": SHA},
        "megatron/core/b.py": {"original": "originals/megatron/core/b.py", "written": SHA},
    },
    "history": [{"time": 2.0, "values": {"qk": "hifp8"}}],
}  # fmt: skip


@pytest.mark.parametrize("record", [BRANCH, IN_PLACE], ids=["branch", "in-place"])
def test_a_record_reads_typed_and_writes_the_same_text(record):
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    assert why_malformed(json.loads(text)) is None
    state = CheckoutState.from_dict(json.loads(text))
    assert state.mode is Mode(record["mode"]) and f"{state.mode}" == record["mode"]
    assert state.base.commit == record["base"]["commit"]
    assert state_text(state) == text
    no_version = CheckoutState.from_dict({k: v for k, v in record.items() if k != "version"})
    assert state_text(no_version) == text  # the version is state_text's


def test_an_in_place_record_keeps_its_files_and_a_branch_record_its_intent():
    state = CheckoutState.from_dict(IN_PLACE)
    assert state.files is not None and state.files["megatron/core/b.py"].original_sha is None
    assert state.current == Current(None, {"qk": "hifp8"})
    branch = CheckoutState.from_dict(BRANCH)
    assert branch.files is None and branch.pending is not None
    assert branch.pending.branch == "quantpatch/linear-mxfp8"


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda r: r.update(mode="both"), "lacks its mode or base"),
        (lambda r: r["base"].update(commit=None), "names no base commit"),
        (lambda r: r.update(history={}), "has a malformed history"),
        (lambda r: r.update(current={"branch": 3}), "has a malformed current set"),
    ],
)
def test_a_branch_record_quantpatch_never_writes_says_why(edit, why):
    record = json.loads(json.dumps(BRANCH))
    edit(record)
    assert why_malformed(record) == why


def test_an_in_place_record_that_leaves_the_checkout_says_why():
    record = json.loads(json.dumps(IN_PLACE))
    record["files"]["../x.py"] = record["files"].pop("megatron/core/a.py")
    assert why_malformed(record) == "names a file outside the checkout ('../x.py')"
    del record["files"]
    assert why_malformed(record) == "lacks the files of the in-place set"
    assert why_malformed([]) == "is not a JSON object"


SCHEME = {"fprop": "mxfp8", "dgrad": "mxfp4", "wgrad": "mxfp4", "qk": "hifp8",
          "pv": "bf16", "bf16_layers": "first:2"}  # fmt: skip


def test_linear_over_a_schemes_gemms_and_each_role_over_both():
    req = set_request(SetOptions(linear="nvfp4", pv="mxfp8", scheme=SCHEME))
    assert req.values == {"qk": "hifp8", "pv": "mxfp8", "linear": "nvfp4"}
    assert req.bf16_layers == "first:2"  # the scheme's policy
    req = set_request(SetOptions(dgrad="hifp8", scheme=SCHEME, bf16_layers="none"))
    assert req.values["dgrad"] == "hifp8" and req.values["fprop"] == "mxfp8"
    assert req.bf16_layers == "none"


def test_a_scheme_without_a_policy_sets_none_and_no_scheme_keeps_the_checkouts():
    assert set_request(SetOptions(scheme={"linear": "mxfp8"})).bf16_layers == ""
    assert set_request(SetOptions(qk="mxfp8")).bf16_layers is None
    req = set_request(SetOptions(bf16_layers="last:1", branch=False, dry_run=True))
    assert (req.values, req.bf16_layers, req.branch, req.dry_run) == ({}, "last:1", False, True)


def test_nothing_named_is_refused_in_one_sentence():
    with pytest.raises(UserError, match=r"^nothing to set: give --linear, .* or --scheme\.$"):
        set_request(SetOptions())
