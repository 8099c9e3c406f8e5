"""The LLM demo: a tiny Llama captured from ``generate()``, exported and validated from its bundle alone.

Needs transformers. The model is built from a config with random weights (nothing is
downloaded); the bundle stores the config and weights (``include_model=True``), and the
export step rebuilds the model from the bundle, not from this process's copy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["LLAMA_CONFIG", "capture_llama_demo", "run_llama_demo", "tiny_llama"]

#: The demo model: 2 layers, hidden size 32, grouped-query attention (4 query heads, 2 key/value heads).
LLAMA_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 100,
    "max_position_embeddings": 128,
}


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` built from :data:`LLAMA_CONFIG` with weights drawn from ``seed``, in eval mode."""
    import transformers

    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_CONFIG))
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def capture_llama_demo(
    directory: str | os.PathLike[str], *, prompt_length: int = 5, new_tokens: int = 6
) -> tuple[Path, int]:
    """Record every ``forward`` call of a tiny Llama's greedy ``generate()`` into a self-contained bundle.

    The bundle (``directory/llama.iobundle``, replaced if present) holds the model's config and
    weights (``include_model=True``), so ``iobundle export BUNDLE --from-bundle`` rebuilds the
    model from it, with no code of the user's.

    Returns:
        The bundle's path and the number of calls recorded (one prefill, then one per new token).
    """
    from iobundle.observer import InputObserver

    model = tiny_llama()
    prompt = torch.randint(
        0, LLAMA_CONFIG["vocab_size"], (1, prompt_length), generator=torch.Generator().manual_seed(1)
    )
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=new_tokens + 1):
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    path = Path(directory) / "llama.iobundle"
    observer.save(path, overwrite=True, include_model=True)
    return path, observer.num_obs()


def run_llama_demo(
    directory: str | os.PathLike[str],
    *,
    prompt_length: int = 5,
    new_tokens: int = 6,
    atol: float = 1e-4,
) -> dict[str, Any]:
    """Capture a tiny Llama's ``generate()``, then export and validate it from the bundle alone.

    Steps: :func:`capture_llama_demo` (a self-contained ``directory/llama.iobundle``), then
    reopen the bundle, rebuild the model from it (``load_bundle_model``: config and weights
    from the bundle, class from transformers' auto-model mappings), export it with
    ``torch.export`` (checked on every recorded call through ``ep.module()``) and to
    ``directory/llama.onnx``, and run the ONNX model with onnxruntime on every recorded call.
    Everything runs in this process; the command line's ``iobundle demo --llama`` does the
    export and validation in fresh ones.

    Args:
        directory: Where the bundle and the ONNX file go (created if missing; both are replaced).
        prompt_length: Tokens in the prompt.
        new_tokens: Tokens to generate (one recorded call each: the prefill, then the decode steps).
        atol: Absolute tolerance of both checks.

    Returns:
        A summary: ``bundle``, ``onnx`` (paths), ``calls`` (recorded), ``traced_call``,
        ``patches`` and ``options`` of the export, ``export_seconds`` (``torch.export``),
        ``onnx_seconds`` (``torch.onnx.export``), ``max_abs_program`` / ``max_abs_onnx`` (largest
        error over the calls in ``ep.module()`` and onnxruntime), ``ok`` (every call within
        ``atol`` in both) and ``transformers`` (version).

    Raises:
        ExportError: The export failed (the error's ``.report`` says which calls).

    Example:
        >>> summary = run_llama_demo("demo-output")
        >>> summary["ok"], summary["calls"]
        (True, 6)
    """
    import transformers

    from iobundle.replay import load_bundle, load_bundle_model

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    bundle_path, _ = capture_llama_demo(out, prompt_length=prompt_length, new_tokens=new_tokens)
    onnx_path = out / "llama.onnx"

    bundle = load_bundle(bundle_path)
    model = load_bundle_model(bundle)
    # One torch.export: the checked program is the one written to ONNX (Bundle.to_onnx would trace it again).
    programs = bundle.export_programs(model, programs="one", atol=atol)
    report = programs.report
    options = list(report.options)  # the export's, before the ONNX rewrites add theirs
    onnx_file = programs.to_onnx(onnx_path)
    rows = bundle.check_discrepancies(onnx_file, atol=atol, include_io=False)
    return {
        "bundle": str(bundle_path),
        "onnx": onnx_file,
        "calls": bundle.num_obs(),
        "traced_call": report.traced_call,
        "patches": list(report.patches),
        "options": options,
        "export_seconds": report.export_seconds,
        "onnx_seconds": report.onnx_seconds,
        "max_abs_program": max(c.abs for c in report.calls),
        "max_abs_onnx": max(float(r["abs"]) for r in rows),
        "ok": report.ok and all(r["SUCCESS"] is True for r in rows),
        "transformers": transformers.__version__,
    }
