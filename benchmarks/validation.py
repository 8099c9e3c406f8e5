"""Figure 5: check_discrepancies vs a bare onnxruntime loop over the same inputs."""

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


def _validation_case(cfg: Config, fig: Figure, bundle_path: Path, onnx_path: Path) -> None:
    import numpy as np
    import onnxruntime as ort

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

    ok = {"all": True}

    def check(verify: bool) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            begin = time.perf_counter()
            rows = load_bundle(bundle_path, verify=verify).check_discrepancies(onnx_path)
            elapsed = time.perf_counter() - begin
            ok["all"] = ok["all"] and all(r["SUCCESS"] for r in rows) and len(rows) == len(feeds)
            return {"t": elapsed}

        return run

    samples = run_interleaved(
        cfg.reps_cheap, {"bare": bare, "check": check(True), "check_noverify": check(False)}, warmup=cfg.warmup
    )
    case = onnx_path.stem
    fig.rows.append(
        Row(
            f"{case}:bare",
            f"{case}: bare onnxruntime loop (session + {len(feeds)} runs)",
            [s * 1e3 for s in samples["bare"]["t"]],
        )
    )
    fig.rows.append(
        Row(
            f"{case}:bare_runs",
            f"{case}: the {len(feeds)} session.run calls alone",
            [s * 1e3 for s in samples["bare"]["runs"]],
        )
    )
    fig.rows.append(
        Row(
            f"{case}:check",
            f"{case}: load_bundle(...).check_discrepancies(onnx)",
            [s * 1e3 for s in samples["check"]["t"]],
        )
    )
    fig.rows.append(
        Row(
            f"{case}:check_noverify",
            f"{case}: same with load_bundle(verify=False)",
            [s * 1e3 for s in samples["check_noverify"]["t"]],
        )
    )
    base = samples["bare"]["t"]
    for name in ("bare", "check", "check_noverify"):
        fig.row(f"{case}:{name}").ratio = paired_ratio(samples[name]["t"], base)
    fig.row(f"{case}:bare_runs").ratio = paired_ratio(samples["bare"]["runs"], base)
    r = fig.row(f"{case}:check").ratio
    fig.targets.append(
        Target(
            f"{case}: check_discrepancies / bare loop",
            r,
            "≤ 1.10",
            at_most(r, 1.1),
            f"{case}:check",
            "" if ok["all"] else "some calls did not pass validation",
        )
    )


def figure_5(cfg: Config, workdir: Path) -> Figure:
    fig = Figure(
        "5",
        "Validation: check_discrepancies vs a bare onnxruntime loop over the same inputs",
        "ms",
        "bare",
        "time / bare loop (session creation + runs) of the same case, paired by repetition",
    )
    linear_bundle, linear_onnx = _export_linear(cfg, workdir)
    _validation_case(cfg, fig, linear_bundle, linear_onnx)
    paths = [linear_bundle, linear_onnx]
    if cfg.validate_demo:
        demo_bundle, demo_onnx = _export_demo(workdir)
        _validation_case(cfg, fig, demo_bundle, demo_onnx)
        paths += [demo_bundle, demo_onnx]
    fig.notes.append(
        f"linear: Linear(1024, 1024) on {len(cfg.validate_linear_rows)} calls of {list(cfg.validate_linear_rows)}x1024; "
        "demo: iobundle.demo.capture_demo (the tiny decoder, prefill + 5 decode calls). Both exported with "
        "Bundle.to_onnx; feeds of the bare loop are prepared in memory beforehand."
    )
    for path in paths:
        remove(path)
    return fig
