# Human entry points. Everything installs itself on a fresh Debian 12 machine (as root).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: lock install install-run services stop run test test-fast test-reconcile lint bench bench-memory bench-growth bench-reconcile image clean docs mutation mutation-diff sql-mutation fuzz test-investigations

## make lock [LOCK_UPGRADE=1]: refresh the hashed lock files requirements/*.txt from
## pyproject.toml (uv, in its own .venv-lock); make install / CI / the Dockerfile install
## exactly them with pip --require-hashes. Commit the result.
lock:
	LOCK_UPGRADE=$(LOCK_UPGRADE) scripts/lock.sh

install:
	scripts/install.sh

## make install-run: what `make run` needs only (PostgreSQL, runtime deps, the SQS emulator)
install-run:
	scripts/install.sh run

## make services: PostgreSQL starts while the venv is built (neither needs the other)
services:
	scripts/install.sh run debian
	set -e; scripts/services.sh postgres & pg=$$!; scripts/install.sh run python; wait $$pg; \
	  scripts/services.sh start

stop:
	scripts/services.sh stop

## make run: local PostgreSQL + moto SQS, migrations, sample messages, daemon in the foreground
run: services
	source .run/env && export INGEST_LOG_FORMAT=$${INGEST_LOG_FORMAT:-console} INGEST_LOG_LEVEL=$${INGEST_LOG_LEVEL:-debug} \
	  INGEST_HTTP_PORT=$${INGEST_HTTP_PORT:-9102} INGEST_S3_BUCKETS=$${INGEST_S3_BUCKETS:-sqs-ingest-payloads} \
	  && $(VENV)/bin/sqs-ingest migrate \
	  && $(VENV)/bin/sqs-ingest produce --count 20 \
	  && exec $(VENV)/bin/sqs-ingest run

## make test: the whole suite (starts its own PostgreSQL and SQS emulator per session)
## Strict: a skipped test fails the run (tests/conftest.py), and so does a missing deploy tool.
## TEST_WORKERS (default 2) pytest-xdist workers, one test file per worker at a time; each
## worker starts its own PostgreSQL and emulators. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: install
	INGEST_TESTS_STRICT=1 DEPLOY_TOOLS_REQUIRED=1 $(PY) -m pytest -q -rs -m "not investigation and not sql_mutation" \
	  -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

## make test-investigations: open findings (README "Known issues"), expected to fail for now
## (none collected — pytest's exit 5 — means no open finding: success)
test-investigations: install
	$(PY) -m pytest -q -rxs -m investigation $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no open investigations"; else exit $$rc; fi

test-fast: install
	$(PY) -m pytest -q -rs -m "not chaos and not spark and not container and not investigation and not sql_mutation" $(PYTEST_ARGS)

## make bench [N=20000] [LATENCY_MS=20] [SOAK=600] [BASELINE=<ref>] [RESULTS=1]: ceiling vs naive vs daemon,
## side by side; BASELINE adds old-vs-new drains, RESULTS=1 results-out on-vs-off drains (ABBA)
bench: install
	$(PY) bench/throughput.py

## make bench-memory [POINTERS=40] [PAYLOAD_BYTES=6291456] [INLINE=200] [SHAPE=blob|records]:
## issue 20's memory phase — the daemon with its defaults drains pointers to large S3 payloads
## plus inline messages: peak RSS against deploy/k8s's limit, every entity as sent, exit 0 on
## SIGTERM, drain time against the same backlog of small payloads; and bench/payload_memory.py
## (raw bytes -> RSS per JSON shape). Exits 1 over the limit.
bench-memory: install
	$(PY) bench/payload_memory.py
	$(PY) bench/memory_budget.py

## make fuzz [FUZZ_EXAMPLES=2000] [FUZZ_SEED=16]: the hostile-body fuzzer with a larger budget
fuzz: install
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-2000} $(PY) -m pytest -q -s tests/integration/test_fuzz.py

## make mutation [MUTATION_THRESHOLD=90] [MUTATION_CHILDREN=1] [RESUME=1]: mutmut over the
## exactly-once modules ([tool.mutmut] in pyproject.toml) on one shared PostgreSQL, niced; fails
## under the threshold or when any mutant was not checked (tests/mutation_gate.py). Hours
## (docs/mutation.md): RESUME=1 keeps mutants/ and checks only what is not checked yet, or
## whose function changed since (mutmut's own per-function hashes); stopping it loses nothing.
## RECHECK=1 (with RESUME=1) checks the survived and untested mutants again, against new tests.
MUTATION_THRESHOLD ?= 90
MUTATION_CHILDREN ?= 1
mutation: install
	$(if $(RESUME),[ ! -d mutants/tests ] || cp -a tests/. mutants/tests/,rm -rf mutants)
	nice -n 19 $(PY) -m tests.pg_for $(VENV)/bin/mutmut run --max-children $(MUTATION_CHILDREN) \
	  $(if $(RECHECK),$$($(PY) -m tests.mutation_gate survivors)); \
	  $(PY) -m tests.mutation_gate --threshold $(MUTATION_THRESHOLD)

## make mutation-diff BASE=<git ref>: the same gate over the mutants of the functions changed
## since BASE only (run it before submitting a change to a mutated module)
mutation-diff: install
	@test -n "$(BASE)" || { echo "usage: make mutation-diff BASE=<git ref>"; exit 2; }
	@globs="$$($(PY) -m tests.mutation_gate changed $(BASE))"; \
	if [ -z "$$globs" ]; then echo "no mutated function changed since $(BASE)"; exit 0; fi; \
	echo "functions changed since $(BASE):"; echo "$$globs"; \
	rm -rf mutants; \
	nice -n 19 $(PY) -m tests.pg_for $(VENV)/bin/mutmut run --max-children $(MUTATION_CHILDREN) $$globs; \
	$(PY) -m tests.mutation_gate --threshold $(MUTATION_THRESHOLD) --only $$globs

## make sql-mutation [FULL=1]: every SQL mutant (tests/sql_mutants.py) against the tests it
## names (~12 min here), or with FULL=1 against the whole contract + store selection (an hour+)
sql-mutation: install
	if [ -n "$(FULL)" ]; then nice -n 19 $(PY) -m tests.sql_mutants --full; \
	else nice -n 19 $(PY) -m pytest -q -p no:cacheprovider -m sql_mutation tests/integration/test_sql_mutants.py; fi

test-reconcile: install
	$(PY) -m pytest -q tests/reconcile

## make bench-growth [SIZES=0,1000000,10000000] [PRUNE_ROWS=1000000] [PRUNE_PAUSES=0,0.5]: the cost
## curve as the tables grow, and pruning while the daemon drains (bench/cost_curve.py)
bench-growth: install
	$(PY) bench/cost_curve.py

## make bench-reconcile: 1,000,000 modifications in each of two databases, local[2], the job against its read-only floor (bench/reconcile_floor.py), floor,job,job,floor
bench-reconcile: install
	$(PY) bench/reconcile_bench.py

## make image: sqs-ingest:latest and sqs-ingest-reconcile:latest from the Dockerfile, on a base
## image made here from Debian packages (no registry needed); starts a container engine if none
image:
	scripts/engine.sh start
	scripts/image.sh

lint: install
	$(VENV)/bin/ruff check service tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir $$(mktemp -d)

## make docs: regenerate docs/reference/ from the code (scripts/docs_reference.py), then build
## the documentation site (mkdocs-material) into site/ with --strict
docs: install
	$(PY) scripts/docs_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf .run .pytest_cache mutants
