"""One program per phase: partition by input structure, export, the program index, validation through it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.errors import ExportError, ManifestError, UnsafeBundleError
from iobundle.replay import partition_calls
from iobundle.schema import load_program_index, sizes_match

pytest.importorskip("onnxruntime")


class Memory(torch.nn.Module):
    """A first call without ``memory`` takes another branch than the later calls with it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        if memory is None:
            return self.lin(x) * 2.0 + 1.0
        return self.lin(x) + memory.mean(dim=1, keepdim=True)


@pytest.fixture
def bundle(tmp_path):
    model = Memory().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
        model(torch.randn(2, 4), memory=torch.randn(2, 3))
        model(torch.randn(2, 4), memory=torch.randn(2, 5))
    observer.save(tmp_path / "memory.iobundle")
    return load_bundle(tmp_path / "memory.iobundle")


def test_partition_by_structure(bundle):
    phases = partition_calls(bundle._recorded())
    assert [(p.name, p.calls) for p in phases] == [("p0", (0,)), ("p1", (1, 2))]
    assert phases[0].inputs == {"x": "present", "memory": "absent"}
    assert phases[1].describe() == "every input present"


def test_one_program_leaves_the_first_call_unchecked(bundle):
    # The stand-in for the absent memory (zeros) sends call 0 down the other branch: it differs,
    # and a call fed a stand-in is not a numeric mismatch, so one program "passes" unchecked.
    result = bundle.export_programs(Memory().eval(), programs="one")
    assert len(result.programs) == 1
    assert [c.success for c in result.report.calls] == [None, True, True]


def test_auto_exports_one_program_per_phase_and_checks_every_call(bundle, tmp_path):
    result = bundle.export_programs(Memory().eval())
    assert [p.phase.calls for p in result.programs] == [(0,), (1, 2)]
    assert "unchecked" in result.reason
    assert [c.success for c in result.report.calls] == [True, True, True]
    assert bundle.export_report().calls == result.report.calls
    index_path = result.to_onnx(tmp_path / "out" / "memory.onnx")
    assert index_path.endswith("memory.programs.json")
    index = load_program_index(index_path)
    assert [(p.name, p.file, p.calls) for p in index.programs] == [
        ("p0", "memory.p0.onnx", [0]),
        ("p1", "memory.p1.onnx", [1, 2]),
    ]
    rows = bundle.check_discrepancies(index_path)
    assert [(r["index"], r["program"], r["SUCCESS"]) for r in rows] == [
        (0, "p0", True),
        (1, "p1", True),
        (2, "p1", True),
    ]


def test_one_program_stays_the_default_when_it_serves_every_call(tmp_path):
    model = torch.nn.Linear(4, 2).eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
        model(torch.randn(3, 4))
    observer.save(tmp_path / "b")
    result = load_bundle(tmp_path / "b").export_programs(model)
    assert len(result.programs) == 1 and result.reason == ""
    assert result.to_onnx(tmp_path / "m.onnx") == str(tmp_path / "m.onnx")


def test_per_phase_failure_names_the_phase(bundle):
    class Broken(Memory):
        def forward(self, x, memory=None):
            if memory is None:
                return super().forward(x) + 1.0  # differs from the recording
            return super().forward(x, memory)

    with pytest.raises(ExportError, match=r"Program p0 \(calls \[0\], memory absent\)"):
        bundle.export_programs(Broken().eval(), programs="per-phase")
    with pytest.raises(ExportError, match="programs='some'"):
        bundle.export_programs(Memory().eval(), programs="some")  # type: ignore[arg-type]


def _index(tmp_path, **program):
    entry = {"name": "p0", "file": "m.onnx", "calls": [0], "traced_call": 0, "inputs": {"x": "present"}, **program}
    path = tmp_path / "m.programs.json"
    path.write_text(json.dumps({"format": "iobundle.programs", "format_version": 1, "programs": [entry]}))
    return path


@pytest.mark.parametrize("name", ["../m.onnx", "/tmp/m.onnx", "a\\m.onnx", "C:m.onnx", "m\x1b[2J.onnx", "m\n.onnx"])
def test_index_refuses_files_outside_its_directory(tmp_path, name):
    with pytest.raises(UnsafeBundleError, match="relative path inside"):
        load_program_index(_index(tmp_path, file=name))


def test_index_errors_name_the_file_and_field(tmp_path):
    path = tmp_path / "x.programs.json"
    path.write_text('{"format": "other"}')
    with pytest.raises(ManifestError, match="not a program index"):
        load_program_index(path)
    with pytest.raises(ManifestError, match=r"programs\.0\.calls"):
        load_program_index(_index(tmp_path, calls="all"))
    with pytest.raises(ManifestError, match="cannot read"):
        load_program_index(tmp_path / "missing.programs.json")


def test_validate_reports_calls_no_program_serves(bundle, tmp_path):
    result = bundle.export_programs(Memory().eval())
    index_path = result.to_onnx(tmp_path / "memory.onnx")
    data = json.loads(Path(index_path).read_text())
    data["programs"] = data["programs"][1:]  # only the program for calls with memory
    Path(index_path).write_text(json.dumps(data))
    rows = bundle.check_discrepancies(index_path)
    assert rows[0]["SUCCESS"] is False and "no program of memory.programs.json serves call 0" in rows[0]["error"]
    assert [r["SUCCESS"] for r in rows[1:]] == [True, True]


def _write_index(path, *programs):
    path.write_text(json.dumps({"format": "iobundle.programs", "format_version": 1, "programs": list(programs)}))
    return path


def _entry(name="p0", file="m.onnx", calls=(0,), traced_call=0):
    return {"name": name, "file": file, "calls": list(calls), "traced_call": traced_call, "inputs": {"x": "present"}}


def test_index_naming_itself_is_refused(tmp_path, bundle):
    path = _write_index(tmp_path / "self.programs.json", _entry(file="self.programs.json"))
    with pytest.raises(ManifestError, match=r"self\.programs\.json: programs\[0\]\.file: .* not an ONNX file"):
        load_program_index(path)
    with pytest.raises(ManifestError, match="never another index"):
        bundle.check_discrepancies(path)


def test_two_indexes_naming_each_other_are_refused(tmp_path, bundle):
    a = _write_index(tmp_path / "a.programs.json", _entry(file="b.programs.json"))
    _write_index(tmp_path / "b.programs.json", _entry(file="a.programs.json"))
    with pytest.raises(ManifestError, match=r"a\.programs\.json: programs\[0\]\.file"):
        bundle.check_discrepancies(a)


def test_duplicate_program_names_are_refused(tmp_path, bundle):
    result = bundle.export_programs(Memory().eval())
    index_path = Path(result.to_onnx(tmp_path / "memory.onnx"))
    data = json.loads(index_path.read_text())
    data["programs"][1]["name"] = "p0"
    index_path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"programs\[1\]\.name: 'p0' names two programs"):
        bundle.check_discrepancies(index_path)


@pytest.mark.parametrize(
    ("programs", "match"),
    [
        ([_entry(calls=(-1,))], r"programs\[0\]\.calls: -1 is negative"),
        ([_entry(traced_call=-2)], r"programs\[0\]\.traced_call: -2 is negative"),
        ([_entry(calls=(0, 0))], r"programs\[0\]\.calls: call 0 is listed twice"),
        ([_entry(), _entry(name="p1", file="n.onnx", calls=(1, 0))], r"programs\[1\]\.calls: call 0 .*'p0'"),
    ],
)
def test_negative_and_repeated_call_numbers_are_refused(tmp_path, programs, match):
    with pytest.raises(ManifestError, match=match):
        load_program_index(_write_index(tmp_path / "m.programs.json", *programs))


def test_writing_an_index_checks_the_same_rules(tmp_path):
    from iobundle.schema import ProgramEntry, ProgramIndex, write_program_index

    entry = ProgramEntry.model_validate(_entry())
    with pytest.raises(ManifestError, match=r"programs\[1\]\.name"):
        write_program_index(ProgramIndex(programs=[entry, entry]), tmp_path / "m.programs.json")
    assert not (tmp_path / "m.programs.json").exists()


class ImageStates(torch.nn.Module):
    """The first call computes states from ``image`` and returns them; the later calls pass them back as ``states``.

    As Idefics' prefill takes ``pixel_values`` and its decode calls ``image_encoder_embeddings``: no call
    passes both keywords.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vision = torch.nn.Linear(6, 4)
        self.lin = torch.nn.Linear(4, 4)

    def forward(
        self, x: torch.Tensor, image: torch.Tensor | None = None, states: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if image is not None:
            states = self.vision(image)
        assert states is not None
        return self.lin(x) + states.mean(dim=1), states


def test_calls_passing_different_keywords_are_phases_of_their_own(tmp_path):
    model = ImageStates().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        _, states = model(torch.randn(2, 4), image=torch.randn(2, 3, 6))
        for _ in range(2):
            model(torch.randn(2, 4), states=states)
    observer.save(tmp_path / "states.iobundle")
    bundle = load_bundle(tmp_path / "states.iobundle")
    phases = partition_calls(bundle._recorded())
    assert [(p.calls, p.inputs) for p in phases] == [
        ((0,), {"x": "present", "image": "present", "states": "absent"}),
        ((1, 2), {"x": "present", "states": "present", "image": "absent"}),
    ]
    groups = bundle.infer_group_shapes()  # what inspect and shapes show: one set of shapes per phase
    assert [(g.group.calls, g.group.distinct, g.group.absent) for g in groups] == [
        ((0,), ("image",), ("states",)),
        ((1, 2), ("states",), ("image",)),
    ]
    assert [g.dynamic_shapes for g in groups] == [{"x": {}, "image": {}}, {"x": {}, "states": {}}]
    result = bundle.export_programs(model)
    assert "one program: Call 1 passes keyword argument(s) ['states']" in result.reason
    assert [c.success for c in result.report.calls] == [True, True, True]
    index_path = result.to_onnx(tmp_path / "states.onnx")
    rows = bundle.check_discrepancies(index_path)
    assert [(r["index"], r["program"], r["SUCCESS"]) for r in rows] == [
        (0, "p0", True),
        (1, "p1", True),
        (2, "p1", True),
    ]


def test_a_version_1_index_still_validates(bundle, tmp_path):
    index_path = Path(bundle.export_programs(Memory().eval()).to_onnx(tmp_path / "memory.onnx"))
    data = json.loads(index_path.read_text())
    assert data["format_version"] == 2 and all(p["sizes"] == [] for p in data["programs"])
    data["format_version"] = 1
    for program in data["programs"]:
        del program["sizes"]  # what version 1 wrote
    index_path.write_text(json.dumps(data))
    assert load_program_index(index_path).format_version == 1
    rows = bundle.check_discrepancies(index_path)
    assert [(r["index"], r["program"], r["SUCCESS"]) for r in rows] == [
        (0, "p0", True),
        (1, "p1", True),
        (2, "p1", True),
    ]


def _sized(sizes, version=2):
    return {"format": "iobundle.programs", "format_version": version, "programs": [{**_entry(), "sizes": sizes}]}


@pytest.mark.parametrize(
    ("index", "match"),
    [
        (_sized([{"of": [["x", 0]], "op": "=~", "value": 1}]), r"programs\.0\.sizes\.0\.op"),
        (_sized([{"of": [], "op": "==", "value": 1}]), r"programs\.0\.sizes\.0\.of"),
        (_sized([{"of": [["x", "0"]], "op": "==", "value": 1}]), r"programs\.0\.sizes\.0\.of\.0\.1"),
        (_sized([{"of": [["x", 0]], "op": "==", "value": "1"}]), r"programs\.0\.sizes\.0\.value"),
        (_sized([{"of": [["x", 0]], "op": "==", "value": 1, "code": "import os"}]), r"programs\.0\.sizes\.0\.code"),
        (_sized([{"of": [["x", -1]], "op": "==", "value": 1}]), r"programs\[0\]\.sizes\[0\]: axis -1 of 'x'"),
        (_sized([{"of": [["x", 0]], "op": "==", "value": 1}], version=1), r"programs\[0\]\.sizes: a format_version 1"),
        (
            _sized([{"of": [["c", 2, -1]], "op": "==", "value": 1}]),
            r"programs\[0\]\.sizes\[0\]: axis 2 of 'c' \(tensor -1\)",
        ),
        (_sized([{"of": [["c", 2, 0, 1]], "op": "==", "value": 1}]), r"programs\.0\.sizes\.0\.of\.0"),
    ],
)
def test_a_malformed_size_rule_is_refused_naming_the_field(tmp_path, index, match):
    path = tmp_path / "m.programs.json"
    path.write_text(json.dumps(index))
    with pytest.raises(ManifestError, match=match):
        load_program_index(path)


def test_a_size_rule_names_a_tensor_inside_an_input(tmp_path):
    path = tmp_path / "m.programs.json"
    path.write_text(json.dumps(_sized([{"of": [["cache", 2, 1], ["x", 0]], "op": ">=", "value": 6}])))
    program = load_program_index(path).programs[0]
    assert program.describe_sizes() == "axis 2 of cache (tensor 1) * axis 0 of x >= 6"
    shapes = {("cache", 0): (2, 2, 9), ("cache", 1): (2, 2, 3), ("x", 0): (2, 5)}

    def size(name, axis, item):
        shape = shapes.get((name, item or 0))
        return shape[axis] if shape is not None else None

    assert sizes_match(program, size)  # 3 (the second tensor of the cache, not the first's 9) * 2
    shapes[("cache", 1)] = (2, 2, 2)
    assert not sizes_match(program, size)
    del shapes[("cache", 1)]
    assert not sizes_match(program, size)  # a tensor the call lacks meets no rule
