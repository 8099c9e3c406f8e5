"""A branch of the model's code on a size that splits the recorded calls: one program per side of the rule."""

from __future__ import annotations

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.errors import ExportError
from iobundle.replay.export._dims import split_rule

LENGTHS = (2, 4, 6, 3, 5)  # 2 and 3 below the branch, 4, 6 and 5 above it


class LongPath(torch.nn.Module):
    """Other math from 4 tokens on: ``if x.shape[1] + 1 >= 5``, the way a cache moves its residual."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] + 1 >= 5:
            return (x * 2).cumsum(dim=1)
        return x - x.mean(dim=1, keepdim=True)


@pytest.fixture
def recorded(tmp_path):
    model = LongPath().eval()
    observer = InputObserver()
    torch.manual_seed(0)
    with torch.no_grad(), observer(model, store_n_calls=len(LENGTHS)):
        for length in LENGTHS:
            model(torch.randn(2, length, 3))
    observer.save(tmp_path / "long.iobundle")
    return model, load_bundle(tmp_path / "long.iobundle")


def test_recorded_calls_on_both_sides_of_a_size_branch_get_one_program_each(recorded, tmp_path):
    model, bundle = recorded
    result = bundle.export_programs(model)
    assert [(p.phase.name, p.phase.calls, p.split_of) for p in result.programs] == [
        ("p0", (0, 3), None),
        ("p1", (1, 2, 4), "p0"),
    ]
    rules = [[c.model_dump(mode="json") for c in p.sizes] for p in result.programs]
    assert rules == [[{"of": [["x", 1]], "op": "<=", "value": 3}], [{"of": [["x", 1]], "op": ">", "value": 3}]]
    assert result.ok and [c.index for c in result.report.calls] == [0, 1, 2, 3, 4]
    # Each program was traced from a call of its side and is dynamic in the length of its own calls.
    first, second = (p.program.module() for p in result.programs)
    for length in (2, 3):
        x = torch.randn(2, length, 3)
        torch.testing.assert_close(first(x), model(x), atol=0, rtol=0)
    for length in (4, 7, 9):
        x = torch.randn(2, length, 3)
        torch.testing.assert_close(second(x), model(x), atol=0, rtol=0)
    with pytest.raises(AssertionError, match="Guard failed"):
        first(torch.randn(2, 6, 3))
    index = result.to_onnx(tmp_path / "long.onnx")
    rows = bundle.check_discrepancies(index)
    assert [(r["index"], r["program"], r["SUCCESS"]) for r in rows] == [
        (0, "p0", True),
        (1, "p1", True),
        (2, "p1", True),
        (3, "p0", True),
        (4, "p1", True),
    ]
    other = InputObserver()  # lengths no call had, each side
    with torch.no_grad(), other(model):
        for length in (3, 8):
            model(torch.randn(2, length, 3))
    rows = other.check_discrepancies(index)
    assert [(r["program"], r["SUCCESS"]) for r in rows] == [("p0", True), ("p1", True)]
    assert max(r["abs"] for r in rows) < 1e-5


class ShortPath(torch.nn.Module):
    """``if len(rows) + 1 >= 3`` on a list's first tensor: below the branch it has 0 or 1 rows, where export is
    size-oblivious (the list stays present when its first tensor is empty, as a cache with an emptied residual)."""

    def forward(self, state: list[torch.Tensor]) -> torch.Tensor:
        rows, base = state
        if rows.shape[1] + 1 >= 3:
            return (rows.cumsum(dim=1) * 2).sum(dim=1) + base
        return rows.sum(dim=1) + base + 1


def short_state(length: int) -> list[torch.Tensor]:
    return [torch.randn(2, length, 3), torch.randn(2, 3)]


def test_a_side_of_sizes_0_and_1_of_a_nested_tensor_gets_its_own_program(tmp_path):
    model = ShortPath().eval()
    observer = InputObserver()
    torch.manual_seed(0)
    with torch.no_grad(), observer(model, store_n_calls=4):
        for length in (2, 0, 3, 1):
            model(short_state(length))
    observer.save(tmp_path / "short.iobundle")
    bundle = load_bundle(tmp_path / "short.iobundle")
    result = bundle.export_programs(model)
    assert [(p.phase.name, p.phase.calls, [c.describe() for c in p.sizes]) for p in result.programs] == [
        ("p0", (0, 2), ["axis 1 of state (tensor 0) >= 2"]),
        ("p1", (1, 3), ["axis 1 of state (tensor 0) < 2"]),
    ]
    # The side of 0 and 1 rows is exported size-obliviously, traced from a call on that side.
    assert any(o.startswith("backed_size_oblivious=True") for o in result.programs[1].report.options)
    assert result.programs[1].report.traced_call in (1, 3)
    second = result.programs[1].program.module()
    for length in (0, 1):
        state = short_state(length)
        torch.testing.assert_close(second(state), model(state), atol=0, rtol=0)
    index = result.to_onnx(tmp_path / "short.onnx")
    rows = bundle.check_discrepancies(index)
    assert [(r["index"], r["program"], r["SUCCESS"]) for r in rows] == [
        (0, "p0", True),
        (1, "p1", True),
        (2, "p0", True),
        (3, "p1", True),
    ]


class PairSum(torch.nn.Module):
    """A branch on a sum of two sizes (``x`` and ``y`` lengths)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape[1] + y.shape[1] >= 5:
            return torch.cat([x, y], dim=1).cumsum(dim=1)
        return torch.cat([x, y], dim=1) * 3


class PairMax(PairSum):
    """A branch on the larger of two sizes, which no size rule expresses (``max`` is not among its operations)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if max(x.shape[1], y.shape[1]) >= 3:
            return torch.cat([x, y], dim=1).cumsum(dim=1)
        return torch.cat([x, y], dim=1) * 3


def record_pairs(model: torch.nn.Module, pairs: tuple[tuple[int, int], ...]) -> InputObserver:
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=len(pairs)):
        for a, b in pairs:
            model(torch.randn(2, a, 3), torch.randn(2, b, 3))
    return observer


def test_a_branch_on_a_sum_of_two_inputs_sizes_gets_one_program_each_side(tmp_path):
    model = PairSum().eval()
    observer = record_pairs(model, ((2, 2), (3, 3), (2, 1), (4, 2), (1, 3)))
    result = observer.export_programs(model)
    assert [(p.phase.calls, [c.describe() for c in p.sizes]) for p in result.programs] == [
        ((0, 2, 4), ["axis 1 of x + axis 1 of y < 5"]),
        ((1, 3), ["axis 1 of x + axis 1 of y >= 5"]),
    ]
    rows = observer.check_discrepancies(result.to_onnx(tmp_path / "pair.onnx"))
    assert [r["SUCCESS"] for r in rows] == [True] * 5


def test_a_guard_no_size_rule_expresses_is_said_and_not_split(tmp_path):
    model = PairMax().eval()
    with pytest.raises(ExportError) as raised:
        record_pairs(model, ((2, 2), (3, 3), (2, 1), (4, 2))).export(model)
    options = raised.value.report.options
    assert any(
        "not split into two programs" in o and "max(" in o and "uses what a size rule has not" in o for o in options
    )


@pytest.mark.parametrize(
    ("guard", "holds"),
    [
        ("1 + cache['key_0'].size()[2] >= 3", {"of": [["cache", 2, 0]], "op": ">=", "value": 2}),
        ("cache['key_0'].size()[2] <= 2", {"of": [["cache", 2, 0]], "op": "<=", "value": 2}),
        ("x.size()[1] * x.size()[0] + 2 != 3", {"of": [["x", 1], ["x", 0]], "op": "!=", "value": 1}),
        ("2 == x.size()[0]", {"of": [["x", 0]], "op": "==", "value": 2}),
        # Other arithmetic of sizes: an ``expr`` of the sizes ``of`` names s0, s1, ...
        ("0 == x.size()[1] % 4", {"of": [["x", 1]], "op": "==", "value": 0, "expr": "s0 % 4"}),
        (
            "(x.size()[1] * x.size()[0]) % 8 != 3",
            {"of": [["x", 1], ["x", 0]], "op": "!=", "value": 3, "expr": "s0 * s1 % 8"},
        ),
        ("x.size()[3] == x.size()[2]", {"of": [["x", 3], ["x", 2]], "op": "==", "value": 0, "expr": "s0 - s1"}),
        (
            "(8 + -1 * (x.size()[2] % 8)) % 8 == 0",
            {"of": [["x", 2]], "op": "==", "value": 0, "expr": "(8 + -1 * (s0 % 8)) % 8"},
        ),
        ("x.size()[0] + 5 >= 3", {"of": [["x", 0]], "op": ">=", "value": 3, "expr": "s0 + 5"}),
        (
            "cache['key_0'].size()[2] + x.size()[1] < 4",
            {"of": [["cache", 2, 0], ["x", 1]], "op": "<", "value": 4, "expr": "s0 + s1"},
        ),
    ],
)
def test_a_guard_becomes_a_size_rule_and_its_negation(guard, holds):
    sources = {"x": ("x", None), "cache['key_0']": ("cache", 0), "cache['value_0']": ("cache", 1)}
    first, second = split_rule(f"AssertionError: Guard failed: {guard}", sources)
    assert first.model_dump(mode="json") == holds
    assert second.of == first.of and second.value == first.value and second.op != first.op
    assert second.expr == first.expr


@pytest.mark.parametrize(
    ("guard", "reason"),
    [
        ("y.size()[0] >= 2", "names 'y.size()[0]', not a size of a tensor the program takes"),
        ("max(2, x.size()[0]) == 2", "uses what a size rule has not (only + - * // % of sizes and whole numbers)"),
        ("x.size()[0] ** 2 == 4", "uses what a size rule has not"),
        ("x.size()[0] < x.size()[1] < 3", "does not compare sizes"),
        ("4 < 5", "does not compare sizes"),
    ],
)
def test_a_guard_of_another_shape_says_why_it_has_no_size_rule(guard, reason):
    assert reason in split_rule(f"AssertionError: Guard failed: {guard}", {"x": ("x", None)})
    assert split_rule("RuntimeError: shapes differ", {}) == "the program refused them on no guard"


class PadToFour(torch.nn.Module):
    """Sums of 4 x 4 blocks, ``x`` padded to multiples of 4 first when a side is not one (``if h % 4 or w % 4``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[1], x.shape[2]
        if h % 4 or w % 4:
            x = torch.nn.functional.pad(x, (0, -w % 4, 0, -h % 4)) + 1
        return x.unflatten(1, (-1, 4)).unflatten(3, (-1, 4)).sum((2, 4))


def test_calls_refused_on_two_guards_are_split_guard_by_guard_each_side_dynamic(tmp_path):
    model = PadToFour().eval()
    sides = ((8, 8), (6, 8), (8, 5), (12, 12), (10, 7))
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=len(sides)):
        for h, w in sides:
            model(torch.randn(2, h, w))
    result = observer.export_programs(model)
    assert [(p.phase.calls, [c.describe() for c in p.sizes]) for p in result.programs] == [
        ((0, 3), ["axis 1 of x % 4 == 0", "axis 2 of x % 4 == 0"]),
        ((1, 4), ["axis 1 of x % 4 != 0"]),
        ((2,), ["axis 1 of x % 4 == 0", "axis 2 of x % 4 != 0"]),
    ]
    index = result.to_onnx(tmp_path / "pad.onnx")
    assert [(r["program"], r["SUCCESS"]) for r in observer.check_discrepancies(index)] == [
        ("p0", True), ("p1", True), ("p2", True), ("p0", True), ("p1", True)
    ]  # fmt: skip
    # Sizes no call had, each side: program p2 was traced from one call, dynamic where p0 is.
    other = InputObserver()
    with torch.no_grad(), other(model):
        for h, w in ((16, 11), (7, 9), (16, 12)):
            model(torch.randn(2, h, w))
    rows = other.check_discrepancies(index)
    assert [(r["program"], r["SUCCESS"]) for r in rows] == [("p2", True), ("p1", True), ("p0", True)]
