"""Every command's --json output (success, dry run, failure) is one envelope on stdout that validates
against the envelope schema and the command's own schema in docs/json.md; exit codes are those of
the text mode."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from click.testing import CliRunner

from ckpt_tools.cli import COMMANDS, main

from .conftest import REPO, TRAINER
from .json_cases import CASES


def _schemas() -> dict[str, dict]:
    text = (REPO / "docs" / "json.md").read_text()
    blocks = re.findall(r"^```json (\S+)\n(.*?)^```", text, flags=re.S | re.M)
    return {name: json.loads(body) for name, body in blocks}


SCHEMAS = _schemas()


def _validate(doc: dict, command: str) -> None:
    jsonschema.validate(doc, SCHEMAS["envelope"], cls=jsonschema.Draft202012Validator)
    jsonschema.validate(doc, SCHEMAS[command], cls=jsonschema.Draft202012Validator)


def test_docs_json_has_a_valid_schema_for_every_command():
    for name, schema in SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
    assert sorted(set(SCHEMAS) - {"envelope"}) == sorted(COMMANDS)


def test_every_command_has_a_success_and_a_failure_case_and_each_writer_a_dry_run():
    kinds = {(c.command, c.kind) for c in CASES}
    for name in COMMANDS:
        assert (name, "success") in kinds and (name, "failure") in kinds, name
    dry = {c for c, k in kinds if k == "dry_run"}
    with_dry = {n for n in COMMANDS if "--dry-run" in CliRunner().invoke(main, [n, "--help"]).output}
    assert dry == with_dry


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_json_output_validates_against_its_schema(case, tmp_path):
    argv = [case.command, *map(str, case.args(tmp_path)), "--json"]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == case.exit_code, (r.stdout, r.stderr)
    doc = json.loads(r.stdout)     # exactly one JSON object: anything else on stdout fails here
    _validate(doc, case.command)
    assert doc["command"] == case.command and doc["exit_code"] == case.exit_code
    assert doc["dry_run"] is (case.kind == "dry_run")
    if case.kind == "failure":
        assert doc["ok"] is False and doc["error"]["message"]
        # the same message is the one line on stderr
        assert f"{doc['error']['message']}" in r.stderr
    else:
        assert doc["error"] is None
        assert (doc["plan"] if case.kind == "dry_run" else (doc["result"] if doc["result"] is not None else doc["plan"]))


def test_a_dry_run_has_its_plan_and_a_null_result_and_writes_nothing(tmp_path):
    r = CliRunner().invoke(main, ["set-lr", str(TRAINER), str(tmp_path / "o"), "--scale", "0.5", "--dry-run", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["dry_run"] is True and doc["result"] is None
    assert doc["plan"]["factor"] == 0.5 and not (tmp_path / "o").exists()


def test_a_usage_error_of_click_itself_is_the_failure_envelope_too(tmp_path):
    r = CliRunner().invoke(main, ["set-lr", str(TRAINER), "--lr", "not-a-number", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 2 and doc["error"]["type"] == "UsageError"
    assert doc["error"]["message"] == "Invalid value for '--lr': 'not-a-number' is not a valid float."
    _validate(doc, "set-lr")


def test_non_finite_floats_are_strings_never_bare_nan():
    from ckpt_tools.cli.render import envelope
    doc = envelope("inspect", {"lr": float("nan"), "x": [float("inf"), -float("inf")]})
    text = json.dumps(doc, allow_nan=False)
    assert json.loads(text)["result"] == {"lr": "NaN", "x": ["Infinity", "-Infinity"]}


def test_warnings_printed_by_the_command_are_in_the_envelope(tmp_path):
    r = CliRunner().invoke(main, ["inspect", str(TRAINER), "--json", "--trust-remote-pickle"])
    doc = json.loads(r.stdout)
    assert doc["warnings"] == ["--trust-remote-pickle: pickles outside the allow-list will be executed. A crafted "
                               "checkpoint can run any code on this machine."]
