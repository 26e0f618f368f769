# Fresh-machine entry points. Both create and use .venv in the checkout.
#   make demo  — the main job: async RL end to end in one process (embedded bus, CPU, a few minutes)
#   make test  — start Kafka if it is not running, then run the whole test suite (Kafka + Redis tests fail, never skip)
#   make up    — start a local Kafka (KRaft) and create the rlbus topics
#   make distributed — the whole loop as separate processes (`rlbus up`: Kafka, Redis, blobs, every role)
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export RLBUS_KAFKA_BOOTSTRAP ?= 127.0.0.1:9092

.PHONY: venv demo up distributed test lint bench-bus bench-codec

$(BIN)/rlbus: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(BIN)/rlbus

demo: venv
	$(BIN)/rlbus demo

up: venv
	$(BIN)/rlbus kafka start
	$(BIN)/rlbus topics create
	$(BIN)/rlbus topics list

distributed: venv
	$(BIN)/rlbus up

test: venv
	$(BIN)/rlbus kafka start --port $(lastword $(subst :, ,$(RLBUS_KAFKA_BOOTSTRAP)))
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check rlbus tests
	$(BIN)/mypy rlbus

bench-bus: venv
	$(BIN)/rlbus bench bus --json bench/bus.json

bench-codec: venv
	$(BIN)/rlbus bench codec --json bench/codec.json
