"""Moved to :mod:`mola.models.loader`; this name stays for ``mola.train``, which
still imports it from here (it is being split separately)."""

from ..models.loader import ModelLoadError, load_base_model, looks_like_hub_id, resolve_model_path

__all__ = ["ModelLoadError", "load_base_model", "looks_like_hub_id", "resolve_model_path"]
