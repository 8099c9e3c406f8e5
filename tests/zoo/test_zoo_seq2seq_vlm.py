"""Encoder-decoder and vision-language families: captured from ``generate()``, exported and validated through the CLI.

Each family is a tiny model built from a config here (2 layers, d_model 32, random weights,
fixed seed; nothing is downloaded), observed during a real ``generate()`` and saved as a
self-contained bundle (``include_model=model``). Then, in a fresh interpreter with an empty
working directory, only the bundle crossing the process boundary, the two commands (one after
the other, through the command line's ``main``: ``harness.cli_session``)::

    iobundle export BUNDLE --from-bundle --batch-all -o BUNDLE.onnx --report export.json
    iobundle validate BUNDLE OUTPUT --report validate.json

where OUTPUT is the ONNX file, or the program index when one program per phase was needed.
``export`` checks every recorded call through ``ep.module()`` and exits non-zero when one
differs; ``validate`` runs onnxruntime on every recorded call. Every call must reproduce
within 1e-4 in both.

The recipe for encoder-decoder models: observe the whole model's ``forward`` (``generate()``
runs the encoder once, outside ``forward``, and passes ``encoder_outputs`` to every decoder
step) and the encoder (``model.get_encoder()``) with a second observer; Whisper's encoder and
decoder modules are observed the same way. The first decoder step (its cache still empty)
and the later ones (cross-attention keys and values read from the cache) need two programs
for T5, BART, Marian, Pegasus, M2M-100, Blenderbot and ProphetNet (two decoder streams, ngram 2);
Whisper's needs one, thanks to ``whisper_cross_attention_recompute``.
For VLMs, ``generate()`` runs the vision tower itself and passes ``mm_encoder_outputs`` at
prefill only: the prefill and the decode steps are two programs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import cli_session

from iobundle import InputObserver

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.slow

ATOL = 1e-4
TIMEOUT_S = 900


# --------------------------------------------------------------------------- tiny models


def _seeded(build: Callable[[], Any]) -> Any:
    torch.manual_seed(0)
    return build().eval()


def tiny_t5() -> Any:
    config = transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return _seeded(lambda: transformers.T5ForConditionalGeneration(config))


def tiny_bart() -> Any:
    config = transformers.BartConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=None,
        forced_eos_token_id=None,
    )  # fmt: skip
    return _seeded(lambda: transformers.BartForConditionalGeneration(config))


def tiny_marian() -> Any:
    config = transformers.MarianConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=99, eos_token_id=2, decoder_start_token_id=99, forced_eos_token_id=None,
    )  # fmt: skip
    return _seeded(lambda: transformers.MarianMTModel(config))


def _bart_like(config_class: str, model_class: str, **tokens: Any) -> Any:
    """A tiny BART-shaped encoder-decoder (Pegasus, M2M-100, Blenderbot: the settings they share, plus ``tokens``)."""
    config = getattr(transformers, config_class)(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        forced_eos_token_id=None, **tokens,
    )  # fmt: skip
    return _seeded(lambda: getattr(transformers, model_class)(config))


def tiny_pegasus() -> Any:
    return _bart_like(
        "PegasusConfig", "PegasusForConditionalGeneration", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0
    )


def tiny_m2m_100() -> Any:
    return _bart_like(
        "M2M100Config", "M2M100ForConditionalGeneration", pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2,
    )  # fmt: skip


def tiny_blenderbot() -> Any:
    return _bart_like(
        "BlenderbotConfig", "BlenderbotForConditionalGeneration", pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )  # fmt: skip


def tiny_prophetnet() -> Any:
    # Two streams in the decoder (ngram 2): the main one and one that predicts a token further.
    config = transformers.ProphetNetConfig(
        vocab_size=100, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=2,
        num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4, ngram=2, num_buckets=8,
        relative_max_distance=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )  # fmt: skip
    return _seeded(lambda: transformers.ProphetNetForConditionalGeneration(config))


def tiny_whisper() -> Any:
    config = transformers.WhisperConfig(
        vocab_size=100, num_mel_bins=8, encoder_layers=2, decoder_layers=2, d_model=32, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=15,
        max_target_positions=32, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip
    return _seeded(lambda: transformers.WhisperForConditionalGeneration(config))


GEMMA3_IMAGE_TOKEN, SMOLVLM_IMAGE_TOKEN = 97, 99


def tiny_gemma3_vlm() -> Any:
    # A hybrid cache (one sliding, one full layer) whose window the generation stays inside.
    text = transformers.Gemma3TextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=32, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=128, pad_token_id=0,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
        patch_size=7, num_channels=3,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_index=GEMMA3_IMAGE_TOKEN, boi_token_index=98, eoi_token_index=99,
    )  # fmt: skip
    return _seeded(lambda: transformers.Gemma3ForConditionalGeneration(config))


def tiny_smolvlm() -> Any:
    text = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
    )  # fmt: skip
    vision = transformers.SmolVLMVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
        patch_size=7, num_channels=3,
    )  # fmt: skip
    config = transformers.SmolVLMConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), scale_factor=2, image_token_id=SMOLVLM_IMAGE_TOKEN
    )
    return _seeded(lambda: transformers.SmolVLMForConditionalGeneration(config))


# --------------------------------------------------------------------------- captures


@dataclass
class Job:
    """One bundle to replay, and what its replay must show."""

    bundle: Path
    batch: bool = True  # --batch-all
    programs: int = 1
    min_calls: int = 1
    extra: list[str] = field(default_factory=list)
    validate_with: Path | None = None  # validate the export on another bundle instead


def _padded_batch(lengths: tuple[int, int], seed: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch of two token sequences of the given lengths."""
    width = max(lengths)
    ids = torch.randint(3, 90, (2, width), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        ids[row, length:], mask[row, length:] = pad, 0
    return ids, mask


def capture_seq2seq(
    root: Path, name: str, model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[Path, Path]:
    """Observe the whole model's forward (the decoder steps) and its encoder during ``generate()`` on each batch."""
    decoder, encoder = InputObserver(), InputObserver()
    with (
        torch.no_grad(),
        decoder(model, store_n_calls=10 * len(batches)),
        encoder(model.get_encoder(), store_n_calls=len(batches)),
    ):
        for ids, mask in batches:
            model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    paths = root / f"{name}_decoder.iobundle", root / f"{name}_encoder.iobundle"
    decoder.save(paths[0], include_model=model)
    encoder.save(paths[1], include_model=model)
    return paths


def capture_whisper(root: Path) -> tuple[Path, Path]:
    model = tiny_whisper()
    features = torch.randn(1, 8, 30, generator=torch.Generator().manual_seed(3))
    encoder, decoder = InputObserver(), InputObserver()
    with torch.no_grad(), encoder(model.model.encoder, store_n_calls=4), decoder(model.model.decoder, store_n_calls=10):
        model.generate(features, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    paths = root / "whisper_decoder.iobundle", root / "whisper_encoder.iobundle"
    decoder.save(paths[0], include_model=model)
    encoder.save(paths[1], include_model=model)
    return paths


def capture_vlm(root: Path, name: str, model: Any, prompt: list[int], pixel_values: torch.Tensor, **extra: Any) -> Path:
    ids = torch.tensor([prompt])
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=10):
        model.generate(
            ids, attention_mask=torch.ones_like(ids), pixel_values=pixel_values, max_new_tokens=5, min_new_tokens=5,
            do_sample=False, **extra,
        )  # fmt: skip
    path = root / f"{name}.iobundle"
    observer.save(path, include_model=True)
    return path


SEQ2SEQ = {  # builder, pad token
    "t5": (tiny_t5, 0),
    "bart": (tiny_bart, 1),
    "marian": (tiny_marian, 99),
    "pegasus": (tiny_pegasus, 0),
    "m2m_100": (tiny_m2m_100, 1),
    "blenderbot": (tiny_blenderbot, 0),
    "prophetnet": (tiny_prophetnet, 0),
}


def capture(name: str, root: Path, captured: Callable[[str], dict[str, Job]]) -> dict[str, Job]:
    """The jobs of the capture ``name``, its bundles written under ``root``; ``captured`` gives another capture's."""
    if name in SEQ2SEQ:
        build, pad = SEQ2SEQ[name]
        decoder, encoder = capture_seq2seq(root, name, build(), [_padded_batch((7, 5), 1, pad)])
        return {f"{name}_decoder": Job(decoder, programs=2, min_calls=5), f"{name}_encoder": Job(encoder)}
    if name == "t5_two":
        # Two generate() calls with different source lengths: the decoder programs serve both.
        two, _ = capture_seq2seq(root, "t5", tiny_t5(), [_padded_batch((7, 5), 1, 0), _padded_batch((4, 3), 2, 0)])
        # One generate() call, the encoder length made dynamic by hand: validated on the other lengths.
        dynamic = Job(
            captured("t5")["t5_decoder"].bundle, programs=2, min_calls=10, validate_with=two,
            extra=["--dynamic", "attention_mask:1", "--dynamic", "encoder_outputs:1", "--dynamic", "cache:2"],
        )  # fmt: skip
        return {"t5_two_source_lengths": Job(two, programs=2, min_calls=10), "t5_dynamic_flag": dynamic}
    if name == "whisper":
        decoder, encoder = capture_whisper(root)
        return {"whisper_decoder": Job(decoder, min_calls=5), "whisper_encoder": Job(encoder)}
    if name == "gemma3_vlm":
        gemma = capture_vlm(
            root, "gemma3_vlm", tiny_gemma3_vlm(), [2, 5, 6, 98, *[GEMMA3_IMAGE_TOKEN] * 4, 99, 7, 8],
            torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(4)),
            token_type_ids=torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0]]),
        )  # fmt: skip
        return {"gemma3_vlm": Job(gemma, programs=2, min_calls=5)}
    if name == "smolvlm":
        smol = capture_vlm(
            root, "smolvlm", tiny_smolvlm(), [2, 5, 6, *[SMOLVLM_IMAGE_TOKEN] * 4, 7, 8],
            torch.randn(1, 1, 3, 28, 28, generator=torch.Generator().manual_seed(5)),
        )  # fmt: skip
        return {"smolvlm": Job(smol, programs=2, min_calls=5)}
    raise KeyError(name)


CAPTURE_OF = {  # job -> the capture that makes its bundles
    **{f"{n}_{part}": n for n in [*SEQ2SEQ, "whisper"] for part in ("decoder", "encoder")},
    "t5_two_source_lengths": "t5_two",
    "t5_dynamic_flag": "t5_two",
    "gemma3_vlm": "gemma3_vlm",
    "smolvlm": "smolvlm",
}


# --------------------------------------------------------------------------- replay through the CLI


def replay(name: str, job: Job, root: Path) -> dict[str, Any]:
    """Export then validate in one fresh process (``cli_session``); the exit codes, outputs and both JSON reports."""
    work = root / "work" / name
    work.mkdir(parents=True)
    onnx_path, export_json, validate_json = work / f"{name}.onnx", work / "export.json", work / "validate.json"
    argv = ["export", str(job.bundle), "--from-bundle", "-o", str(onnx_path), "--report", str(export_json)]
    argv += (["--batch-all"] if job.batch else []) + job.extra
    with cli_session(TIMEOUT_S) as cli:
        export = cli(argv, work)
        result: dict[str, Any] = {"export_rc": export.returncode, "export_out": export.stdout + export.stderr}
        if not export_json.exists():
            return result
        result["export"] = json.loads(export_json.read_text("utf-8"))
        validated = job.validate_with or job.bundle
        argv = ["validate", str(validated), result["export"]["output"], "--report", str(validate_json)]
        validate = cli(argv, work)
        result.update(validate_rc=validate.returncode, validate_out=validate.stdout + validate.stderr)
    if validate_json.exists():
        result["rows"] = json.loads(validate_json.read_text("utf-8"))
    from iobundle.schema import load_manifest

    result["calls"] = sum(1 for c in load_manifest(validated).calls if c.status == "ok")
    result["recorded_calls"] = sum(1 for c in load_manifest(job.bundle).calls if c.status == "ok")
    return result


@pytest.fixture(scope="session")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """A job's replay (see :func:`replay`), each capture and each replay done once per test process.

    In one process, the first test captures everything and replays every job, two at a time.
    Under pytest-xdist each test replays its own job (the workers side by side), and the tests
    that share a capture share an ``xdist_group``, so that one worker captures it once.
    """
    root = tmp_path_factory.mktemp("zoo_seq2seq_vlm")
    captures: dict[str, dict[str, Job]] = {}
    results: dict[str, dict[str, Any]] = {}

    def captured(name: str) -> dict[str, Job]:
        if name not in captures:
            (root / name).mkdir()
            captures[name] = capture(name, root / name, captured)
        return captures[name]

    def run(name: str) -> tuple[str, dict[str, Any]]:
        job = captured(CAPTURE_OF[name])[name]
        return name, {**replay(name, job, root), "job": job}

    def result(name: str) -> dict[str, Any]:
        if name not in results:
            if os.environ.get("PYTEST_XDIST_WORKER"):
                results.update([run(name)])
            else:
                for capture_name in dict.fromkeys(CAPTURE_OF.values()):
                    captured(capture_name)  # one after the other, before the replays run side by side
                pending = [n for n in CAPTURE_OF if n not in results]
                with ThreadPoolExecutor(max_workers=2) as pool:
                    results.update(pool.map(run, pending))
        return results[name]

    return result


def check(result: dict[str, Any]) -> dict[str, Any]:
    """Every recorded call reproduced by ``ep.module()`` (at export) and by onnxruntime (validate)."""
    job: Job = result["job"]
    assert result["export_rc"] == 0, result["export_out"][-3000:]
    export = result["export"]
    assert len(export["programs"]) == job.programs, [p["calls"] for p in export["programs"]]
    checks = [c for p in export["programs"] for c in p["checks"]]
    assert sorted(c["index"] for c in checks) == list(range(result["recorded_calls"]))
    for c in checks:
        assert c["success"] is True and c["abs"] <= ATOL, f"ep.module(), call {c['index']}: {c}"
    for program in export["programs"]:
        if program["batch_check"] is not None:
            assert program["batch_check"]["success"] is not False, program["batch_check"]
    assert result["validate_rc"] == 0, result["validate_out"][-3000:]
    assert result["calls"] >= job.min_calls
    assert len(result["rows"]) == result["calls"]
    for row in result["rows"]:
        assert row["SUCCESS"] is True and row["abs"] <= ATOL, f"onnxruntime, call {row['index']}: {row}"
    return export


def _structures(export: dict[str, Any]) -> list[dict[str, str]]:
    return [p["inputs"] for p in export["programs"]]


def grouped(*families: str) -> list[Any]:
    """``families`` as parameters, each in the ``xdist_group`` of its capture."""
    return [pytest.param(f, marks=pytest.mark.xdist_group(f"zoo-{f}")) for f in families]


@pytest.mark.parametrize("family", grouped("t5", "bart", "marian", "pegasus", "m2m_100", "blenderbot", "prophetnet"))
def test_seq2seq_decoder_first_step_and_later_steps(replayed: Callable[[str], dict[str, Any]], family: str) -> None:
    export = check(replayed(f"{family}_decoder"))
    # The first step (its cache still empty) and the later steps are two phases, by structure.
    assert [p["calls"] for p in export["programs"]] == [[0], [1, 2, 3, 4]]
    assert [s["cache"] for s in _structures(export)] == ["absent", "present"]
    assert "one program:" in export["reason"]
    # The batch is dynamic: each program also reproduces the eager model on a batch of 1.
    assert all(p["batch_check"]["success"] is True for p in export["programs"])


@pytest.mark.xdist_group("zoo-prophetnet")
def test_ngram_decoder_keeps_its_cache_length_dynamic(replayed: Callable[[str], dict[str, Any]]) -> None:
    # ProphetNet's decode-step position is int() of the cache length: the later-steps program is
    # traced again with sizes_through_int. Its inverted integer masks (1.0 - mask) are rewritten
    # for ONNX, and its main stream, a chunk fed to a Linear, is copied (layout_copies) so that
    # the programs also serve a batch of 1.
    first, later = check(replayed("prophetnet_decoder"))["programs"]
    assert "sizes_through_int" not in first["patches"] and "sizes_through_int" in later["patches"]
    assert any(o.startswith("traced again with sizes_through_int") for o in later["options"])
    for program in (first, later):
        assert any("aten.rsub.Scalar of an integer tensor" in o for o in program["options"])


@pytest.mark.parametrize(
    "family", grouped("t5", "bart", "marian", "pegasus", "m2m_100", "blenderbot", "prophetnet", "whisper")
)
def test_seq2seq_encoder(replayed: Callable[[str], dict[str, Any]], family: str) -> None:
    export = check(replayed(f"{family}_encoder"))
    assert export["reason"] == ""


@pytest.mark.xdist_group("zoo-whisper")
def test_whisper_decoder_one_program(replayed: Callable[[str], dict[str, Any]]) -> None:
    export = check(replayed("whisper_decoder"))
    assert "whisper_cross_attention_recompute" in export["programs"][0]["patches"]
    assert export["programs"][0]["batch_check"]["success"] is True  # recorded with batch 1, serves 2


@pytest.mark.xdist_group("zoo-t5_two")
def test_seq2seq_decoder_serves_two_source_lengths(replayed: Callable[[str], dict[str, Any]]) -> None:
    export = check(replayed("t5_two_source_lengths"))
    assert [len(p["calls"]) for p in export["programs"]] == [2, 8]


@pytest.mark.xdist_group("zoo-t5_two")
def test_dynamic_flag_serves_source_lengths_never_recorded(replayed: Callable[[str], dict[str, Any]]) -> None:
    # Exported from one generate() (source length 7) with --dynamic, validated on a bundle of
    # two other generate() calls (lengths 7 and 4): the programs accept the unseen length.
    result = replayed("t5_dynamic_flag")
    check(result)
    assert {r["program"] for r in result["rows"]} == {"p0", "p1"}


@pytest.mark.parametrize("family", ["gemma3_vlm", "smolvlm"])
def test_vlm_prefill_and_decode(replayed: Callable[[str], dict[str, Any]], family: str) -> None:
    export = check(replayed(family))
    prefill, decode = _structures(export)
    assert prefill["mm_encoder_outputs"] == "present" and prefill["cache"] == "absent"
    assert decode["mm_encoder_outputs"] == "absent" and decode["cache"] == "present"
    assert [p["calls"] for p in export["programs"]] == [[0], [1, 2, 3, 4]]
    # Recorded with one image (batch 1), the decode program also serves a batch of 2.
    assert export["programs"][1]["batch_check"]["success"] is True
