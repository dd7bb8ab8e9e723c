# The two set-up commands of the README:  `make demo`  and  `make test`.
# Both install everything they need first (idempotent; quick when already installed).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Pinned: a free choice of torch downloads a multi-GB CUDA build on a CPU machine.
TORCH_SPEC ?= torch==2.13.0
MCORE_SPEC ?= megatron-core==0.16.1
# The older supported Megatron-Core line, tested in a venv that reuses $(PYTHON)'s packages (torch,
# pytest, ...; through a .pth file, so this works when $(PYTHON) is itself a venv) and shadows
# megatron-core only.
OLDER_MCORE_SPEC ?= megatron-core==0.13.1
OLDER_VENV ?= .venv-mcore-older
MEGATRON_TESTS := tests/unit/test_cpu_harness.py tests/unit/test_cpu_harness_gpt.py $(wildcard tests/integration/test_megatron_*.py)

.PHONY: install demo test test-megatron-older megatron-older-tests test-cpp clean

install:
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]" "$(MCORE_SPEC)"

demo: install
	$(PYTHON) -m megatron_mlp demo

test: install
	$(PYTHON) -m pytest -q -ra --durations=15 tests
	$(MAKE) megatron-older-tests

# The Megatron integration tests again with the older Megatron-Core line.
test-megatron-older: install
	$(MAKE) megatron-older-tests

megatron-older-tests:
	test -x $(OLDER_VENV)/bin/python || $(PYTHON) -m venv $(OLDER_VENV)
	$(OLDER_VENV)/bin/python -c "import site, sys; open(site.getsitepackages()[0] + '/zz-reuse-main-env.pth', 'w').write(sys.argv[1] + '\n')" \
	    "$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(OLDER_VENV)/bin/python -m pip install -q "$(OLDER_MCORE_SPEC)"
	PYTHONPATH=$(CURDIR) $(OLDER_VENV)/bin/python -c "import megatron.core as m; print('megatron-core', m.__version__)"
	PYTHONPATH=$(CURDIR) $(OLDER_VENV)/bin/python -m pytest -q -ra --durations=10 $(MEGATRON_TESTS)

clean:
	rm -rf build *.egg-info $(OLDER_VENV) megatron_mlp/*.so tests/cpp/bin
