# The README's commands, `make demo`, `make test` and `make test-fast`, all set up first.
.PHONY: setup test test-fast demo bench clean

setup:
	@bash deploy/scripts/setup.sh

test: setup
	.venv/bin/python -m pytest $(PYTEST_ARGS)

# The unit tier alone: pure logic, no nats-server, no criu, no cluster; a few seconds.
test-fast: setup
	.venv/bin/python -m pytest -m unit $(PYTEST_ARGS)

demo: setup
	@bash deploy/scripts/demo.sh

clean:
	rm -rf .venv .pytest_cache .hypothesis build *.egg-info
