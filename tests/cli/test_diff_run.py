"""`iobundle diff A B` and `iobundle run BUNDLE --model|--from-bundle`: tables, reports, exit codes."""

from __future__ import annotations

import pytest
import torch

from iobundle import InputObserver
from iobundle.cli import main


@pytest.fixture
def workdir(tmp_path, factories):
    """factories.py, and bundles of good() (a.iobundle) and drifted() (b.iobundle) on the same inputs."""
    for name, factory in (("a", factories.good), ("b", factories.drifted)):
        model, observer = factory(), InputObserver()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad(), observer(model):
            model(torch.randn(2, 4, generator=g))
            model(torch.randn(3, 4, generator=g))
        observer.save(tmp_path / f"{name}.iobundle")
    return tmp_path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class TestDiff:
    def test_a_bundle_is_alike_itself(self, workdir, capsys):
        code, out, _ = run(capsys, "diff", "a.iobundle", "a.iobundle")
        assert code == 0 and "PASS: 2/2 calls alike" in out

    def test_drift_fails_then_passes_with_a_looser_atol(self, workdir, capsys):
        code, out, _ = run(capsys, "diff", "a.iobundle", "b.iobundle", "--rtol", "0")
        assert code == 1 and "FAIL: 0/2 calls" in out and "inputs abs" in out
        assert run(capsys, "diff", "a.iobundle", "b.iobundle", "--rtol", "0", "--atol", "output=0.6")[0] == 0

    def test_report(self, workdir, capsys):
        code, _, _ = run(capsys, "diff", "a.iobundle", "b.iobundle", "--report", "diff.md")
        assert code == 1
        text = (workdir / "diff.md").read_text("utf-8")
        assert text.startswith("## iobundle diff\\: a\\.iobundle vs b\\.iobundle")  # Markdown-escaped
        assert text.count("**Bundle.**") == 2 and "| what differs |" in text

    def test_unreadable_bundle_exits_2(self, workdir, capsys):
        code, _, err = run(capsys, "diff", "a.iobundle", "missing.iobundle")
        assert code == 2 and err.startswith("error: ") and "missing.iobundle" in err


class TestRun:
    def test_same_model_passes(self, workdir, capsys):
        code, out, _ = run(capsys, "run", "a.iobundle", "--model", "factories:good")
        assert code == 0 and "PASS: 2/2 calls" in out and "re-run" in out

    def test_drifted_model_fails_with_html_report(self, workdir, capsys):
        code, out, _ = run(capsys, "run", "a.iobundle", "--model", "factories:drifted", "--report", "drift.html")
        assert code == 1 and "FAIL: 0/2 calls" in out
        html = (workdir / "drift.html").read_text("utf-8")
        assert "iobundle run (eager re-run): Scale" in html and html.count("<svg") == 3

    def test_needs_one_model_source(self, workdir, capsys):
        assert run(capsys, "run", "a.iobundle")[0] == 2
        code, _, err = run(capsys, "run", "a.iobundle", "--from-bundle")
        assert code == 2 and "include_model" in err

    def test_bad_device_is_a_usage_error(self, workdir, capsys):
        code, _, err = run(capsys, "run", "a.iobundle", "--model", "factories:good", "--device", "nosuchdevice")
        assert code == 2 and "--device nosuchdevice" in err


class TestRedacted:
    """A bundle redacted without its outputs: run and validate exit 4, diff compares structure and inputs only."""

    @pytest.fixture
    def redacted(self, workdir, capsys):
        assert main(["redact", "a.iobundle", "-o", "r.iobundle"]) == 0
        capsys.readouterr()
        return workdir

    def test_run_exits_4_nothing_to_compare(self, redacted, capsys):
        code, out, err = run(capsys, "run", "r.iobundle", "--model", "factories:good")
        assert code == 4 and "there is nothing to compare" in err and "FAIL" not in out

    def test_validate_exits_4_too(self, redacted, capsys):
        assert main(["export", "a.iobundle", "--model", "factories:good", "-o", "m.onnx"]) == 0
        code, _, err = run(capsys, "validate", "r.iobundle", "m.onnx")
        assert code == 4 and "there is nothing to compare" in err

    def test_diff_of_redacted_bundles_says_outputs_were_not_compared(self, redacted, capsys):
        code, out, _ = run(capsys, "diff", "r.iobundle", "r.iobundle", "--atol", "nosuchoutput=1")
        assert code == 0 and "outputs not compared: A and B hold no recorded outputs (redacted)" in out
        code, out, _ = run(capsys, "diff", "a.iobundle", "r.iobundle")
        assert "outputs not compared: B holds no recorded outputs" in out
        assert code == 1 and "input x: max abs difference" in out  # redacted inputs are synthetic


def test_cli_comparison_defaults_are_replays():
    """cli/_checks.py copies these (the CLI loads no torch for --help): the copies must stay equal."""
    import inspect

    from iobundle.cli import _checks
    from iobundle.replay import diff_bundles, rerun_model, validate_onnx
    from iobundle.replay.check._tolerances import ERROR_STATS

    assert _checks.ERROR_STATS == ERROR_STATS
    for function in (validate_onnx, rerun_model, diff_bundles):
        parameters = inspect.signature(function).parameters
        assert (parameters["atol"].default, parameters["rtol"].default) == (_checks.DEFAULT_ATOL, _checks.DEFAULT_RTOL)
