"""The public names of iobundle: ``__all__`` is honest, the documented names are there, one error root."""

from __future__ import annotations

import importlib
import inspect

import pytest

import iobundle
import iobundle.errors

PACKAGES = [
    "iobundle",
    "iobundle.errors",
    "iobundle.schema",
    "iobundle.calls",
    "iobundle.capture",
    "iobundle.replay",
    "iobundle.observer",
    "iobundle.cli",
]


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
