"""Tests of the ``iobundle`` command: output, exit codes, the error funnel."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from iobundle import BundleNotFoundError, InputObserver, load_bundle
from iobundle.cli import main
from iobundle.replay import infer


class Model(torch.nn.Module):
    def forward(self, x, cache=None, flag=False):
        return x * 2


def _save(tmp_path_factory: pytest.TempPathFactory, name: str, calls: list[tuple[tuple, dict]]) -> Path:
    model, observer = Model(), InputObserver()
    with observer(model):
        for args, kwargs in calls:
            model(*args, **kwargs)
    path = tmp_path_factory.mktemp("bundles") / name
    observer.save(path)
    return path


@pytest.fixture(scope="module")
def flag_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two calls whose constants differ: inference fails, inspect must not."""
    calls = [((torch.randn(2, 3),), {}), ((torch.randn(2, 5),), {"cache": [torch.ones(2, 4)], "flag": True})]
    return _save(tmp_path_factory, "flag.iobundle", calls)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two aligned calls: x varies in dim 1, the cache (passed by keyword) never varies."""
    calls = [
        ((torch.randn(2, 3),), {"cache": [torch.ones(2, 4)]}),
        ((torch.randn(2, 5),), {"cache": [torch.ones(2, 4)]}),
    ]
    return _save(tmp_path_factory, "ok.iobundle", calls)


@pytest.fixture
def fresh_bundle(tmp_path_factory: pytest.TempPathFactory, own_files: None) -> Path:
    """A bundle a test may damage (each call's tensors in its own file)."""
    return _save(tmp_path_factory, "fresh.iobundle", [((torch.randn(2, 3),), {}), ((torch.randn(3, 3),), {})])


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------- inspect


class TestInspect:
    def test_lists_calls_shapes_constants_and_latency(self, capsys, flag_bundle):
        code, out, err = run(capsys, "inspect", flag_bundle)
        assert code == 0, err
        rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
        assert [r[:2] for r in rows] == [["0", "ok"], ["1", "ok"]]
        assert rows[0][3] == "ms" and float(rows[0][2]) >= 0
        call0, call1 = (line for line in out.splitlines() if line[:1].isdigit())
        assert "x=2x3 f32" in call0 and "cache" not in call0 and call0.rstrip().endswith("-")
        assert "x=2x5 f32, cache=[2x4 f32]" in call1 and "flag=True" in call1

    def test_shows_producer_and_the_inference_error(self, capsys, flag_bundle):
        code, out, _ = run(capsys, "inspect", flag_bundle)
        assert code == 0
        assert f"torch {torch.__version__}" in out
        assert "Model.forward(x, cache=None, flag=False)" in out
        shapes_section = out.split("dynamic shapes", 1)[1]
        assert "error: Calls" in shapes_section and "different constants" in shapes_section

    def test_shows_inferred_dynamic_shapes(self, capsys, bundle):
        code, out, _ = run(capsys, "inspect", bundle)
        assert code == 0
        assert "{'x': {1: Dim.DYNAMIC}, 'cache': [{}]}" in out.split("dynamic shapes", 1)[1]

    def test_nested_dict_is_summarised(self, capsys, tmp_path_factory):
        path = _save(tmp_path_factory, "dict.iobundle", [((torch.randn(2, 3),), {"cache": {"w": torch.ones(2, 3)}})])
        code, out, _ = run(capsys, "inspect", path)
        assert code == 0
        assert "cache={'w': 2x3 f32}" in out

    def test_reads_no_tensor_data(self, capsys, fresh_bundle):
        for file in (fresh_bundle / "calls").iterdir():  # same size, last data byte changed: only a hash sees it
            data = bytearray(file.read_bytes())
            data[-1] ^= 0xFF
            file.write_bytes(bytes(data))
        code, out, err = run(capsys, "inspect", fresh_bundle)
        assert code == 0, err
        assert "{0: Dim.DYNAMIC}" in out and "damaged" not in out
        assert run(capsys, "verify", fresh_bundle)[0] == 5

    def test_says_which_listed_files_are_missing_or_the_wrong_size(self, capsys, fresh_bundle):
        first, second = sorted((fresh_bundle / "calls").iterdir())
        first.unlink()
        second.write_bytes(second.read_bytes()[:-3])
        code, out, err = run(capsys, "inspect", fresh_bundle)
        assert code == 5, err
        assert "{0: Dim.DYNAMIC}" in out  # the rest of the report is still printed
        damaged = [line for line in out.splitlines() if line.startswith("damaged")]
        assert len(damaged) == 2
        assert f"{first.name}: missing" in damaged[0] and str(fresh_bundle) in damaged[0]
        assert f"{second.name}: " in damaged[1] and "truncated" in damaged[1]

    def test_failed_call_shows_its_error(self, capsys, tmp_path):
        class Failing(torch.nn.Module):
            def forward(self, x):
                if x.shape[0] == 3:
                    raise ValueError("no batch of 3")
                return x + 1

        model, observer = Failing(), InputObserver()
        with observer(model):
            model(torch.ones(2, 2))
            with pytest.raises(ValueError, match="no batch of 3"):
                model(torch.ones(3, 2))
        observer.save(tmp_path / "b")
        code, out, _ = run(capsys, "inspect", tmp_path / "b")
        assert code == 0
        assert "(1 ok, 1 failed)" in out
        assert "call 1 failed: ValueError: no batch of 3" in out

    def test_transformers_cache_is_summarised_by_layer(self, capsys, tmp_path):
        transformers = pytest.importorskip("transformers")

        class Decoder(torch.nn.Module):
            def forward(self, input_ids, past_key_values=None):
                return input_ids

        def cache(length: int):
            c = transformers.DynamicCache()
            for layer in range(3):
                c.update(torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8), layer)
            return c

        model, observer = Decoder(), InputObserver()
        with observer(model):
            model(torch.ones(1, 1, dtype=torch.int64), past_key_values=cache(5))
        observer.save(tmp_path / "b")
        code, out, _ = run(capsys, "inspect", tmp_path / "b")
        assert code == 0
        assert "past_key_values=DynamicCache[k:1x2x5x8 f32, v:1x2x5x8 f32, ... (3 layers)]" in out
        assert "input_ids=1x1 i64" in out

    def test_cache_children_are_labelled_by_their_layer_kinds(self):
        """The labels come from the layer kinds in the context: states of a linear-attention layer are not k/v."""
        from iobundle.cli._render import format_node
        from iobundle.schema import ObjectNode, TensorNode, load_manifest

        manifest = load_manifest(Path(__file__).parents[1] / "data" / "bundles" / "compact_nested")
        a, b = TensorNode(key="t1"), TensorNode(key="t2")  # 2x4 f32, 4 f32

        def node(name: str, context: object, items: list) -> ObjectNode:
            return ObjectNode(type=f"transformers.{name}", version=1, context=context, items=items)

        hybrid = node("DynamicCache", [{"linear": 1}, "full"], [a, b, a, a])
        static = node("StaticCache", [{"static": 8}, {"static": 8}], [a, a, b] * 2)
        indexed = node("DynamicCache", ["indexed"], [a, a, b, b])
        assert format_node(manifest, hybrid) == "DynamicCache[conv:2x4 f32, rec:4 f32, ... (2 layers)]"
        assert format_node(manifest, static) == "StaticCache[k:2x4 f32, v:2x4 f32, len:4 f32, ... (2 layers)]"
        assert format_node(manifest, indexed) == "DynamicCache[k:2x4 f32, v:2x4 f32, idx_k:4 f32, idx_pos:4 f32]"
        both = format_node(manifest, node("EncoderDecoderCache", None, [hybrid, static]))
        assert both.startswith("EncoderDecoderCache[self:DynamicCache[conv:") and ", cross:StaticCache[k:" in both
        malformed = node("DynamicCache", [{"linear": 0}], [a, b])  # not a cache's context: shown as any object
        assert format_node(manifest, malformed) == "DynamicCache[2x4 f32, 4 f32]"


# --------------------------------------------------------------------------- shapes


class TestShapes:
    def test_text_is_python_that_evaluates_to_the_library_result(self, capsys, bundle):
        code, out, _ = run(capsys, "shapes", bundle)
        assert code == 0
        assert out.strip() == "{'x': {1: Dim.DYNAMIC}, 'cache': [{}]}"
        assert eval(out, {"Dim": torch.export.Dim}) == load_bundle(bundle).infer_dynamic_shapes()

    def test_json(self, capsys, bundle):
        code, out, _ = run(capsys, "shapes", bundle, "--json")
        assert code == 0
        assert json.loads(out) == {"x": {"1": "DYNAMIC"}, "cache": [{}]}

    def test_json_with_dim_names(self, capsys, bundle):
        code, out, _ = run(capsys, "shapes", bundle, "--json", "--dim-names")
        assert code == 0
        shapes = json.loads(out)
        assert isinstance(shapes["x"]["1"], str) and shapes["x"]["1"].startswith("x_")

    def test_dim_names_print_the_library_names_shared_by_equal_batches(self, capsys, bundle):
        code, out, _ = run(capsys, "shapes", bundle, "--batch-all", "--dim-names")
        assert code == 0
        assert out.splitlines()[0] == "{'x': {0: 'x_dim_0', 1: 'x_dim_1'}, 'cache': [{0: 'x_dim_0'}]}"
        expected = load_bundle(bundle).infer_dynamic_shapes(set_batch_dimension_for=True, dim_names=True)
        assert eval(out) == expected

    @pytest.mark.parametrize(
        ("batch", "expected"),
        [
            (["--batch", "cache"], {"x": {"1": "DYNAMIC"}, "cache": [{"0": "DYNAMIC"}]}),
            # cache was passed by keyword: its position still selects it
            (["--batch", "1"], {"x": {"1": "DYNAMIC"}, "cache": [{"0": "DYNAMIC"}]}),
            (["--batch", "0"], {"x": {"0": "DYNAMIC", "1": "DYNAMIC"}, "cache": [{}]}),
            (
                ["--batch", "x", "--batch", "cache"],
                {"x": {"0": "DYNAMIC", "1": "DYNAMIC"}, "cache": [{"0": "DYNAMIC"}]},
            ),
            (["--batch", "0,cache"], {"x": {"0": "DYNAMIC", "1": "DYNAMIC"}, "cache": [{"0": "DYNAMIC"}]}),
            (["--batch-all"], {"x": {"0": "DYNAMIC", "1": "DYNAMIC"}, "cache": [{"0": "DYNAMIC"}]}),
        ],
    )
    def test_batch_by_name_or_position(self, capsys, bundle, batch, expected):
        code, out, err = run(capsys, "shapes", bundle, "--json", *batch)
        assert code == 0, err
        shapes = json.loads(out)
        shapes.pop("$batch_axes")
        assert shapes == expected

    def test_batch_axes_taken_and_why_in_text_and_json(self, capsys, bundle):
        code, out, _ = run(capsys, "shapes", bundle, "--batch-all")
        assert code == 0
        comments = [line for line in out.splitlines() if line.startswith("#")]
        assert comments[1:] == [
            "#   x: axis 0: the reference: its leading size is the batch (2)",
            "#   cache: axis 0: the only axis of the batch's size in every call",
        ]
        code, out, _ = run(capsys, "shapes", bundle, "--json", "--batch", "cache")
        assert code == 0
        assert json.loads(out)["$batch_axes"] == [
            {"input": "cache", "tensors": [0], "axis": 0, "reason": "the only axis of the batch's size in every call"}
        ]

    def test_no_batch_axes_without_a_batch_flag(self, capsys, bundle):
        code, out, _ = run(capsys, "shapes", bundle, "--json")
        assert code == 0
        assert "$batch_axes" not in json.loads(out)

    @pytest.mark.parametrize(
        ("batch", "message"),
        [
            (["--batch", "nope"], "--batch nope: not an input of forward()"),
            (["--batch", "7"], "--batch 7: forward() has 3 positional parameters"),
            (["--batch", "x", "--batch-all"], "Cannot use both --batch and --batch-all"),
        ],
    )
    def test_bad_batch_is_a_usage_error(self, capsys, bundle, batch, message):
        code, out, err = run(capsys, "shapes", bundle, *batch)
        assert code == 2
        assert out == ""
        assert err.splitlines()[0].startswith(f"error: {message}")
        assert "Traceback" not in err

    def test_calls_that_cannot_be_aligned_exit_3(self, capsys, flag_bundle):
        code, out, err = run(capsys, "shapes", flag_bundle)
        assert code == 3
        assert out == ""
        assert err.startswith("error: Calls") and "different constants" in err
        assert "hint: `iobundle inspect BUNDLE` shows the recorded calls" in err and "IOBUNDLE_DEBUG=1" in err


# --------------------------------------------------------------------------- keyword groups


class ImageModel(torch.nn.Module):
    """A cross-attention VLM's calls: the prefill passes ``pixel_values``, the decode steps the image states instead."""

    def forward(self, input_ids, pixel_values=None, image_states=None):
        return input_ids * 2


@pytest.fixture(scope="module")
def group_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, observer = ImageModel(), InputObserver()
    with observer(model):
        model(torch.ones(2, 5), pixel_values=torch.ones(2, 3, 8, 8))
        for n in (6, 7):
            model(torch.ones(2, n), image_states=torch.ones(2, 4, 16))
    path = tmp_path_factory.mktemp("bundles") / "groups.iobundle"
    observer.save(path)
    return path


GROUPS_TEXT = """\
# call 0: passes pixel_values; not image_states (only other calls pass it)
{'input_ids': {}, 'pixel_values': {}}
# calls 1-2: pass image_states; not pixel_values (only other calls pass it)
{'input_ids': {1: Dim.DYNAMIC}, 'image_states': {}}"""


class TestKeywordGroups:
    """Calls passing different keyword names (none passing them all) have their shapes shown group by group."""

    def test_inspect_shows_the_shapes_of_each_group(self, capsys, group_bundle):
        code, out, _ = run(capsys, "inspect", group_bundle)
        assert code == 0
        section = out.split("\ndynamic shapes", 1)[1]
        assert section.startswith(" per keyword group (no call passes every keyword name the others pass")
        assert "error" not in section
        assert section.splitlines()[1:] == ["  " + line for line in GROUPS_TEXT.splitlines()]

    def test_shapes_text_names_the_calls_and_keywords_of_each_group(self, capsys, group_bundle):
        code, out, err = run(capsys, "shapes", group_bundle)
        assert code == 0, err
        header, *rest = out.strip().splitlines()
        assert header.startswith("# dynamic shapes per keyword group: no call passes every keyword name")
        assert "\n".join(rest) == GROUPS_TEXT
        groups = load_bundle(group_bundle).infer_group_shapes()
        texts = [line for line in rest if not line.startswith("#")]
        assert [eval(t, {"Dim": torch.export.Dim}) for t in texts] == [
            infer.to_torch_dims(g.dynamic_shapes) for g in groups
        ]

    def test_shapes_json_and_batch_axes_per_group(self, capsys, group_bundle):
        code, out, _ = run(capsys, "shapes", group_bundle, "--json", "--batch-all")
        assert code == 0
        value = json.loads(out)
        assert value["reason"].startswith("no call passes every keyword name")
        assert [(g["calls"], g["keywords"], g["absent"]) for g in value["$groups"]] == [
            ([0], ["pixel_values"], ["image_states"]),
            ([1, 2], ["image_states"], ["pixel_values"]),
        ]
        assert value["$groups"][1]["dynamic_shapes"] == {"input_ids": {"0": "DYNAMIC", "1": "DYNAMIC"},
                                                         "image_states": {"0": "DYNAMIC"}}  # fmt: skip
        assert [a["input"] for a in value["$groups"][0]["batch_axes"]] == ["input_ids", "pixel_values"]

    def test_a_batch_input_of_another_group_is_left_out_of_a_group(self, capsys, group_bundle):
        code, out, _ = run(capsys, "shapes", group_bundle, "--json", "--batch", "pixel_values")
        assert code == 0
        first, second = json.loads(out)["$groups"]
        assert first["dynamic_shapes"]["pixel_values"] == {"0": "DYNAMIC"}
        assert second["batch_axes"] == [] and second["dynamic_shapes"]["image_states"] == {}

    def test_a_plain_bundle_has_no_groups_and_its_outputs_are_unchanged(self, capsys, bundle):
        assert load_bundle(bundle).infer_group_shapes() == []
        code, out, _ = run(capsys, "inspect", bundle)
        assert code == 0 and "keyword group" not in out
        assert out.split("\n\ndynamic shapes", 1)[1].splitlines() == [
            " (inferred from the calls; Dim.DYNAMIC where sizes differ)",
            "  {'x': {1: Dim.DYNAMIC}, 'cache': [{}]}",
        ]
        code, out, _ = run(capsys, "shapes", bundle, "--json")
        assert code == 0 and json.loads(out) == {"x": {"1": "DYNAMIC"}, "cache": [{}]}


# --------------------------------------------------------------------------- verify


class TestVerify:
    def test_good_bundle(self, capsys, fresh_bundle):
        code, out, _ = run(capsys, "verify", fresh_bundle)
        assert code == 0
        assert out.startswith("OK: 2 files")

    def test_quiet_good_bundle_prints_the_verdict_only(self, capsys, fresh_bundle):
        code, out, err = run(capsys, "verify", "-q", fresh_bundle)
        assert (code, out.splitlines(), err) == (0, ["OK: 2 files, 440 B, sizes and hashes match the manifest"], "")

    def test_flipped_byte_names_the_file(self, capsys, fresh_bundle):
        target = fresh_bundle / "calls" / "000001.safetensors"
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
        code, out, _ = run(capsys, "verify", fresh_bundle)
        assert code == 5
        lines = out.splitlines()
        assert len(lines) == 2
        assert lines[0].startswith(f"{fresh_bundle}: calls/000001.safetensors: xxh3-128")
        assert lines[1] == "DAMAGED: 1 of 2 files differ from the manifest"

    def test_missing_file_is_a_failed_check(self, capsys, fresh_bundle):
        (fresh_bundle / "calls" / "000000.safetensors").unlink()
        code, out, _ = run(capsys, "verify", fresh_bundle)
        assert code == 5
        assert out.splitlines()[0] == f"{fresh_bundle}: calls/000000.safetensors: missing from the bundle."

    @pytest.mark.parametrize("command", ["verify", "inspect"])
    def test_a_killed_writers_leftover_is_a_warning_line_not_a_failure(self, capsys, fresh_bundle, command):
        (fresh_bundle / "calls" / ".000002.safetensors.tmp").write_bytes(b"half a file")
        code, out, err = run(capsys, command, fresh_bundle)
        assert code == 0
        assert out.startswith("OK: 2 files") if command == "verify" else "damaged" not in out
        warnings = [line for line in err.splitlines() if line.startswith("WARNING")]
        assert len(warnings) == 1, err
        assert f"{fresh_bundle / 'calls' / '.000002.safetensors.tmp'}: not listed by the manifest" in warnings[0]
        assert "--overwrite" in warnings[0]

    def test_unreadable_manifest_exits_5(self, capsys, fresh_bundle):
        (fresh_bundle / "manifest.json").write_text("{not json", encoding="utf-8")
        code, out, err = run(capsys, "verify", fresh_bundle)
        assert code == 5
        assert out == ""
        assert err.startswith("error: ") and "manifest.json" in err


# --------------------------------------------------------------------------- errors, usage, help


class TestErrors:
    @pytest.mark.parametrize("command", ["inspect", "shapes", "verify"])
    def test_missing_bundle_is_one_line_and_a_hint(self, capsys, tmp_path, command):
        code, out, err = run(capsys, command, tmp_path / "nope")
        assert code == 2
        assert out == ""
        lines = err.splitlines()
        assert len(lines) == 2
        assert lines[0].startswith("error: ") and "nope" in lines[0]
        assert lines[1].startswith("hint: check the path") and lines[1].endswith(
            "(IOBUNDLE_DEBUG=1 shows the full traceback)"
        )

    def test_directory_without_manifest(self, capsys, tmp_path):
        code, _, err = run(capsys, "inspect", tmp_path)
        assert code == 2
        assert "No manifest.json" in err

    def test_python_m_prints_no_traceback(self, tmp_path):
        env = {k: v for k, v in os.environ.items() if k != "IOBUNDLE_DEBUG"}
        proc = subprocess.run(
            [sys.executable, "-m", "iobundle", "inspect", "/nonexistent"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
        assert proc.returncode == 2
        assert "Traceback" not in proc.stderr
        assert proc.stderr.startswith("error: '/nonexistent'")
        assert proc.stdout == ""

    def test_debug_env_reraises(self, capsys, monkeypatch, tmp_path):
        monkeypatch.setenv("IOBUNDLE_DEBUG", "1")
        with pytest.raises(BundleNotFoundError):
            main(["inspect", str(tmp_path / "nope")])
        assert capsys.readouterr().err.startswith("error: ")

    def test_debug_env_zero_means_off(self, capsys, monkeypatch, tmp_path):
        monkeypatch.setenv("IOBUNDLE_DEBUG", "0")
        assert main(["inspect", str(tmp_path / "nope")]) == 2

    @pytest.mark.parametrize("argv", [[], ["frobnicate"], ["inspect"], ["shapes", "b", "--no-such-flag"]])
    def test_argparse_usage_errors_exit_2(self, capsys, argv):
        assert main(argv) == 2
        assert "usage: iobundle" in capsys.readouterr().err


class TestHelp:
    def test_top_level_help_documents_commands_and_exit_codes(self, capsys):
        code, out, _ = run(capsys, "--help")
        assert code == 0
        for word in (
            "inspect",
            "shapes",
            "verify",
            "examples:",
            "exit codes (the same in every command):",
            "IOBUNDLE_DEBUG",
        ):
            assert word in out
        assert "  1    a check failed" in out and "  2    usage error" in out and "  5    the bundle is damaged" in out

    @pytest.mark.parametrize("command", ["inspect", "shapes", "verify"])
    def test_each_command_has_examples(self, capsys, command):
        code, out, _ = run(capsys, command, "--help")
        assert code == 0
        assert "examples:" in out and f"iobundle {command} run.iobundle" in out

    def test_version(self, capsys):
        from iobundle import __version__

        code, out, _ = run(capsys, "--version")
        assert code == 0 and out.strip() == f"iobundle {__version__}"

    @pytest.mark.parametrize("argv", [["-v", "verify"], ["verify", "-vv"], ["-q", "verify"]])
    def test_logging_flags_anywhere(self, capsys, fresh_bundle, argv):
        package_logger = logging.getLogger("iobundle")
        before = (package_logger.level, list(package_logger.handlers))
        assert main([*argv, str(fresh_bundle)]) == 0
        assert (package_logger.level, package_logger.handlers) == before  # main() leaves logging as it found it

    def test_verbose_shows_debug_messages_on_stderr(self, capsys, fresh_bundle):
        code, _, err = run(capsys, "-vv", "verify", fresh_bundle)
        assert code == 0
        assert f"DEBUG iobundle.cli._programs: opening {fresh_bundle}" in err


# --- a bundle that stores its model -----------------------------------------------------------


def _plant_in_config(path: Path, key: str, value: object) -> None:
    import hashlib

    config_path = path / "model" / "config.json"
    config = json.loads(config_path.read_text("utf-8"))
    config[key] = value
    data = json.dumps(config).encode()
    config_path.write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text("utf-8"))
    manifest["model"]["files"]["model/config.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest), "utf-8")


def test_inspect_shows_the_stored_model(capsys, model_bundle):
    code, out, _ = run(capsys, "inspect", model_bundle)
    assert code == 0
    weights = (model_bundle / "model" / "weights.safetensors").stat().st_size
    model_line = next(line for line in out.splitlines() if line.startswith("model "))
    assert "GPTNeoXForCausalLM (model_type gpt_neox, attention sdpa)" in model_line
    assert f"weights {weights / 1024:.1f} KiB" in model_line
    assert "its config selects no code (--from-bundle also checks the class)" in out


def test_inspect_says_why_from_bundle_would_refuse(capsys, model_bundle, tmp_path):
    import shutil

    path = Path(shutil.copytree(model_bundle, tmp_path / "hostile.iobundle"))
    _plant_in_config(path, "auto_map", {"AutoModelForCausalLM": "evil_modeling.Evil"})
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0  # inspecting never builds the model
    assert "refused by --from-bundle: model/config.json: auto_map = " in out
    assert "evil_modeling" not in sys.modules


def test_inspect_of_a_bundle_without_model_has_no_model_line(capsys, bundle):
    code, out, _ = run(capsys, "inspect", bundle)
    assert code == 0
    assert not [line for line in out.splitlines() if line.startswith("model ")]


def test_export_from_bundle_refuses_a_config_that_selects_code(capsys, model_bundle, tmp_path):
    import shutil

    path = Path(shutil.copytree(model_bundle, tmp_path / "hostile.iobundle"))
    _plant_in_config(path, "attn_implementation", "kernels-community/flash-attn2")
    code, _, err = run(capsys, "export", path, "--from-bundle", "-o", tmp_path / "model.onnx")
    assert code == 5  # an unsafe bundle
    first = err.splitlines()[0]
    assert first.startswith("error: model/config.json: attn_implementation = 'kernels-community/flash-attn2'")
    assert "--model MODULE:FACTORY" in first
    assert not (tmp_path / "model.onnx").exists()
    assert "kernels" not in sys.modules
