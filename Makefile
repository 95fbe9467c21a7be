# The two commands of the README's quick start. Each sets up what it needs first.
.PHONY: run test

PROMPT ?= What is the capital of France? Answer in one sentence.

run:
	@scripts/bootstrap.sh
	.venv/bin/rjax generate "$(PROMPT)"

test:
	@scripts/bootstrap.sh oracle
	.venv/bin/python -m pytest -n 2 $(PYTEST_ARGS)
