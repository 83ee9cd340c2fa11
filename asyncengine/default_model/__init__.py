"""The bundled default model: a small Llama trained on the standard library's docstrings.

Its Hugging Face files (config.json, model.safetensors, tokenizer.json, ...) live next to this
module and ship in the package; MODEL_CARD.md says how `scripts/train_default_model.py` made them.
"""

from __future__ import annotations

from pathlib import Path


def path() -> str:
    """The installed directory of the default model, as `EngineArgs.model` takes it."""
    return str(Path(__file__).resolve().parent)
