"""The one reader of a stored model config (``iobundle.calls.read_stored_config``) and its limits."""

from __future__ import annotations

import hashlib
import math

import pytest

from iobundle._store import LocalStore
from iobundle.calls import read_stored_config
from iobundle.calls._config import MAX_CONFIG_BYTES
from iobundle.errors import IntegrityError, ModelLoadError, UnsafeBundleError
from iobundle.schema import FileEntry, ModelEntry


def _stored(tmp_path, data: bytes, *, size: int | None = None) -> ModelEntry:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_bytes(data)
    weights = FileEntry(size=0, sha256=hashlib.sha256(b"").hexdigest())
    config = FileEntry(size=len(data) if size is None else size, sha256=hashlib.sha256(data).hexdigest())
    return ModelEntry(
        class_name="LlamaForCausalLM", files={"model/config.json": config, "model/weights.safetensors": weights}
    )


def test_a_stored_config_is_read_as_its_json_object(tmp_path):
    entry = _stored(tmp_path, b'{"model_type": "llama", "vocab_size": 50}')
    assert read_stored_config(LocalStore(tmp_path), entry) == {"model_type": "llama", "vocab_size": 50}


def test_a_config_nested_too_deeply_is_refused_not_a_recursion_crash(tmp_path):
    entry = _stored(tmp_path, b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(UnsafeBundleError, match="nested too deeply"):
        read_stored_config(LocalStore(tmp_path), entry)


def test_a_config_listed_over_the_size_limit_is_refused_before_it_is_read(tmp_path):
    entry = _stored(tmp_path, b"{}", size=MAX_CONFIG_BYTES + 1)
    with pytest.raises(UnsafeBundleError, match="over the limit"):
        read_stored_config(LocalStore(tmp_path), entry)


def test_a_config_whose_bytes_differ_from_the_manifest_is_refused(tmp_path):
    entry = _stored(tmp_path, b'{"vocab_size": 50}')
    (tmp_path / "model" / "config.json").write_bytes(b'{"vocab_size": 99}')
    with pytest.raises(IntegrityError):
        read_stored_config(LocalStore(tmp_path), entry)


@pytest.mark.parametrize(("data", "match"), [(b"not json", "not a JSON config"), (b"[1, 2]", "a JSON object")])
def test_a_config_that_is_not_a_json_object_says_so(tmp_path, data, match):
    with pytest.raises(ModelLoadError, match=match):
        read_stored_config(LocalStore(tmp_path), _stored(tmp_path, data))


def test_non_finite_floats_read_back_as_python_floats(tmp_path):
    entry = _stored(tmp_path, b'{"time_step_limit": [0.0, Infinity], "low": -Infinity, "eps": NaN}')
    config = read_stored_config(LocalStore(tmp_path), entry)
    assert config["time_step_limit"] == [0.0, float("inf")] and config["low"] == float("-inf")
    assert isinstance(config["eps"], float) and math.isnan(config["eps"])


@pytest.mark.parametrize("token", [b"infinity", b"inf", b"nan", b"+Infinity"])
def test_other_spellings_of_a_non_finite_float_are_not_json(tmp_path, token):
    with pytest.raises(ModelLoadError, match="not a JSON config"):
        read_stored_config(LocalStore(tmp_path), _stored(tmp_path, b'{"x": ' + token + b"}"))
