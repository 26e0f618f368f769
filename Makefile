# Fresh-machine entry points. Both create and use .venv in the checkout.
#   make demo  — the main job: async RL end to end in one process (embedded bus, CPU, a few minutes)
#   make test  — install the missing system packages (infra/install-deps.sh; a non-root user is told the command),
#                start Kafka if it is not running, then run the whole test suite (Kafka + Redis tests fail, never skip)
#   make deps  — only the system packages step of `make test`
#   make up    — start a local Kafka (KRaft) and create the rlbus topics
#   make distributed — the whole loop as separate processes (`rlbus up`: Kafka, Redis, blobs, every role)
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export RLBUS_KAFKA_BOOTSTRAP ?= 127.0.0.1:9092

.PHONY: deps venv demo up distributed test lint bench-bus bench-codec

$(BIN)/rlbus: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[dev]'
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

test: deps venv
	$(BIN)/rlbus kafka start --port $(lastword $(subst :, ,$(RLBUS_KAFKA_BOOTSTRAP)))
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check rlbus tests
	$(BIN)/mypy rlbus

bench-bus: venv
	$(BIN)/rlbus bench bus --json bench/bus.json

bench-codec: venv
	$(BIN)/rlbus bench codec --json bench/codec.json
