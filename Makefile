# Two commands on a fresh machine:
#   make app    create .venv, install requirements.txt, start the dashboard (streamlit run app.py)
#   make test   create .venv, install requirements-dev.txt (+ Debian's Chromium for the browser test), run pytest
# On a GPU host that already has a CUDA build of torch: `make app TORCH=keep` reuses it (the venv sees the
# system site-packages and the torch pin is not installed).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= pin
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

ifeq ($(TORCH),keep)
VENV_FLAGS := --system-site-packages
REQ_FILTER := grep -v '^torch=='
else
VENV_FLAGS :=
REQ_FILTER := cat
endif

.PHONY: app test bench

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

test: $(VENV)/.dev
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)
	$(PY) -m pytest
	$(NUMERICS_GUARD) $(PY) -m pytest -m "numerics and not slow and not gpu"
