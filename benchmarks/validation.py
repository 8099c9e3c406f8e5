"""Figure 5: check_discrepancies and validate vs a bare onnxruntime loop over the same inputs (two floors)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import Config, Figure, Row, Target, at_most, paired_ratio, remove, run_interleaved

# -- figure 5: check_discrepancies vs a bare onnxruntime loop --------------------------------------


def _export_linear(cfg: Config, workdir: Path) -> tuple[Path, Path]:
    import torch

    from iobundle import InputObserver, load_bundle

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=len(cfg.validate_linear_rows)):
        for rows in cfg.validate_linear_rows:
            model(torch.rand(rows, 1024))
    bundle_path = workdir / "validate-linear.iobundle"
    observer.save(bundle_path, overwrite=True)
    onnx_path = workdir / "linear.onnx"
    load_bundle(bundle_path).to_onnx(model, onnx_path)
    return bundle_path, onnx_path


def _export_demo(workdir: Path) -> tuple[Path, Path]:
    from iobundle import load_bundle
    from iobundle.demo import capture_demo, demo_model

    bundle_path, _ = capture_demo(workdir)
    onnx_path = workdir / "demo.onnx"
    load_bundle(bundle_path).to_onnx(demo_model(), onnx_path)
    return bundle_path, onnx_path


def _validation_case(cfg: Config, fig: Figure, bundle_path: Path, onnx_path: Path, workdir: Path) -> None:
    import numpy as np
    import onnxruntime as ort
    from safetensors.numpy import load_file, save_file

    from iobundle import load_bundle

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    meta = dict(session.get_modelmeta().custom_metadata_map)
    names = [i.name for i in session.get_inputs()]
    slots = json.loads(meta["iobundle.input_slots"]) if "iobundle.input_slots" in meta else dict(zip(names, range(99)))
    source = load_bundle(bundle_path)
    feeds = []
    for i in range(source.num_obs()):
        flat = source.infer_arguments(i, flat=True)
        feeds.append({n: np.array(flat[slots[n]].numpy(), copy=True) for n in names})
    del source, session
    # The same inputs in safetensors files, one per call: the floor that reads them as a validation must.
    input_files = [workdir / f"{onnx_path.stem}-inputs-{i}.safetensors" for i in range(len(feeds))]
    for path, feed in zip(input_files, feeds):
        save_file(feed, str(path))

    def options() -> Any:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        return opts

    def bare(rep: int) -> dict[str, float]:
        begin = time.perf_counter()
        sess = ort.InferenceSession(str(onnx_path), options(), providers=["CPUExecutionProvider"])
        created = time.perf_counter()
        for f in feeds:
            sess.run(None, f)
        end = time.perf_counter()
        return {"t": end - begin, "runs": end - created}

    def bare_files(rep: int) -> dict[str, float]:
        begin = time.perf_counter()
        sess = ort.InferenceSession(str(onnx_path), options(), providers=["CPUExecutionProvider"])
        for path in input_files:
            sess.run(None, load_file(str(path)))
        return {"t": time.perf_counter() - begin}

    ok = {"all": True}

    def check(verify: bool) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            begin = time.perf_counter()
            rows = load_bundle(bundle_path, verify=verify).check_discrepancies(onnx_path)
            elapsed = time.perf_counter() - begin
            ok["all"] = ok["all"] and all(r["SUCCESS"] for r in rows) and len(rows) == len(feeds)
            return {"t": elapsed}

        return run

    def validate(rep: int) -> dict[str, float]:
        begin = time.perf_counter()
        report = load_bundle(bundle_path).validate(onnx_path)
        elapsed = time.perf_counter() - begin
        ok["all"] = ok["all"] and report.ok and len(report.rows) == len(feeds)
        return {"t": elapsed}

    variants = {
        "bare": bare, "bare_files": bare_files, "check": check(True), "check_noverify": check(False),
        "validate": validate,
    }  # fmt: skip
    samples = run_interleaved(cfg.reps_cheap, variants, warmup=cfg.warmup)
    for path in input_files:
        remove(path)
    case = onnx_path.stem
    n = len(feeds)
    labels = {
        "bare_files": f"{case}: bare onnxruntime loop reading the inputs from files (session + {n} × load_file + run)",
        "bare": f"{case}: bare onnxruntime loop, inputs in memory (session + {n} runs)",
        "bare_runs": f"{case}: the {n} session.run calls alone",
        "check": f"{case}: load_bundle(...).check_discrepancies(onnx)",
        "check_noverify": f"{case}: same with load_bundle(verify=False)",
        "validate": f"{case}: load_bundle(...).validate(onnx), output by output (what `iobundle validate` runs)",
    }
    for name, label in labels.items():
        values = samples["bare"]["runs"] if name == "bare_runs" else samples[name]["t"]
        fig.rows.append(Row(f"{case}:{name}", label, [s * 1e3 for s in values]))
        fig.row(f"{case}:{name}").ratio = paired_ratio(values, samples["bare_files"]["t"])
    for name, what, limit in (("check", "check_discrepancies", 1.1), ("validate", "validate", 1.2)):
        r = fig.row(f"{case}:{name}").ratio
        fig.targets.append(
            Target(
                f"{case}: {what} / bare loop reading the inputs",
                r,
                f"≤ {limit:.2f}",
                at_most(r, limit),
                f"{case}:{name}",
                "" if ok["all"] else "some calls did not pass validation",
            )
        )


def figure_5(cfg: Config, workdir: Path) -> Figure:
    fig = Figure(
        "5",
        "Validation: check_discrepancies and validate vs a bare onnxruntime loop over the same inputs",
        "ms",
        "bare_files",
        "time / bare loop reading the inputs from files (session creation + reads + runs) of the same case, "
        "paired by repetition",
    )
    linear_bundle, linear_onnx = _export_linear(cfg, workdir)
    _validation_case(cfg, fig, linear_bundle, linear_onnx, workdir)
    paths = [linear_bundle, linear_onnx]
    if cfg.validate_demo:
        demo_bundle, demo_onnx = _export_demo(workdir)
        _validation_case(cfg, fig, demo_bundle, demo_onnx, workdir)
        paths += [demo_bundle, demo_onnx]
    fig.notes.append(
        f"linear: Linear(1024, 1024) on {len(cfg.validate_linear_rows)} calls of {list(cfg.validate_linear_rows)}x1024; "
        "demo: iobundle.demo.capture_demo (the tiny decoder, prefill + 5 decode calls). Both exported with "
        "Bundle.to_onnx. Two floors: the bare loop reading each call's inputs from a safetensors file "
        "(safetensors.numpy.load_file, the same tensors; the floor the targets use, since validation reads them from "
        "the bundle), and the bare loop over inputs prepared in memory beforehand. check_discrepancies and validate "
        "also read and compare the recorded outputs; with verify (the default) they hash each file on first read. "
        "validate computes every statistic of each output but its median and quantile, selected on request "
        "(Tolerances.quantiles; `iobundle validate --report` requests them). Targets (issue 26): "
        "check_discrepancies ≤ 1.1, validate ≤ 1.2."
    )
    for path in paths:
        remove(path)
    return fig
