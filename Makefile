# The two set-up commands of the README:  `make demo`  and  `make test`.
# Both install everything they need first (idempotent; quick when already installed).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Pinned: a free choice of torch downloads a multi-GB CUDA build on a CPU machine.
TORCH_SPEC ?= torch==2.13.0
MCORE_SPEC ?= megatron-core==0.16.1

.PHONY: install demo test test-cpp clean

install:
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]" "$(MCORE_SPEC)"

demo: install
	$(PYTHON) -m megatron_mlp demo

test: install
	$(PYTHON) -m pytest -q -ra tests

clean:
	rm -rf build *.egg-info megatron_mlp/*.so tests/cpp/bin
