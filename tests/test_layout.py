"""The package's shape, checked from its source (docs/architecture.md draws it): layers import only
downward, no op imports another, no private name crosses a module boundary, functions stay short, modules
form no import cycle, DCP items are decoded in one module, public modules declare `__all__`, and the metadata side needs no torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "ckpt_tools"
LAYERS = ("core", "io", "formats", "sources", "ops", "workflows", "cli")  # lowest first
FIRST_PARTY = ("ckpt_tools", "tests")
PRIVATE_ALLOWED = {  # a tensor item's data.pkl names this function: a genuine one can only be written with it
    ("ckpt_tools/formats/dcp/stream_item.py", "torch._utils"),
    ("ckpt_tools/formats/dcp/stream_item.py", "torch._utils._rebuild_tensor_v2"),
    ("ckpt_tools/entry.py", "os._exit"),
}  # public, despite its name: the exit without finalization


def modules(root: Path = PKG) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def dotted(p: Path, repo: Path = REPO) -> list[str]:
    parts = list(p.relative_to(repo).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports(p: Path, repo: Path = REPO):
    """(absolute module parts, imported names, node) of every import in `p`, lazy ones included."""
    pkg = list(p.relative_to(repo).parts[:-1])
    for n in ast.walk(ast.parse(p.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = pkg[: len(pkg) - (n.level - 1)]
                mod = base + (n.module.split(".") if n.module else [])
            else:
                mod = (n.module or "").split(".")
            yield mod, [a.name for a in n.names], n
        elif isinstance(n, ast.Import):
            for a in n.names:
                yield a.name.split("."), [], n


def layer_of(parts: list[str]) -> str | None:
    return parts[1] if len(parts) > 1 and parts[0] == "ckpt_tools" and parts[1] in LAYERS else None


def test_layers_import_only_downward_and_no_op_imports_another_op():
    bad = []
    for p in modules():
        me = dotted(p)
        mine = layer_of(me)
        for mod, _names, n in imports(p):
            theirs = layer_of(mod)
            if mine and theirs and LAYERS.index(theirs) > LAYERS.index(mine):
                bad.append(f"{rel(p)}:{n.lineno} ({mine}) imports {'.'.join(mod)} ({theirs})")
            if mine == theirs == "ops" and len(me) > 2 and len(mod) > 2 and mod[2] != me[2]:
                bad.append(f"{rel(p)}:{n.lineno}: op {me[2]} imports op {mod[2]}")
    assert bad == []


def test_no_private_name_crosses_a_module_boundary():
    bad = []
    files = modules() + modules(REPO / "tests") + modules(REPO / "scripts") + modules(REPO / "bench")
    for p in files:
        in_pkg = p.is_relative_to(PKG)
        aliases = set()
        for mod, names, n in imports(p):
            first_party = mod[0] in FIRST_PARTY or (isinstance(n, ast.ImportFrom) and n.level > 0)
            for name in names:
                if name.startswith("_") and not name.startswith("__") and (first_party or in_pkg):
                    bad.append(f"{rel(p)}:{n.lineno}: from {'.'.join(mod)} import {name}")
            if isinstance(n, ast.Import):
                aliases.update((a.asname or a.name).split(".")[0] for a in n.names if first_party or in_pkg)
            elif first_party or in_pkg:
                aliases.update(a.asname or a.name for a in n.names)
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                root = n.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if (
                    isinstance(root, ast.Name)
                    and root.id in aliases
                    and (rel(p), ast.unparse(n)) not in PRIVATE_ALLOWED
                ):
                    bad.append(f"{rel(p)}:{n.lineno}: {ast.unparse(n)}")
    assert bad == []


# --- functions fit in a head; modules form no import cycle ----------------------------------------------------
# A function's length is its body's, from its first statement after the docstring to its last line, as
# `ruff format` lays it out (the signature and docstring are not counted: a click command's twenty options
# are not logic). Over MAX_FUNCTION_LINES only with a reason here; an entry that is no longer over the limit
# must go (the list only shrinks).
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}


def function_lengths(tree: ast.AST, where: str):
    """(`where::Qual.name`, body lines) of every function in `tree`, nested ones included."""

    def walk(node, prefix):
        for n in ast.iter_child_nodes(node):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                body = n.body
                if (
                    len(body) > 1
                    and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                ):
                    body = body[1:]  # the docstring
                yield f"{where}::{prefix}{n.name}", n.end_lineno - body[0].lineno + 1
                yield from walk(n, f"{prefix}{n.name}.")
            elif isinstance(n, ast.ClassDef):
                yield from walk(n, f"{prefix}{n.name}.")
            else:
                yield from walk(n, prefix)

    yield from walk(tree, "")


def length_rule(lengths: dict[str, int], allowed) -> tuple[dict[str, int], list[str]]:
    """(the functions over the limit and not allowed, the allowed ones no longer over it)."""
    over = {q: n for q, n in lengths.items() if n > MAX_FUNCTION_LINES}
    return {q: n for q, n in over.items() if q not in allowed}, [q for q in allowed if q not in over]


def test_no_function_is_over_the_length_limit():
    lengths = dict(kv for p in modules() for kv in function_lengths(ast.parse(p.read_text()), rel(p)))
    too_long, no_longer_long = length_rule(lengths, LONG_FUNCTIONS_ALLOWED)
    assert too_long == {}
    assert no_longer_long == [], "no longer long: take it off the list"


def test_the_length_rule_sees_a_long_function_and_a_stale_exception():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    src = f"def short():\n{body}def long():\n{body}    return x0\n"
    lengths = dict(function_lengths(ast.parse(src), "m.py"))
    assert lengths == {"m.py::short": MAX_FUNCTION_LINES, "m.py::long": MAX_FUNCTION_LINES + 1}
    assert length_rule(lengths, {}) == ({"m.py::long": MAX_FUNCTION_LINES + 1}, [])
    assert length_rule(lengths, {"m.py::long": "why", "m.py::short": "why"}) == ({}, ["m.py::short"])


def test_the_length_rule_measures_bodies():
    src = (
        "def f(a,\n      b):\n    'doc'\n    x = 1\n    return x\nclass C:\n    def g(self):\n        def h():\n"
        "            pass\n        return h\n"
    )
    assert dict(function_lengths(ast.parse(src), "m.py")) == {"m.py::f": 2, "m.py::C.g": 3, "m.py::C.g.h": 1}


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """{module: the first-party modules it imports}, lazy imports (inside functions) included, `if
    TYPE_CHECKING:` blocks not (they never run)."""
    repo = root.parent
    mods = {".".join(dotted(p, repo)): p for p in modules(root)}
    graph: dict[str, set[str]] = {}
    for name, p in mods.items():
        skip = {  # the lines of `if TYPE_CHECKING:` blocks
            line
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
            for b in n.body
            for line in range(b.lineno, b.end_lineno + 1)
        }
        deps = set()
        for mod, names, n in imports(p, repo):
            if n.lineno in skip:
                continue
            for cand in [".".join(mod + [a]) for a in names] + [".".join(mod)]:
                if cand in mods and cand != name:
                    deps.add(cand)
                    break
        graph[name] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


# The cycles main had when this rule came (#34 and #33 remove them): a cycle may shrink, never grow or appear.
KNOWN_CYCLES: list[set[str]] = []  # #33 removed the last one (io.remote -> ... -> io.upload -> io.remote)


def test_no_import_cycle_among_modules():
    cycles = import_cycles(import_graph())
    assert [sorted(c) for c in cycles if not any(c <= set(k) for k in KNOWN_CYCLES)] == []
    assert [k for k in KNOWN_CYCLES if not any(c <= set(k) and len(c) > 1 for c in cycles)] == [], (
        "a known cycle is gone: take it off the list"
    )


def test_the_cycle_rule_sees_a_cycle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "ckpt_tools"
    (pkg / "io").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "io" / "__init__.py").write_text("")
    (pkg / "io" / "a.py").write_text("from . import b\n")
    (pkg / "io" / "b.py").write_text("def f():\n    from .c import x\n")
    (pkg / "io" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import y\nfrom .a import z\n"
    )
    (pkg / "io" / "d.py").write_text("from .c import x\n")
    cycles = import_cycles(import_graph(pkg))
    assert cycles == [{"ckpt_tools.io.a", "ckpt_tools.io.b", "ckpt_tools.io.c"}]


# Names every module reads alike are rows of a key table: a regex literal naming a (prime-rl) step dir, a
# decoder layer or a LoRA factor is written in core/keys.py, or in a format's own key table
# (formats/<format>/keys.py: its names, mapped to the HF ones).
KEY_PATTERN_WORDS = re.compile(r"(?<![A-Za-z_])step_|layers|lora_")


def is_key_table(where: str) -> bool:
    return where == "ckpt_tools/core/keys.py" or re.fullmatch(r"ckpt_tools/formats/\w+/keys\.py", where) is not None


def key_pattern_literals(source: str, where: str) -> list[str]:
    """`where:line` of each `re.<compile|match|search|fullmatch|findall|sub>(LITERAL, ...)` whose literal
    names a step dir, a layer or a LoRA factor."""
    bad = []
    for n in ast.walk(ast.parse(source)):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "re"
            and n.func.attr in ("compile", "match", "search", "fullmatch", "findall", "sub", "finditer")
            and n.args
            and isinstance(n.args[0], ast.Constant)
            and isinstance(n.args[0].value, str)
            and KEY_PATTERN_WORDS.search(n.args[0].value)
        ):
            bad.append(f"{where}:{n.lineno}")
    return sorted(bad)


def test_step_layer_and_lora_key_patterns_are_rows_of_the_key_table():
    bad = [v for p in modules() if not is_key_table(rel(p)) for v in key_pattern_literals(p.read_text(), rel(p))]
    assert bad == []


def test_the_key_pattern_rule_sees_each_call():
    src = (
        'import re\nA = re.compile(r"^step_(\\d+)$")\ndef f(n):\n    return re.search(r"\\.layers\\.(\\d+)\\.", n)\n'
        'B = re.compile(r"^(?P<m>.+)\\.lora_(?P<ab>[AB])\\.weight$")\nC = re.compile(r"^[0-9a-f]{64}$")\n'
        'D = re.compile(r"global_step_(\\d+)")\n'
    )
    assert key_pattern_literals(src, "m.py") == ["m.py:2", "m.py:4", "m.py:5"]
    assert is_key_table("ckpt_tools/core/keys.py") and is_key_table("ckpt_tools/formats/verl/keys.py")
    assert not is_key_table("ckpt_tools/formats/verl/layout.py")


# One planner per job: every command that writes a PEFT adapter dir (extract-adapter, fix-adapter,
# average, resize-adapter, restart-prep's adapter check) lays it out through formats/peft/layout.py; the
# layout rules it applies are called nowhere else.
ADAPTER_LAYOUT_RULES = ("peft_config", "target_modules_for", "exact_modules_to_save", "plan_fused",
                        "fused_config", "full_tensor_warning")


def test_every_adapter_dir_is_laid_out_by_the_one_planner():
    bad = []
    for p in modules():
        if rel(p).startswith("ckpt_tools/formats/peft/"):
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Call):
                name = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", None)
                if name in ADAPTER_LAYOUT_RULES:
                    bad.append(f"{rel(p)}:{n.lineno}: {name}")
    assert bad == []


def test_dcp_items_are_decoded_in_one_module():
    """The torch.save zip of an item is opened (zipfile) and loaded (torch.load) in formats/dcp/item.py only."""
    home = "ckpt_tools/formats/dcp/item.py"
    bad = []
    for p in modules():
        if rel(p) == home:
            continue
        for mod, _names, n in imports(p):
            if mod[0] == "zipfile":
                bad.append(f"{rel(p)}:{n.lineno}: imports zipfile")
        for n in ast.walk(ast.parse(p.read_text())):
            if (
                isinstance(n, ast.Attribute)
                and n.attr == "load"
                and isinstance(n.value, ast.Name)
                and n.value.id == "torch"
            ):
                bad.append(f"{rel(p)}:{n.lineno}: torch.load")
    assert bad == []


def test_public_modules_declare_their_names():
    missing = []
    for p in modules():
        tree = ast.parse(p.read_text())
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        if p.name == "__main__.py" or (p.name == "__init__.py" and not body):
            continue  # an entry point, or a package whose docstring is all it has
        if not any(
            isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
            for n in tree.body
        ):
            missing.append(rel(p))
    assert missing == []


@pytest.mark.parametrize("what", ["core", "dcp metadata", "byte movers"])
def test_the_metadata_side_needs_no_torch(what):
    """Names, sizes and a checkpoint's metadata model load without importing torch (the ground for
    torch-free `inspect` / `verify`); so do the ops that only move and cast bytes (slim, extract-adapter:
    torch is imported inside the functions that build tensors, `if TYPE_CHECKING:` for annotations), with
    what they write (the DCP writer, its `.metadata` encoder, the PEFT and safetensors writers)."""
    fixture = REPO / "tests/fixtures/primerl-tiny/outputs/checkpoints/step_3/trainer/.metadata"
    code = {
        "core": "import ckpt_tools.core.dtypes, ckpt_tools.core.keys, ckpt_tools.core.lora_math, "
        "ckpt_tools.core.tied, ckpt_tools.core.units, ckpt_tools.core.errors, "
        "ckpt_tools.core.primerl_state, ckpt_tools.core.problems, ckpt_tools.core.progress",
        "dcp metadata": "from ckpt_tools.formats.dcp.metadata import load_metadata\n"
        "from ckpt_tools.formats.dcp.model import parse_metadata\n"
        "import ckpt_tools.formats.dcp.item, ckpt_tools.formats.dcp.layout, ckpt_tools.formats.sniff\n"
        "import ckpt_tools.formats.safetensors.header, ckpt_tools.formats.slim.manifest\n"
        f"md = load_metadata(open({str(fixture)!r}, 'rb').read(), 'fixture')\n"
        "p = parse_metadata(md)\n"
        "assert len(p.entries) == 229 and p.fatal() is None, p.fatal()",
        "byte movers": "import ckpt_tools.ops.slim, ckpt_tools.ops.extract_adapter, ckpt_tools.sources.hashing\n"
        "import ckpt_tools.formats.dcp.writer, ckpt_tools.formats.dcp.metadata_pickle\n"
        "import ckpt_tools.formats.peft.writer, ckpt_tools.formats.safetensors.writer\n"
        "import ckpt_tools.core.casts, ckpt_tools.formats.slim.writer, ckpt_tools.sources.open",
    }[what]
    code += "\nimport sys\nassert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# --- io/ is the only code that creates, renames, removes or locks files -----------------------------------
# The calls that change the filesystem or take a lock. Outside io/ a module asks io/ (files, staging, lock,
# copy) to do it, so the rules of the write side (O_CREAT|O_EXCL|O_NOFOLLOW, never through a link, atomic
# renames, fsync) hold in one place.
_FS_MODULE_CALLS = {
    "os": {
        "rename",
        "replace",
        "renames",
        "unlink",
        "remove",
        "rmdir",
        "removedirs",
        "mkdir",
        "makedirs",
        "link",
        "symlink",
        "truncate",
        "ftruncate",
        "open",
        "mkfifo",
        "mknod",
        "chmod",
        "chown",
        "utime",
    },
    "shutil": {"rmtree", "move", "copy", "copy2", "copyfile", "copytree", "copyfileobj", "chown"},
    "fcntl": {"flock", "lockf"},
    "tempfile": {"mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryFile", "TemporaryDirectory"},
}
# Path methods that write (a str method of the same name, `.replace(a, b)`, takes two arguments)
_FS_PATH_METHODS = {
    "unlink",
    "rmdir",
    "mkdir",
    "touch",
    "write_text",
    "write_bytes",
    "symlink_to",
    "hardlink_to",
    "chmod",
    "rename",
}


def _fs_calls(p: Path):
    for n in ast.walk(ast.parse(p.read_text())):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Name)
            and f.attr in _FS_MODULE_CALLS.get(f.value.id, ())
        ):
            yield n.lineno, f"{f.value.id}.{f.attr}"
        elif (
            isinstance(f, ast.Attribute)
            and f.attr in _FS_PATH_METHODS
            and not (isinstance(f.value, ast.Name) and f.value.id in _FS_MODULE_CALLS)
        ):
            yield n.lineno, f".{f.attr}()"
        elif isinstance(f, ast.Name) and f.id == "open" and len(n.args) > 1:
            mode = n.args[1]
            if not (
                isinstance(mode, ast.Constant)
                and isinstance(mode.value, str)
                and set(mode.value) <= set("rbt")
            ):
                yield n.lineno, "open(..., mode)"


def test_only_io_creates_renames_removes_or_locks_files():
    found = [
        f"{rel(p)}:{line}: {what}"
        for p in modules()
        if "io" != p.relative_to(PKG).parts[0]
        for line, what in _fs_calls(p)
    ]
    assert not found, "\n".join(found)


def test_the_io_rule_sees_each_kind_of_call(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import os, shutil, fcntl\nfrom pathlib import Path\n"
        "os.rename('a', 'b')\nshutil.rmtree('d')\nfcntl.flock(3, 2)\nPath('x').unlink()\n"
        "open('f', 'w')\nopen('f', 'rb')\n'a'.replace('a', 'b')\n"
    )
    assert [w for _, w in _fs_calls(src)] == [
        "os.rename",
        "shutil.rmtree",
        "fcntl.flock",
        ".unlink()",
        "open(..., mode)",
    ]


# --- ops and workflows ask a source for capabilities, never its class or its insides -------------------------
# The concrete handles and sources: every class of formats/ and sources/ that is (or derives from) a `Source`
# or `LoraSource`, and the formats' handles. An op that branches on one of them, or reaches into a handle's
# files (`x.model_dir.`, `x.files.read_into(...)`), breaks when a format gains a second layout or a remote
# reader; it asks `formats.handle`'s capabilities instead (`masters`, `copy_range`, `ckpt`, `adapter`, ...).
_HANDLES = {"HFModelDir", "DcpCheckpoint", "PeftAdapter"}
_PROTOCOLS = {"Source", "LoraSource"}
_OPEN_FILES_METHODS = {"fd", "size", "check_range", "read", "read_into", "hint", "close", "stats"}


def concrete_source_classes() -> set[str]:
    bases: dict[str, set[str]] = {}
    for p in modules(PKG / "formats") + modules(PKG / "sources"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ClassDef):
                bases[n.name] = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in n.bases}
    found = set(_HANDLES)
    changed = True
    while changed:
        changed = False
        for name, bs in bases.items():
            if name not in found and name not in _PROTOCOLS and bs & (found | _PROTOCOLS):
                found.add(name)
                changed = True
    return found


def _source_class_uses(p: Path, concrete: set[str]):
    for n in ast.walk(ast.parse(p.read_text())):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id in ("isinstance", "issubclass")
            and len(n.args) == 2
        ):
            for c in ast.walk(n.args[1]):
                name = c.id if isinstance(c, ast.Name) else c.attr if isinstance(c, ast.Attribute) else None
                if name in concrete:
                    yield n.lineno, f"isinstance(..., {name})"
        elif isinstance(n, ast.Attribute) and n.attr == "model_dir" and not isinstance(n.ctx, ast.Store):
            yield n.lineno, ".model_dir"
        elif (
            isinstance(n, ast.Attribute)
            and n.attr in _OPEN_FILES_METHODS
            and isinstance(n.value, ast.Attribute)
            and n.value.attr == "files"
        ):
            yield n.lineno, f".files.{n.attr}"


def test_ops_and_workflows_never_branch_on_a_concrete_source_or_reach_into_a_handle():
    concrete = concrete_source_classes()
    assert {
        "HFModelDir",
        "DcpCheckpoint",
        "PeftAdapter",
        "DcpBaseSource",
        "DcpKeySource",
        "DcpLoraSource",
        "PeftLoraSource",
        "TensorFileSource",
        "NoLoraSource",
        "DeltaSource",
    } <= concrete, concrete
    found = [
        f"{rel(p)}:{line}: {what}"
        for p in modules(PKG / "ops") + modules(PKG / "workflows")
        for line, what in _source_class_uses(p, concrete)
    ]
    assert not found, "\n".join(found)


def test_the_source_rule_sees_each_kind_of_use(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "if isinstance(base, HFModelDir): pass\nif isinstance(s, (int, lora.DcpLoraSource)): pass\n"
        "fd = base.model_dir.fd('x')\nckpt.files.hint([])\nn = cfg.files.files\n"
        "if isinstance(s, Source): pass\n"
    )
    assert [w for _, w in sorted(_source_class_uses(src, concrete_source_classes()))] == [
        "isinstance(..., HFModelDir)",
        "isinstance(..., DcpLoraSource)",
        ".model_dir",
        ".files.hint",
    ]


# --- every command is a thin client of ckpt_tools.api ------------------------------------------------------
# A command module parses its arguments, makes one `ckpt_tools.api` call and renders the report: it imports
# nothing that does the work (ops, sources, formats, workflows, io, dist), only the api, the CLI's own helpers
# (cli/*: flow, render, options, mistakes, progress, and a sibling command's renderer), the core facts it
# renders with or converts arguments to, io.signals (SIGTERM as the run starts, the interrupt it catches),
# and the standard library and click.
COMMAND_MAY_IMPORT = (
    "ckpt_tools.api",
    "ckpt_tools.cli",
    "ckpt_tools.core.errors",
    "ckpt_tools.core.units",
    "ckpt_tools.core.progress",
    "ckpt_tools.core.problems",
    "ckpt_tools.core.primerl_state",
    "ckpt_tools.io.signals",
)


def command_import_violations(source: str, where: str = "ckpt_tools/cli/commands/x.py") -> list[str]:
    """Every import in a command module's `source` (lazy ones included) that is not one of
    COMMAND_MAY_IMPORT (or below it), the standard library or click."""
    pkg = where.split("/")[:-1]
    bad = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.ImportFrom):
            mod = (
                (pkg[: len(pkg) - (n.level - 1)] + (n.module.split(".") if n.module else []))
                if n.level
                else (n.module or "").split(".")
            )
            # `from ckpt_tools import api`: the names are modules
            names = [".".join(mod + [a.name]) for a in n.names] if mod == ["ckpt_tools"] else [".".join(mod)]
        elif isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top != "ckpt_tools":
                ok = top in sys.stdlib_module_names or top == "click"
            else:
                ok = any(name == m or name.startswith(m + ".") for m in COMMAND_MAY_IMPORT)
            if not ok:
                bad.append(f"{where}:{n.lineno}: imports {name}")
    return bad


def test_every_command_is_a_thin_client_of_the_api():
    commands = sorted((PKG / "cli" / "commands").glob("*.py"))
    assert len(commands) >= 18
    bad = [v for p in commands for v in command_import_violations(p.read_text(), rel(p))]
    assert bad == [], "\n".join(bad)
    # each command calls the api (its one call, `api.<command>(...)`)
    assert [rel(p) for p in commands if p.name != "__init__.py" and "api." not in p.read_text()] == []


def test_the_thin_client_rule_sees_each_kind_of_import():
    src = (
        "from __future__ import annotations\nimport click\nfrom pathlib import Path\nfrom ... import api\n"
        "from ...api import MergeReport\nfrom ..flow import finish\nfrom ...core.units import human_bytes\n"
        "from ...io.signals import Terminated\n"
        # the work done behind the api's back, each way it can be written:
        "from ...ops.merge import plan_merge\nfrom ...sources.lora import DcpLoraSource\n"
        "from ... import dist\nfrom ...io import remote\nimport ckpt_tools.formats.sniff\n"
        "def f():\n    from ...workflows.restart_prep import restart_prep\n    import torch\n"
    )
    got = [v.split(": imports ")[1] for v in command_import_violations(src)]
    assert got == [
        "ckpt_tools.ops.merge",
        "ckpt_tools.sources.lora",
        "ckpt_tools.dist",
        "ckpt_tools.io",
        "ckpt_tools.formats.sniff",
        "ckpt_tools.workflows.restart_prep",
        "torch",
    ]
