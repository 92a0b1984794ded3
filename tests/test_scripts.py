"""scripts/: the commands retune.sh would run are ones `flashgen tune` accepts, sweep_space's
parts, and the pure parts of the Python scripts (search_quality's sampling,
probe_step_phases' timelines)."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import typer.main

from flashgen.cli import app
from flashgen.kernels.presets import PRESETS

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _dry_run(*args: str) -> list[list[str]]:
    run = subprocess.run(["bash", str(ROOT / "scripts" / "retune.sh"), "--dry-run", *args],
                         capture_output=True, text=True, check=True)
    return [shlex.split(line[2:]) for line in run.stdout.splitlines() if line.startswith("+ ")]


def test_retune_runs_tune_with_options_it_has() -> None:
    tune = typer.main.get_command(app).commands["tune"]  # type: ignore[attr-defined]
    known = {opt for param in tune.params for opt in param.opts}
    commands = _dry_run("--db", "x.db", "--", "--remeasure")
    assert [c[c.index("--mode") + 1] for c in commands] == ["fwd", "bwd"]
    for command in commands:
        assert command[1:4] == ["-m", "flashgen", "tune"]
        options = [word for word in command[4:] if word.startswith("--")]
        assert set(options) <= known, set(options) - known
        presets = [command[i + 1] for i, word in enumerate(command) if word == "--preset"]
        assert presets == ["fa-bench", "llama3-8b", "gemma2-9b"] and set(presets) <= set(PRESETS)
        assert command[command.index("--db") + 1] == "x.db"


def test_retune_needs_a_database() -> None:
    run = subprocess.run(["bash", str(ROOT / "scripts" / "retune.sh"), "--dry-run"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--db" in run.stderr


def test_retune_tunes_fp8_forward_only_when_asked() -> None:
    dtypes = [c[c.index("--dtype") + 1] for c in _dry_run("--db", "x.db", "--fp8")]
    assert dtypes == ["fp16,bf16,fp8", "fp16,bf16"]  # fwd, then bwd: fp8 has no backward
    assert [c[c.index("--dtype") + 1] for c in _dry_run("--db", "x.db")] == ["fp16,bf16"] * 2


def _script(name: str) -> object:
    """scripts/`name`.py imported as a module (the scripts folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _search_quality() -> object:
    return _script("search_quality")


def test_search_quality_samples_keep_the_portfolio_and_every_point_asked_for() -> None:
    from flashgen.kernels.fwd_space import default_variant, portfolio
    from flashgen.kernels.hardware import DeviceInfo

    sq = _search_quality()
    hopper = DeviceInfo("H-test", (9, 0), 132, 232448)
    problem = sq.shape_problem("3,32,8,3072,128,1", "bf16")  # type: ignore[attr-defined]
    assert (problem.heads_kv, problem.seq_k, problem.causal) == (8, 3072, True)
    plain = sq.sample(problem, hopper, 80, seed=0)  # type: ignore[attr-defined]
    assert len(plain) == 80 and len(set(plain)) == 80
    assert {default_variant(problem, hopper), *portfolio(problem, hopper)} <= set(plain)
    wide = sq.sample(problem, hopper, 80, seed=0, every=["fa3"])  # type: ignore[attr-defined]
    fa3 = [v for v in sq.modes.space_of("fwd").points(problem, hopper)  # type: ignore[attr-defined]
           if v.loop_order == "fa3"]
    assert set(fa3) <= set(wide) and len(wide) == max(80, len(set(wide) & set(fa3)))
    assert sq.sample(problem, hopper, 80, seed=0) == plain  # seeded  # type: ignore[attr-defined]


def test_search_quality_parts_split_a_sweep_and_their_costs_merge(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flashgen.kernels.hardware import DeviceInfo

    sq = _search_quality()
    hopper = DeviceInfo("H-test", (9, 0), 132, 232448)
    problem = sq.shape_problem("8,32,32,2048,64,0", "bf16")  # type: ignore[attr-defined]
    points = sq.sample(problem, hopper, 0, seed=0)  # type: ignore[attr-defined]
    parts = [points[k::3] for k in range(3)]
    assert sorted(str(v) for part in parts for v in part) == sorted(map(str, points))
    assert sq.parse_part("2/3") == (2, 3)  # type: ignore[attr-defined]
    for bad in ("3/3", "1", "a/2", "-1/2"):
        with pytest.raises(argparse.ArgumentTypeError, match="K/N"):
            sq.parse_part(bad)  # type: ignore[attr-defined]
    assert sq.noted_costs(tmp_path, problem) is None  # type: ignore[attr-defined]
    for k, (variant, cost, wall) in enumerate([("a", 1.0, 10.0), ("b", 2.0, 30.0)]):
        path = sq.cost_path(tmp_path, problem, (k, 2))  # type: ignore[attr-defined]
        assert path.name.endswith(f"-p{k}of2.json")
        path.write_text(json.dumps({"cost": {variant: cost}, "sweep_s": wall}))
    other = sq.shape_problem("2,32,32,8192,64,0", "bf16")  # type: ignore[attr-defined]
    sq.cost_path(tmp_path, other).write_text(  # type: ignore[attr-defined]
        json.dumps({"cost": {"c": 9.0}, "sweep_s": 99.0}))
    merged = sq.noted_costs(tmp_path, problem)  # type: ignore[attr-defined]
    assert merged == {"cost": {"a": 1.0, "b": 2.0}, "sweep_s": 40.0}
    sq.cost_path(tmp_path, problem, (0, 2)).unlink()  # type: ignore[attr-defined]
    assert sq.noted_costs(tmp_path, problem)["sweep_s"] == 30.0  # type: ignore[attr-defined]
    assert "not all parts of one sweep" in capsys.readouterr().err
    assert sq.main(["--out", str(tmp_path), "--part", "1/2"]) == 2  # type: ignore[attr-defined]


def test_sweep_space_gives_every_gpu_its_workers_and_parts(tmp_path: Path) -> None:
    """scripts/sweep_space.sh with two fake GPUs: four sweep processes, parts 0/4 .. 3/4 of
    the same four problems, two on each GPU, then a count of each part's rows."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: A'\necho 'GPU 1: B'\n")
    real = shutil.which("python3")
    (bin_dir / "python3").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = scripts/search_quality.py ]; then\n'
        f'  echo "$CUDA_VISIBLE_DEVICES $*" >> {tmp_path}/calls; exit 0\n'
        "fi\n"
        f'exec {real} "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    out = tmp_path / "sweep"
    run = subprocess.run(["bash", "scripts/sweep_space.sh", str(out), "5"], cwd=ROOT,
                         capture_output=True, text=True, check=True,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin", "WORKERS": "2"})
    calls = sorted((tmp_path / "calls").read_text().splitlines())
    assert len(calls) == 4
    for k, call in enumerate(calls):
        gpu, *args = call.split()
        assert gpu == str(k // 2)
        assert args[args.index("--part") + 1] == f"{k}/4"
        assert args[args.index("--limit") + 1] == "0"
        assert args.count("--shape") == 4
    assert "2 GPUs x 2 workers" in run.stdout
    assert "sweep: 0 rows in all" in run.stdout  # no part wrote a database
    assert "sweep: done" in run.stdout

    def again(smi: str, sweep: str) -> subprocess.CompletedProcess[str]:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
        (bin_dir / "python3").write_text(
            f'#!/bin/sh\nif [ "$1" = scripts/search_quality.py ]; then {sweep}; fi\n'
            f'exec {real} "$@"\n')
        return subprocess.run(["bash", "scripts/sweep_space.sh", str(out), "5"], cwd=ROOT,
                              capture_output=True, text=True,
                              env={"PATH": f"{bin_dir}:/usr/bin:/bin"})

    none = again("exit 9", "exit 0")  # no GPU: one error line, nothing started
    assert none.returncode == 2 and "needs a GPU" in none.stderr
    failed = again("echo 'GPU 0: A'", "exit 7")
    assert failed.returncode == 1 and "part 1 failed (exit 7)" in failed.stderr
    cut = again("echo 'GPU 0: A'", "sleep 30")  # stopped by the time limit: resumable
    assert cut.returncode == 3 and "run again to resume" in cut.stdout


def test_step_timeline_splits_steps_at_flushes_and_times_their_gaps() -> None:
    from types import SimpleNamespace

    def event(name: str, start: float, end: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    flush = "void at::native::vectorized_elementwise_kernel<FillFunctor<signed char>>"
    kernels = [  # out of order, as a profiler may list them
        event("attn_bwd", 130.0, 190.0), event(flush, 0.0, 10.0), event("attn_fwd", 15.0, 40.0),
        event(flush, 100.0, 110.0), event("attn_bwd", 60.0, 90.0),
        event("attn_fwd", 112.0, 125.0), event(flush, 200.0, 210.0),  # nothing after it
    ]
    timeline = _script("probe_step_phases").timeline  # type: ignore[attr-defined]
    lead, busy, idle, between = timeline(kernels)
    assert lead == [5.0, 2.0] and busy == [55.0, 73.0] and idle == [20.0, 5.0]
    assert dict(between) == {"attn_fwd -> attn_bwd": [20.0, 5.0]}
    assert timeline(kernels, skip=1)[1] == [73.0]  # the first step left out
