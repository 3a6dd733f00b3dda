"""Round 4 (issue 32), item 7: the report page as a person reads it, and `inspect` of a run's root.

On the genuine fixtures: the tiny 16e747c run (one checkpoint at step 3, an orch.toml without max_steps) and
HEAD's E_head_dense run (checkpoints at steps 2 and 3, its trainer.json). The page's card says which step
one checkpoint is at (it said "3 steps"); the lr chart's title says what the plan runs to and why, in words;
the JSON's `max_steps_from` never says "no run config found" next to the run config it read; the red squares
of the other saved checkpoints have a legend entry; `inspect` and `report` of a run's root dir find its
checkpoints and configs, as `doctor` does.

Figures for docs/reliability.md: `hu.record("round4", tried=, fixed=, held=)` (fixed: failed before).
"""

from __future__ import annotations

import json
import re

from . import hardening_util as hu
from .conftest import FIXTURE, HEAD_FIXTURES, TRAINER

E = HEAD_FIXTURES / "E_head_dense"


def report_json(*args) -> dict:
    r = hu.invoke(["report", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_the_card_of_one_checkpoint_names_its_step(tmp_path):
    page = tmp_path / "page.html"
    r = hu.invoke(["report", TRAINER, "-o", page])
    assert r.exit_code == 0, r.output
    cards = dict((k, v) for v, k in re.findall(r'<div class="fact"><b>([^<]*)</b><span>([^<]*)</span>', page.read_text()))
    assert cards.get("checkpoint at step") == "3" and "steps" not in cards, cards
    page2 = tmp_path / "run.html"
    assert hu.invoke(["report", E / "outputs" / "checkpoints", "-o", page2]).exit_code == 0
    cards = dict((k, v) for v, k in re.findall(r'<div class="fact"><b>([^<]*)</b><span>([^<]*)</span>', page2.read_text()))
    assert cards.get("checkpoints at steps") == "2, 3", cards
    hu.record("round4", tried=2, fixed=1, held=1)


def test_max_steps_from_says_why_in_words_and_never_contradicts_the_config_listed():
    doc = report_json(TRAINER)
    plan, lr = doc["plan"], doc["result"]["lr"]
    assert plan["run_config"] and plan["run_config"][0].endswith("orch.toml"), plan
    for said in (plan["max_steps_from"], lr["max_steps_from"]):
        assert "no run config found" not in said and "orch.toml sets no max_steps" in said, said
    head = report_json(E / "outputs" / "checkpoints")["plan"]
    assert head["max_steps"] == 3 and head["max_steps_from"] == "trainer.max_steps in the run config", head
    hu.record("round4", tried=2, fixed=1, held=1)


def test_the_lr_chart_says_what_it_plans_and_explains_its_red_squares():
    from ckpt_tools.ops.report.page import report_figures

    result = report_json(E / "outputs" / "checkpoints")["result"]
    fig = next(f for stem, _caption, f in report_figures(result) if stem == "lr")
    ax = fig.axes[0]
    title = ax.get_title()
    assert "max_steps from" not in title and "planned to step 3: trainer.max_steps in the run config" in title, title
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    squares = [ln for ln in ax.get_lines() if ln.get_marker() == "s"]
    assert squares and any(ln.get_label() in legend for ln in squares), (legend, [ln.get_label() for ln in squares])
    hu.record("round4", tried=2, fixed=2)


def test_inspect_and_report_of_a_run_root_find_its_checkpoints_and_configs():
    for root, config in ((FIXTURE, "orch.toml"), (E, "trainer.json")):
        r = hu.invoke(["inspect", root, "--json"])
        assert r.exit_code == 0, r.output
        res = json.loads(r.stdout)["result"]
        assert res["format"] == "checkpoints" and res["steps"], res
        assert any(c.endswith(config) for c in res["run_config"]), res
        text = hu.invoke(["inspect", root]).stdout
        assert "resumes at step 3" in text and config in text, text
        doc = report_json(root)
        assert doc["plan"]["kind"] == "checkpoints" and doc["plan"]["steps"], doc["plan"]
    hu.record("round4", tried=4, fixed=4)
