"""The activations' precision of block-quantized weight products, one choice per process.

Both kernel libraries (quant_kernels and every cpu_kernels variant) multiply block-quantized
weights; each registers here when loaded, so one `--quant-activations` reaches all of them,
libraries loaded later included.
"""

from __future__ import annotations

_state: dict[str, str] = {}
_libraries: list = []

ACTIVATION_MODES = {"fp32": 0, "int16": 1, "int8": 2}  # quant_gemv.h's ActivationMode
# --quant-activations: exact (greedy output of the dequantized fp32 model) or int8 (faster batches).
CONFIG_ACTIVATIONS = {"exact": "int16", "int8": "int8"}
# int8 by default: it only changes the products of 5 or more rows (batched decode, prompt chunks) on
# CPUs with AVX-512 VNNI, where they run 1.3-2.9x faster; rows whose few large channels int8 would
# not hold (a chat prompt's special tokens) are rounded twice (quant_gemv_vnni.h), which keeps the
# default model's chat answer and a KL divergence below llama.cpp's on the same file (docs/perf.md).
# A process that loads the kernels without choosing (a library user, the tests) computes exact.
DEFAULT_CONFIG_ACTIVATIONS = "int8"
QUANT_ACTIVATIONS_HELP = (
    "int8 (default): from 5 rows (batched decode, prompt chunks) on CPUs with AVX-512 VNNI, activations rounded "
    "to int8 per 16 elements (rows with outlier channels twice): 1.3-2.9x faster products, next-token "
    "distributions as close to the dequantized model as llama.cpp's (docs/perf.md); fewer rows or other CPUs "
    "compute as exact. exact: activations rounded to int16 per 16 elements: greedy output of the "
    "fp32-dequantized model, the same whatever else shares the batch")


def add_quant_activations_argument(parser) -> None:
    """--quant-activations (flag, DUALPACE_QUANT_ACTIVATIONS or TOML through dualpace.serve.config)."""
    parser.add_argument("--quant-activations", default=DEFAULT_CONFIG_ACTIVATIONS, choices=sorted(CONFIG_ACTIVATIONS),
                        help=QUANT_ACTIVATIONS_HELP)


def register(lib) -> None:
    """A kernel library just loaded (quant_kernels or a cpu_kernels variant): set to the mode in use
    now, and to every mode set_activations chooses later."""
    lib.dp_quant_set_activations(activation_mode_id())
    _libraries.append(lib)


def activation_mode_id() -> int:
    """The mode set_activations chose last (int16 until then), as quant_gemv.h numbers it: every
    library loaded later starts in it."""
    return ACTIVATION_MODES[_state.get("activations", "int16")]  # type: ignore[index]


def set_activations(mode: str) -> None:
    """Use `mode` (fp32, int16, int8) for the activations of block-quantized weights from now on,
    in these kernels and in every cpu_kernels variant, those loaded later included. Not while a
    linear call runs."""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"activation mode {mode!r}: expected one of {', '.join(ACTIVATION_MODES)}")
    _state["activations"] = mode
    for lib in _libraries:
        lib.dp_quant_set_activations(ACTIVATION_MODES[mode])


def use_config_activations(name: str) -> None:
    """Apply --quant-activations (a CONFIG_ACTIVATIONS name) to every loaded kernel library."""
    set_activations(CONFIG_ACTIVATIONS[name])
