# The two commands of the README's quick start. Each sets up what it needs first.
.PHONY: run test

PROMPT ?= What is the capital of France? Answer in one sentence.

run:
	@scripts/bootstrap.sh
	.venv/bin/rjax generate "$(PROMPT)"

# worksteal: each worker starts on a contiguous half of the tests (modules stay whole, their
# fixtures set up once) and an idle worker takes over half of the other's remaining tests.
test:
	@scripts/bootstrap.sh oracle
	.venv/bin/python -m pytest -n 2 --dist worksteal $(PYTEST_ARGS)
