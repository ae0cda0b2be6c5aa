# Every target sets itself up: a fresh clone needs only `make serve` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on this kind of machine's disk. On a GPU machine with its own CUDA torch
# in the environment, use `make install TORCH=` (keep it) or `TORCH=torch==X.Y.Z+cuNNN` with your index.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
# Pipecat's own environment for tests/test_pipecat.py: pipecat-ai pins protobuf < 7, the gRPC toolchain needs >= 7.
PIPECAT := .venv-pipecat
PIPECAT_STAMP := $(PIPECAT)/.installed
STUBS := specrpc/v1/generator_pb2.py
PROTOS := $(wildcard proto/specrpc/v1/*.proto)
ARGS ?=
PYTEST_ARGS ?=
# The suite runs its test files on this many processes (pytest-xdist): most tests wait on a server's start or
# stream on one thread, so one process kept a 2-core AMD EPYC 84-98 % busy of 200; on two the suite took 11.5 and
# 16 minutes there, on one 21-30 minutes.
TEST_WORKERS ?= 2
TS := clients/typescript
# npm writes this file on every install, so it is newer than the lock file once node_modules matches it.
TS_DEPS := $(TS)/node_modules/.package-lock.json

.PHONY: install proto serve test test-ts lint models bench gpu-check fuzz soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt setup.py clients/python/pyproject.toml
	@if [ -n "$(TORCH)" ]; then $(BIN)/pip install -q "$(TORCH)"; fi
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	$(BIN)/pip install -q -c constraints.txt -e clients/python
	$(BIN)/python -m specrpc.native
	touch $(STAMP)

$(PIPECAT_STAMP): tests/pipecat/requirements.txt tests/pipecat/constraints.txt
	$(PYTHON) -m venv $(PIPECAT)
	$(PIPECAT)/bin/pip install -q -c tests/pipecat/constraints.txt -r tests/pipecat/requirements.txt
	touch $(PIPECAT_STAMP)

$(STUBS): $(STAMP) $(PROTOS) tools/gen_proto.py
	$(BIN)/python tools/gen_proto.py
	$(BIN)/python clients/python/gen_stubs.py

install: $(STAMP) $(STUBS) $(PIPECAT_STAMP)

proto: $(STAMP)
	$(BIN)/python tools/gen_proto.py
	$(BIN)/python clients/python/gen_stubs.py

serve: install
	$(BIN)/specrpc serve $(ARGS)

test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-ts

$(TS_DEPS): $(TS)/package.json $(TS)/package-lock.json
	cd $(TS) && npm ci --no-audit --no-fund

# The TypeScript client against a real `specrpc serve` (same models: SPECRPC_TARGET/SPECRPC_DRAFT pass through).
test-ts: install $(TS_DEPS)
	cd $(TS) && npm test

# Style and types, the architecture (import-linter's contracts in .importlinter, no import cycle), dead code.
lint: install
	$(BIN)/ruff check specrpc tests tools clients/python
	$(BIN)/mypy specrpc
	$(BIN)/lint-imports
	$(BIN)/python tools/check_cycles.py
	$(BIN)/vulture specrpc tools/vulture_whitelist.py --min-confidence 60 --exclude specrpc/v1
	@[ -x .tools/node_modules/.bin/buf ] || npm install --prefix .tools --no-save --silent @bufbuild/buf@1
	cd proto && ../.tools/node_modules/.bin/buf lint

models: install
	$(BIN)/python -m specrpc.training.train $(ARGS)
	$(BIN)/python -m specrpc.training.evaluate

bench: install
	$(BIN)/specrpc bench $(ARGS)

# The long deep fuzz (tests/test_fuzz_deep.py; the suite runs 2,000): N requests over both edges, both models.
N ?= 100000
fuzz: install
	$(BIN)/python -c 'from specrpc.training.lock import refuse_beside_training as r; r("make fuzz")'
	SPECRPC_FUZZ_REQUESTS=$(N) $(BIN)/python -m pytest tests/test_fuzz_deep.py -x -q -s -p no:cacheprovider $(PYTEST_ARGS)

# The mixed-traffic soak on both edges (tools/soak.py): HOURS of editor, voice, chat, completion and hostile clients
# against a server it starts; RSS each minute, latency per kind per ten minutes, hung streams; exit 1 on a failure.
HOURS ?= 1
soak: install
	$(BIN)/python tools/soak.py --duration $$(awk 'BEGIN { print $(HOURS) * 3600 }') --json soak.json $(ARGS)

# The prepared device run of issue 17 (CUDA tests, shipped-pair and realistic-size benchmarks, gRPC from a separate
# client process) into OUT; needs no network. Rehearse on a CPU: make gpu-check ARGS="--device cpu --quick".
gpu-check:
	tools/gpu_check.sh $(ARGS) $(OUT)

clean:
	rm -rf $(VENV) $(PIPECAT) specrpc/v1 clients/python/specrpc_client/_gen .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
