"""Run one contender through the launcher and turn what it measured into a result record."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

BENCH = Path(__file__).resolve().parent
LAUNCHER = BENCH / "launch.py"
TAIL_CHARS = 3000


def launcher_python() -> str:
    """A plain system python for the launcher (it needs the stdlib only): the smaller its RSS, the lower
    the floor of every peak-RSS figure (see launch.py)."""
    return shutil.which("python3") or "python3"


def json_objects(text: str) -> list:
    """Every JSON object printed on stdout at the start of a line (N ranks may print one each)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        i = text.find("{", i)
        if i < 0:
            return out
        if i == 0 or text[i - 1] == "\n":
            try:
                obj, end = dec.raw_decode(text, i)
                out.append(obj)
                i = end
                continue
            except ValueError:
                pass
        i += 1


def work_seconds(objs: list) -> float | None:
    """The command's own timing of its work (`result.seconds`, or its `total`), when it reports one."""
    for obj in objs:
        secs = (obj.get("result") or {}).get("seconds") if isinstance(obj, dict) else None
        if isinstance(secs, dict):
            secs = secs.get("total")
        if isinstance(secs, (int, float)):
            return float(secs)
    return None


def tree_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def tree_digests(root: Path) -> dict[str, str]:
    """name -> sha256 of every file under `root` (two outputs are the same when these are equal)."""
    import hashlib

    out = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
        out[str(f.relative_to(root))] = h.hexdigest()
    return out


def run_measured(argv: list[str], log_dir: Path, name: str, timeout_s: float, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> dict:
    """Run argv under the launcher; return its measurements plus rc, stdout JSON and the output tails."""
    log_dir.mkdir(parents=True, exist_ok=True)
    result_path, out_path, err_path = (log_dir / f"{name}.{ext}" for ext in ("measure.json", "stdout", "stderr"))
    result_path.unlink(missing_ok=True)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        subprocess.run([launcher_python(), "-S", "-E", "-s", str(LAUNCHER), str(result_path), f"{timeout_s:.1f}",
                        "--", *argv], stdout=out, stderr=err, env=dict(os.environ, **(env or {})), cwd=cwd,
                       check=False)
    try:
        rec = json.loads(result_path.read_text())
    except (OSError, ValueError) as e:
        return {"status": "failed", "reason": f"the launcher wrote no result ({e})", **_tails(out_path, err_path)}
    if "spawn_error" in rec:
        return {**rec, "status": "failed", "reason": f"cannot start {argv[0]!r}: {rec['spawn_error']}"}
    stdout = out_path.read_text(errors="replace")
    objs = json_objects(stdout)
    rec["work_s"] = work_seconds(objs)
    rec["json_reports"] = len(objs)
    rec["stdout_is_one_json"] = len(objs) == 1 and stdout.strip().startswith("{") and stdout.strip().endswith("}")
    if rec["killed_at_deadline"]:
        rec.update(status="failed", reason=f"stopped at its time limit ({timeout_s:.0f} s)")
    elif rec["rc"] != 0:
        rec.update(status="failed", reason=f"exit status {rec['rc']}")
    else:
        rec["status"] = "ok"
    if rec["status"] != "ok":
        rec.update(_tails(out_path, err_path))
    return rec


def _tails(out_path: Path, err_path: Path) -> dict:
    def tail(p: Path) -> str:
        try:
            return p.read_text(errors="replace")[-TAIL_CHARS:]
        except OSError:
            return ""

    return {"stdout_tail": tail(out_path), "stderr_tail": tail(err_path)}
