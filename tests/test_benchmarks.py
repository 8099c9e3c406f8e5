"""The benchmark scripts still run: ``benchmarks/run.py --quick`` gives every figure, ``gpu_check.py`` skips cleanly."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
FIGURES = {"1a", "1b", "1c", "1d", "1e", "1f", "2", "3", "3r", "4", "5", "6", "7", "8"}


@pytest.mark.slow
def test_quick_run_reports_every_figure(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run.py"), "--quick", "--out", str(out), "--workdir", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text("utf-8"))
    assert results["quick"] is True
    assert {"cpu", "cores", "ram_gib"} <= results["machine"].keys()
    assert {"python", "torch", "onnxruntime", "iobundle"} <= results["versions"].keys()
    figures = {f["id"]: f for f in results["figures"]}
    assert figures.keys() == FIGURES
    for fig in figures.values():
        assert fig["rows"], fig["id"]
        for row in fig["rows"]:
            if row["available"]:
                assert row["min"] <= row["median"] <= row["max"], (fig["id"], row["variant"])
                assert row["ratio"] is not None and row["ratio"] > 0, (fig["id"], row["variant"])
    for fig_id in ("1a", "1b", "1c", "1d", "1e", "1f", "2", "3", "4", "5", "6", "7", "8"):
        assert figures[fig_id]["targets"], fig_id
        for target in figures[fig_id]["targets"]:
            assert target["met"] in (True, False, None)
            assert (target["met"] is None) == (target["ratio"] is None) or target["target"] == "(no target)", target
    variants_1a = {r["variant"] for r in figures["1a"]["rows"]}
    assert {"plain", "floor", "write_floor", "larger_floor", "reference", "iobundle", "streaming"} <= variants_1a
    rows_1a = {r["variant"]: r for r in figures["1a"]["rows"]}
    larger = [max(a, b) for a, b in zip(rows_1a["floor"]["samples"], rows_1a["write_floor"]["samples"])]
    assert rows_1a["larger_floor"]["samples"] == larger
    floor_target = figures["1a"]["targets"][0]
    assert floor_target["check"].startswith("streaming incl. the flush / larger floor")
    assert floor_target["row"] == "streaming_flush"
    # 5: two floors (inputs read from files: the targets' denominator; inputs in memory), check and validate
    rows_5 = {r["variant"]: r for r in figures["5"]["rows"]}
    assert {"linear:bare_files", "linear:bare", "linear:check", "linear:validate"} <= rows_5.keys()
    assert rows_5["linear:bare_files"]["ratio"] == 1.0
    assert [t["row"] for t in figures["5"]["targets"]] == ["linear:check", "linear:validate"]
    # 1e: microseconds per decode call on the recording thread, unobserved vs in memory vs streaming
    rows_1e = {r["variant"]: r for r in figures["1e"]["rows"]}
    assert rows_1e.keys() == {"plain", "iobundle", "streaming"}
    assert figures["1e"]["unit"].startswith("µs per decode call")
    assert [t["row"] for t in figures["1e"]["targets"]] == ["iobundle", "streaming"]
    if results["streaming_available"]:
        target = figures["1e"]["targets"][1]
        assert target["target"] == "≤ 300 µs" and target["met"] == (target["ratio"] <= 300)
    # 1f: per depth a plain and a streamed row, the targets at the deepest (32 in a full run) and the growth
    rows_1f = [r["variant"] for r in figures["1f"]["rows"]]
    assert rows_1f == ["plain_2", "streamed_2", "plain_4", "streamed_4"]
    assert [t["target"] for t in figures["1f"]["targets"]] == ["≤ 1.00 ms", "≤ 1.10", "≤ 5 µs", "(no target)"]
    assert results["streaming_available"] == figures["1a"]["rows"][-1]["available"]
    table = (out / "BENCHMARKS.md").read_text("utf-8")
    assert "| figure | check | ratio | target | met? |" in table
    for fig_id in FIGURES:
        assert f"### {fig_id}. " in table


def test_rerun_keeps_text_outside_the_results_block(tmp_path):
    spec = importlib.util.spec_from_file_location("iobundle_benchmarks_run", BENCHMARKS / "run.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules[spec.name]
    path = tmp_path / "BENCHMARKS.md"
    bench.write_markdown(path, "first table\n")
    path.write_text(path.read_text("utf-8") + "\n## Analysis\n\nhand-written\n", "utf-8")
    bench.write_markdown(path, "second table\n")
    text = path.read_text("utf-8")
    assert "second table" in text and "first table" not in text
    assert text.endswith("## Analysis\n\nhand-written\n")


def test_gpu_check_skips_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: gpu_check.py measures instead of skipping")
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["skipped"] == "no CUDA"
    assert "skipped: no CUDA" in proc.stderr


@pytest.mark.slow
def test_gpu_check_code_paths_run_on_cpu():
    # No GPU in CI: --allow-cpu runs the same measurements on CPU, so that at least the code runs.
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--allow-cpu", "--reps", "1", "--new-tokens", "2",
         "--mib", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for case in ("demo_decoder", "tiny_llama"):
        variants = result["decode"][case]["variants"]
        assert {"plain", "reference", "iobundle"} <= variants.keys()
        assert all("median" in v for v in variants.values()), variants
    assert {"pageable_prefaulted_copy", "iobundle_tensor_bytes", "iobundle_in_memory_snapshot"} <= result["d2h"].keys()


def test_benchmarks_use_only_public_faces_of_iobundle():
    """No ``iobundle.X._y``: the private modules behind a public face move without notice."""
    private = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "iobundle" and any(p.startswith("_") and p != "__version__" for p in parts):
                    private.append(f"{path.name}:{node.lineno} {name}")
    assert private == []


def test_benchmarks_use_no_private_name_of_another_benchmark_module():
    """What two benchmarks share lives in a module of its own (``benchmarks/measure.py``), imported by its public names."""
    private = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks"):
                private += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []


def test_no_benchmark_module_over_800_lines():
    lengths = {p.name: len(p.read_text("utf-8").splitlines()) for p in BENCHMARKS.glob("*.py")}
    assert len(lengths) > 2 and {n: k for n, k in lengths.items() if k > 800} == {}


TINY_DECODER = ["--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "256"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "4,2"], "distinct positive layer counts in increasing order"),
        (["--layers", "2,x"], "give layer counts as integers"),
        (["--hidden", "100", "--heads", "16"], "must be a multiple of the heads"),
        (["--new-tokens", "0"], "--new-tokens 0: give a positive integer"),
    ],
)
def test_large_benchmark_refuses_bad_arguments(args, message):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "large.py"), *args], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [("instructions.py", ["--calls", "40", "20"], "needs 0 < FEW < MANY"),
     ("instructions.py", ["--calls", "0", "20"], "needs 0 < FEW < MANY"),
     ("instructions.py", ["--layers", "0"], "--layers needs at least 1"),
     ("hot_loop.py", ["--layers", "0"], "--layers needs at least 1"),
     ("hot_loop.py", ["--calls", "0"], "--calls and --rounds need at least 1"),
     ("hot_loop.py", ["--rounds", "0"], "--calls and --rounds need at least 1")],
)  # fmt: skip
def test_a_recording_loop_refuses_bad_arguments_before_running_anything(script, args, message):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert message in proc.stderr


def test_hot_loop_measures_recording_on_a_two_layer_cache():
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "hot_loop.py"), "--layers", "2", "--calls", "3", "--rounds", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"recording (-?\d+) µs of the model's thread per decode call .* 2 layers", proc.stdout)
    assert found and int(found.group(1)) > 0  # streaming costs the thread something


@pytest.mark.slow
def test_large_benchmark_runs_end_to_end_on_a_tiny_decoder(tmp_path):
    # make bench-large at a tiny size: capture, export and validate, each stage in its own process
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "large.py"), *TINY_DECODER, "--layers", "1,2", "--new-tokens", "3",
         "--out", str(out), "--workdir", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results_large.json").read_text("utf-8"))
    assert [s["layers"] for s in results["sizes"]] == [1, 2]
    one, two = results["sizes"]
    per_layer = two["params"] - one["params"]  # q, k, v, o, the MLP's three and two norms
    assert per_layer == 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    for size in results["sizes"]:
        assert size["weight_bytes"] == 4 * size["params"]  # float32
        assert size["onnx_bytes"] > size["weight_bytes"] and size["bundle_bytes"] > size["weight_bytes"]
        stages = size["stages"]
        assert stages.keys() == {"capture", "export", "validate"}
        assert stages["capture"]["calls"] == 3
        assert stages["validate"]["verdict"].startswith("PASS: 3/3 calls")
        for out_stage in stages.values():
            assert out_stage["seconds"] > 0 and out_stage["rss_peak"] >= out_stage["rss_baseline"]
            assert out_stage["peak_over_weights"] == out_stage["rss_peak"] / size["weight_bytes"]
        phases = [p["phase"] for p in stages["export"]["phases"]]
        for phase in ("load model from the bundle", "torch.export", "check on every recorded call",
                      "torch.onnx.export (translation)", "ONNX save"):  # fmt: skip
            assert phase in phases
    assert [(g["stage"], g["layers"]) for g in results["growth"]] == [
        ("capture", [1, 2]), ("export", [1, 2]), ("validate", [1, 2])
    ]  # fmt: skip
    table = (out / "BENCHMARKS.md").read_text("utf-8")
    assert "<!-- large:begin" in table and table.rstrip().endswith("<!-- large:end -->")
    assert "| layers | params | weights |" in table and "Growth with the number of layers" in table


def _layers_module():
    spec = importlib.util.spec_from_file_location("iobundle_benchmarks_layers", BENCHMARKS / "layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layers_benchmark_gives_each_step_its_growth_exponent():
    layers = _layers_module()
    counts = [6, 12, 24]
    # a linear step, a quadratic one, a constant one: exponents 1, 2, 0 between every pair and over the range
    runs = {
        n: [{"cpu_seconds": {step: 0.1 * n if i == 0 else 0.01 * n * n if i == 1 else 3.0 for i, step in enumerate(layers.STEPS)}}
            for _ in range(2)]
        for n in counts
    }  # fmt: skip
    runs[12][1]["cpu_seconds"][layers.STEPS[0]] = 5.0  # a slower repetition: the fastest one counts
    rows = {r["step"]: r for r in layers.summarise(counts, runs)}
    assert list(rows) == [*layers.STEPS, "total"]
    linear, quadratic, constant = rows[layers.STEPS[0]], rows[layers.STEPS[1]], rows[layers.STEPS[2]]
    assert linear["cpu_seconds"] == pytest.approx([0.6, 1.2, 2.4])
    assert linear["pair_exponents"] == pytest.approx([1, 1]) and linear["exponent"] == pytest.approx(1)
    assert quadratic["pair_exponents"] == pytest.approx([2, 2]) and quadratic["exponent"] == pytest.approx(2)
    assert constant["exponent"] == pytest.approx(0)
    results = {
        "started": "now", "seconds": 1.0, "machine": "m", "loadavg_start": None, "loadavg_end": None,
        "config": {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 512, "batch": 2,
                   "prompt": 8, "new_tokens": 3, "threads": 1, "reps": 2, "layers": counts},
        "sizes": [{"layers": n, "params": 1000 * n, "calls": 3} for n in counts],
        "steps": list(rows.values()),
    }  # fmt: skip
    table = layers.render(results).splitlines()
    assert any(line.startswith(f"| {layers.STEPS[1]} |") and line.endswith("| 2.00 | **no** |") for line in table)
    assert any(line.startswith(f"| {layers.STEPS[0]} |") and line.endswith("| 1.00 | yes |") for line in table)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "6"], "give at least two layer counts"),
        (["--reps", "0"], "--reps 0: give a positive integer"),
        (["--layers", "12,6"], "distinct positive layer counts in increasing order"),
    ],
)
def test_layers_benchmark_refuses_bad_arguments(args, message):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "layers.py"), *args], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.slow
def test_layers_benchmark_runs_end_to_end_on_two_tiny_sizes(tmp_path):
    # make bench-layers at two tiny sizes, one repetition: every step timed in the export process
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "layers.py"), "--layers", "1,2", "--reps", "1", "--new-tokens", "2",
         "--out", str(out), "--workdir", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    layers = _layers_module()
    results = json.loads((out / "results_layers.json").read_text("utf-8"))
    assert [s["layers"] for s in results["sizes"]] == [1, 2]
    for size in results["sizes"]:
        assert size["calls"] == 2 and len(size["runs"]) == 1
        run = size["runs"][0]
        assert list(run["cpu_seconds"]) == list(run["wall_seconds"]) == list(layers.STEPS)
        assert all(run["wall_seconds"][step] > 0 for step in layers.STEPS), run  # every step was marked
        assert all(run["cpu_seconds"][step] >= 0 for step in layers.STEPS), run
    assert [r["step"] for r in results["steps"]] == [*layers.STEPS, "total"]
    assert all(len(r["pair_exponents"]) == 1 for r in results["steps"])
    table = (out / "BENCHMARKS.md").read_text("utf-8")
    assert "<!-- layers:begin" in table and table.rstrip().endswith("<!-- layers:end -->")
    assert "| step | 1 layers | 2 layers | exp. 1→2 | exponent |" in table
