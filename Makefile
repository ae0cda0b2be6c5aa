# Every target sets itself up: a fresh clone needs only `make serve` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on this kind of machine's disk. On a GPU machine with its own CUDA torch
# in the environment, use `make install TORCH=` (keep it) or `TORCH=torch==X.Y.Z+cuNNN` with your index.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
STUBS := specrpc/v1/generator_pb2.py
PROTOS := $(wildcard proto/specrpc/v1/*.proto)
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install proto serve test lint models bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt setup.py
	@if [ -n "$(TORCH)" ]; then $(BIN)/pip install -q "$(TORCH)"; fi
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

$(STUBS): $(STAMP) $(PROTOS) tools/gen_proto.py
	$(BIN)/python tools/gen_proto.py

install: $(STAMP) $(STUBS)

proto: $(STAMP)
	$(BIN)/python tools/gen_proto.py

serve: install
	$(BIN)/specrpc serve $(ARGS)

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check specrpc tests tools clients/python
	$(BIN)/mypy specrpc
	@[ -x .tools/node_modules/.bin/buf ] || npm install --prefix .tools --no-save --silent @bufbuild/buf@1
	cd proto && ../.tools/node_modules/.bin/buf lint

models: install
	$(BIN)/python -m specrpc.training.train $(ARGS)
	$(BIN)/python -m specrpc.training.evaluate

bench: install
	$(BIN)/specrpc bench $(ARGS)

clean:
	rm -rf $(VENV) specrpc/v1 .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
