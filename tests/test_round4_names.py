"""Round 4 (issue 32), item 5: names from strangers.

A key of a genuine checkpoint (E_head_dense's step, saved again by torch.distributed.checkpoint.save with
one more item) and file names in a folder hold an OSC retitle sequence, a bell, a carriage return and a
line break that starts a fake `error:` line; a tensor of the tiny fixture's base and of its merge is
named `$\\nosuchcmd$` (matplotlib's mathtext). Every text that reaches the terminal shows the control
characters escaped, one name one line; the JSON envelope holds the exact names; the report pages draw
the name as plain text.

Figures for docs/reliability.md: `hu.record("round4", tried=, fixed=, held=)` (fixed: failed before).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from . import hardening_util as hu
from .conftest import BASE, HEAD_FIXTURES, TRAINER

DENSE = HEAD_FIXTURES / "E_head_dense" / "outputs" / "checkpoints" / "step_2" / "trainer"
HOSTILE = "notes\x1b]0;pwned\x07\rx\nerror: the disk is on fire\u202e"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e]")


def no_raw_controls(text: str) -> None:
    """No control character but newlines and tabs, and no line our code did not write."""
    assert not RAW.search(text), repr(text)
    assert not [ln for ln in text.splitlines() if ln.startswith("error: the disk")], text


@pytest.fixture(scope="module")
def hostile_ckpt(tmp_path_factory):
    def add(sd):
        sd["app"]["progress"][HOSTILE] = 7

    return hu.resave_dcp(DENSE, tmp_path_factory.mktemp("r4-names") / "trainer", add)


def test_inspect_keys_shows_a_hostile_key_escaped_on_one_line(hostile_ckpt):
    r = hu.invoke(["inspect", hostile_ckpt, "--keys"])
    assert r.exit_code == 0, r.output
    no_raw_controls(r.output)
    shown = [ln for ln in r.stdout.splitlines() if ln.startswith("app.progress.notes")]
    assert len(shown) == 1 and "\\x1b]0;pwned\\x07\\rx\\nerror: the disk is on fire\\u202e" in shown[0], shown
    for args in (["inspect", hostile_ckpt], ["verify", hostile_ckpt, "--deep"]):
        no_raw_controls(hu.invoke(args).output)
    hu.record("round4", tried=3, fixed=1, held=2)


def test_the_json_envelope_holds_the_exact_key(hostile_ckpt):
    r = hu.invoke(["inspect", hostile_ckpt, "--keys", "--json"])
    assert r.exit_code == 0 and r.stdout.isascii(), r.output
    keys = [row["key"] for row in json.loads(r.stdout)["result"]]
    assert f"app.progress.{HOSTILE}" in keys
    hu.record("round4", tried=1, held=1)


def test_the_overwrite_refusal_names_hostile_entries_escaped(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "\x1b]0;pwned\x07").write_text("x")
    (out / "y\nerror: the disk is on fire").write_text("x")
    before = hu.snapshot(out)
    for extra in ([], ["--json"]):
        r = hu.invoke(["extract-adapter", TRAINER, out, "--overwrite", *extra])
        assert r.exit_code != 0
        no_raw_controls(r.stderr)
        line = hu.assert_clean_error(r, expect="refusing")
        assert "\\x1b]0;pwned\\x07" in line and "y\\nerror: the disk" in line, line
        if extra:  # the envelope is exact JSON: the name as it is (an error message is one line: \n shown)
            err = json.loads(r.stdout)["error"]["message"]
            assert r.stdout.isascii() and "\x1b]0;pwned\x07" in err, err
    assert hu.diff_snapshots(before, hu.snapshot(out)) == []
    hu.record("round4", tried=2, fixed=2)


def test_an_internal_error_is_one_line_whatever_its_text():
    """`internal error:` lines carry an exception's text, which may span lines (matplotlib's did)."""
    from ckpt_tools.cli.render import one_line

    assert one_line("ValueError: \n\\nosuchcmd\n^\nParseFatalException") == "ValueError: \\n\\nosuchcmd\\n^\\nParseFatalException"
    hu.record("round4", tried=1, fixed=1)


@pytest.fixture(scope="module")
def mathtext_pair(tmp_path_factory):
    """The tiny fixture's base and its merge, one tensor renamed `...q$\\nosuchcmd$_proj...` in both."""
    root = tmp_path_factory.mktemp("r4-mathtext")
    r = hu.invoke(["merge", BASE, TRAINER, root / "merged"])
    assert r.exit_code == 0, r.output
    shutil.copytree(BASE, root / "base")
    for d in (root / "base", root / "merged"):
        for f in d.glob("*.safetensors"):
            sd = load_file(str(f))
            k = next(k for k in sorted(sd) if "layers.0.self_attn.q_proj" in k)
            sd[k.replace("q_proj", "q$\\nosuchcmd$_proj")] = sd.pop(k)
            save_file(sd, str(f), metadata={"format": "pt"})
        for p in (d / "SHA256SUMS", d / "model.safetensors.index.json"):
            p.unlink(missing_ok=True)
    return root


@pytest.mark.parametrize("command", ["report", "diff-vs-base --report"])
def test_a_dollar_name_is_drawn_as_plain_text(mathtext_pair, tmp_path, command):
    page = tmp_path / "page.html"
    m, b = mathtext_pair / "merged", mathtext_pair / "base"
    args = ["report", m, "--base", b, "-o", page] if command == "report" else ["diff-vs-base", m, b, "--report", page]
    r = hu.invoke(args)
    assert r.exit_code in (0, 3) and "internal error" not in r.output, r.output
    text = page.read_text()
    assert "<svg" in text and "nosuchcmd" in text
    hu.record("round4", tried=1, fixed=1)
