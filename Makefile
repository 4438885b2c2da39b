# fineflow — the two commands of the quickstart:
#   make run    bootstrap .venv, install, run the whole Prefect flow on the embedded default
#   make test   bootstrap .venv (with dev extras), lint (make lint), then run the test suite but the
#               whole-run fault scenarios (pytest -m scenario: make test-scenarios, make test-nightly)
# Also: make test-scenarios and make test-nightly (the other two test tiers: tests/README.md), make test-all
# (all three; CI, .ci/run, runs make test then make test-scenarios), make repro (plain `dvc repro`, no Prefect),
# make docs (the documentation site, docs/, built strictly into site/), make export-tools (llama.cpp for the GGUF
# export: fineflow/export), make serve-model (the champion's shippable GGUF behind an OpenAI-compatible API on
# SERVE_HOST:SERVE_PORT: fineflow serve), make ci (the CI retraining job: fineflow ci), make serve (the scheduled
# deployment, served from this process), make deploy + make worker (prefect.yaml on a work pool), make clean.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fineflow-installed

# Telemetry off, Prefect state inside the project. The Hugging Face hub is not set here: every stage and the
# flow put it offline, with a project-local cache, unless model.base is a hub id (fineflow/core/runtime.py); then
# your own HF_HOME and network apply, and HF_HUB_OFFLINE=1 keeps an air-gapped cluster off the network.
export HF_HUB_DISABLE_TELEMETRY := 1
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DVC_NO_ANALYTICS := 1
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export TOKENIZERS_PARALLELISM := false
export PATH := $(CURDIR)/$(BIN):$(PATH)
# Python caches each module's bytecode in __pycache__ the first time it imports it, and reads it from then on; a
# machine that sets PYTHONDONTWRITEBYTECODE (as this project's CI machines do) makes every process compile torch,
# transformers and prefect from source again: ~7 CPU-s more per process start (11.4 s against 4.4 s of CPU for
# `import torch, transformers, peft, accelerate` here), paid by every stage process and rank of a run, and by the
# hundreds a test run starts. .dvcignore keeps __pycache__ out of the stages' code dependencies.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run docs lint test test-scenarios test-nightly test-all repro ci serve deploy worker venv clean export-tools \
	serve-model

venv: $(STAMP)

# torch first, so the stack below keeps it. Which build comes depends on where pip looks, not on this line:
# from PyPI on Linux x86_64, torch==2.13.0 is the CUDA build (multi-GB; what a GPU machine needs, and it also
# runs on CPU); this project's CPU machines get 2.13.0+cpu from a local wheel folder in their pip config
# (find-links). For the CPU build elsewhere, install it into the venv first and this line keeps it:
#   python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# GPU extras (docs/install.md): .venv/bin/pip install -e '.[gpu]' (bitsandbytes, QLoRA);
# flash-attn is built against this torch: .venv/bin/pip install flash-attn==2.8.3.post2 --no-build-isolation
# --no-compile: pip does not byte-compile every file of every package (torch, transformers, prefect, dvc: most
# never imported here); Python compiles a module, and caches it in __pycache__, the first time it is imported.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m flows.pipeline

# The docs site (mkdocs.yml, docs/): a broken link or a page missing from the nav fails. `make test` builds it too
# (tests/test_docs.py, into a temporary folder).
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

# ruff's settings are in pyproject.toml; it skips .venv and what .gitignore ignores.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Lint first: a style or import error fails in seconds, before the minutes of tests.
# Three tiers (tests/README.md lists which guards what). `make test`: all but the whole-run scenarios, on two
# workers, a file each (loadfile: a module's fixtures are built once). `make test-scenarios`: the scenarios CI
# runs (the flow or a worker end to end, interrupts, kills, DeepSpeed, FSDP), two at a time: a scenario keeps
# about one core busy (measured: 900 CPU-s in 930 s alone), most of its processes running one after another. `make test-nightly`: the scenarios too long for CI's 20 minutes
# on 2 cores (pytest -m nightly), run on a schedule by .github/workflows/nightly.yml.
test: $(STAMP) lint
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not scenario and not nightly"

test-scenarios: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "scenario and not nightly"

test-nightly: $(STAMP)
	$(BIN)/python -m pytest -m nightly

test-all: test test-scenarios test-nightly

repro: $(STAMP)
	$(BIN)/dvc repro

# The GGUF export's tools (fineflow/export, the `export` extra): llama-cpp-python's sdist, checked against its pinned
# sha256, gives llama.cpp's converter (extracted into ~/.cache/fineflow) and is built into a CPU wheel kept in
# .cache/wheels (GGML_NATIVE=OFF: it runs on any x86-64 with AVX2, not only this CPU; gcc/g++ and cmake needed,
# 9 CPU-minutes: 15 min here on 2 cores shared with other work); a new venv then installs that wheel in seconds.
LLAMA_CPP_SDIST := .cache/sdist/llama_cpp_python-0.3.36.tar.gz
export-tools: $(STAMP)
	$(BIN)/pip download --quiet --no-deps --no-binary :all: --dest .cache/sdist llama-cpp-python==0.3.36
	$(BIN)/python -m fineflow.export.tooling fetch --sdist $(LLAMA_CPP_SDIST)
	ls .cache/wheels/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || CMAKE_ARGS="-DGGML_NATIVE=OFF" \
		$(BIN)/pip wheel --no-deps --wheel-dir .cache/wheels $(LLAMA_CPP_SDIST)
	$(BIN)/pip install --quiet --find-links .cache/wheels -e '.[export]'

# The champion's GGUF export (models/export, written by the export stage) served by llama-cpp-python's OpenAI-compatible
# server, in the foreground: the type export.json names as "serve" unless TYPE is set; only a shippable one
# (fineflow serve --help). make serve-model SERVE_PORT=8080 SERVE_TYPE=f16 SERVE_THREADS=8 (prefixed: a shell's own
# HOST or PORT must not move the server off 127.0.0.1)
SERVE_HOST ?= 127.0.0.1
SERVE_PORT ?= 8000
SERVE_TYPE ?=
SERVE_THREADS ?=
serve-model: $(STAMP)
	$(BIN)/fineflow serve --host $(SERVE_HOST) --port $(SERVE_PORT) $(if $(SERVE_TYPE),--type $(SERVE_TYPE)) \
		$(if $(SERVE_THREADS),--threads $(SERVE_THREADS))

# The CI retraining job (fineflow/ci.py): pull, dvc repro with its gate, push, a summary; what
# .github/workflows/retrain.yml runs. make ci CI_ARGS="--fail-on-refusal --commit"
CI_ARGS ?=
ci: $(STAMP)
	$(BIN)/fineflow ci $(CI_ARGS)

# prefect.yaml's deployments (nightly, on-new-data) on a process work pool, on the server PREFECT_API_URL names;
# `make worker` runs them (in this checkout: prefect.yaml has no pull section). flows/automations.py: the server marks a
# run whose process died (its heartbeats stopped) Crashed.
POOL ?= fineflow-process
deploy: $(STAMP)
	$(BIN)/prefect work-pool inspect $(POOL) >/dev/null 2>&1 || $(BIN)/prefect work-pool create $(POOL) --type process
	$(BIN)/prefect --no-prompt deploy --all
	$(BIN)/python -m flows.automations

worker: $(STAMP)
	$(BIN)/prefect worker start --pool $(POOL)

# make serve CRON="0 */6 * * *" TIMEZONE=Europe/Berlin
CRON ?= 0 2 * * *
TIMEZONE ?= UTC
serve: $(STAMP)
	$(BIN)/python -m flows.deploy --cron "$(CRON)" --timezone "$(TIMEZONE)"

clean:
	rm -rf models/base models/candidate checkpoints data/raw data/validated data/shards eval .prefect site
	find reports -mindepth 1 -maxdepth 1 ! -name metrics -exec rm -rf {} + 2>/dev/null || true
