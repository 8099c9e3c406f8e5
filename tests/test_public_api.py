"""The public names of iobundle: ``__all__`` is honest, the documented names are there, one error root."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import iobundle
import iobundle.errors

# The public face, listed once: every name a user imports, by module. The API pages (docs/api/)
# document these modules; a name added to one of their ``__all__`` must be added here too.
ERRORS = [
    "AlignmentError", "ArchiveError", "BundleError", "BundleExistsError", "BundleNotFoundError", "BundleWriteError",
    "CLIError", "CaptureError", "DynamicShapeError", "ExportError", "InputSelectionError", "IntegrityError",
    "IobundleError", "ManifestError", "MissingDependencyError", "ModelLoadError", "NothingToCompareError",
    "ObserverArgumentError", "ObserverArgumentTypeError", "ObserverStateError", "ReplayError", "TensorFileError",
    "ToleranceError", "UnsafeBundleError", "UnsupportedFormatVersionError", "UnsupportedInputError",
]  # fmt: skip
PUBLIC = {
    "iobundle": [
        "Bundle", "InputCandidate", "InputObserver", "__version__", "load_bundle", "observe_modules", "redact_bundle",
        "upgrade_bundle", *ERRORS,
    ],
    "iobundle.errors": ERRORS,
    "iobundle.observer": [
        "InputCandidate", "InputObserver", "ModuleObservers", "ObservationInfo", "ObservationWarning", "observe_modules",
        "redact_bundle", "upgrade_bundle",
    ],
    "iobundle.capture": [
        "CallRecorder", "NodeType", "ObservationWarning", "RecordedCalls", "register_node_type", "save_recorded_calls",
        "transformers_pytree_nodes",
    ],
    "iobundle.replay": [
        "Bundle", "InputCandidate", "ObservationInfo", "ProgressEvent", "RecordedCallsAPI", "StaticDimHint",
        "StoredModel", "load_bundle", "load_bundle_model",
        "BatchCheck", "CallCheck", "ExportReport", "ExportResult", "Phase", "ProgramSet", "cut_call", "export_onnx",
        "export_program", "export_programs",
        "DiffReport", "ErrorStats", "OutputCheck", "Report", "Tolerances", "ValidationReport", "build_report",
        "check_discrepancies", "diff_bundles", "rerun_model", "validate_onnx",
    ],
    "iobundle.travel": [
        "ConvertResult", "PackResult", "convert_to_npz", "convert_to_onnx_testdata", "copy_model_files", "pack_bundle",
        "redact_calls", "unpack_bundle",
    ],
    "iobundle.cli": ["main"],
}  # fmt: skip
# The internal tier: packages whose ``__all__`` is the interface between iobundle's parts, not a public API.
INTERNAL = ["iobundle.calls", "iobundle.schema", "iobundle.replay.infer", "iobundle.replay.export",
            "iobundle.replay.check", "iobundle.demo"]  # fmt: skip
PACKAGES = [*PUBLIC, *INTERNAL]


def test_public_face_is_listed_and_small() -> None:
    """Each public module's ``__all__`` is its list above; together at most 100 names."""
    for name, listed in PUBLIC.items():
        assert sorted(importlib.import_module(name).__all__) == sorted(listed), f"{name}.__all__ differs from PUBLIC"
    assert len({n for names in PUBLIC.values() for n in names}) <= 100


def test_every_module_is_public_or_internal() -> None:
    """A new package (a name without an underscore) is either in the public face or in the internal tier."""
    found = {m.name for m in pkgutil.walk_packages(iobundle.__path__, "iobundle.")}
    unnamed = {m for m in found if not any(p.startswith("_") for p in m.split(".")[1:])}
    assert unnamed | {"iobundle"} == set(PACKAGES)


def test_api_pages_document_the_public_modules() -> None:
    pages = (Path(__file__).parents[1] / "docs" / "api").glob("*.md")
    documented = {m for page in pages for m in re.findall(r"^::: (\S+)$", page.read_text("utf-8"), re.M)}
    assert documented == set(PUBLIC) - {"iobundle", "iobundle.cli"}


@pytest.mark.parametrize("name", PACKAGES)
def test_all_names_resolve(name: str) -> None:
    module = importlib.import_module(name)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert missing == [], f"{name}.__all__ lists names it does not define: {missing}"
    assert len(set(module.__all__)) == len(module.__all__), f"{name}.__all__ has duplicates"


@pytest.mark.parametrize("name", ["InputObserver", "Bundle", "load_bundle", "IobundleError", "__version__"])
def test_documented_names_are_exported(name: str) -> None:
    assert name in iobundle.__all__
    assert getattr(iobundle, name) is not None


def test_lazy_names_are_the_real_objects() -> None:
    from iobundle.observer import InputObserver
    from iobundle.replay import Bundle, load_bundle

    assert iobundle.InputObserver is InputObserver
    assert iobundle.Bundle is Bundle
    assert iobundle.load_bundle is load_bundle


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        iobundle.no_such_name  # noqa: B018


def test_exported_errors_are_the_ones_of_iobundle_errors() -> None:
    for name in iobundle.__all__:
        value = getattr(iobundle, name)
        if inspect.isclass(value) and issubclass(value, BaseException):
            assert value is getattr(iobundle.errors, name)


def _error_classes() -> list[type]:
    return [
        cls
        for _, cls in inspect.getmembers(iobundle.errors, inspect.isclass)
        if cls.__module__ == iobundle.errors.__name__
    ]


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_every_error_subclasses_the_root(cls: type) -> None:
    assert issubclass(cls, iobundle.errors.IobundleError)
    assert cls.__name__.endswith("Error")
    assert cls.__name__ in iobundle.errors.__all__


def test_errors_all_lists_every_error_class() -> None:
    assert sorted(iobundle.errors.__all__) == sorted(c.__name__ for c in _error_classes())


def test_cli_main_is_the_console_script() -> None:
    from iobundle.cli import main

    assert callable(main)
    assert iobundle.cli.__all__ == ["main"]


def test_installed_version_is_the_package_version():
    # pyproject.toml reads the version from iobundle/_version.py: the metadata and __version__ cannot drift
    from importlib.metadata import version

    import iobundle

    assert version("iobundle") == iobundle.__version__
