"""A non-editable install carries the templates and the shipped database into the wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_carries_templates_and_renders_from_anywhere(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("flashgen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    templates = {Path(n).name for n in names if n.startswith("flashgen/templates/")}
    assert {"attn_fwd_fa2.py.jinja", "attn_fwd_fa1.py.jinja", "_online_softmax.py.jinja"} <= (
        templates
    )
    assert any(n.startswith("flashgen/tuning_db/") for n in names)

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import flashgen, sys;"
        "assert flashgen.__file__.startswith(sys.argv[1]), flashgen.__file__;"
        "p = flashgen.Problem(1, 2, 1, 9, 9, 80, 'fp16', True);"
        "print(len(flashgen.render(flashgen.Variant('fa1', 16, 16, 2, 1), p)))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) > 1000
