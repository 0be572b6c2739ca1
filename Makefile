# The README's commands, `make demo`, `make test`, `make test-fast` and `make test-workloads`,
# all set up first.
.PHONY: setup test test-fast test-workloads demo bench clean

setup:
	@bash deploy/scripts/setup.sh

# Everything but the PyTorch tier.
test: setup
	.venv/bin/python -m pytest -m "not training" $(PYTEST_ARGS)

# The PyTorch tier: torch in its own venv (deploy/scripts/setup-torch.sh), then its tests.
test-workloads: setup
	REVENANT_TORCH_PYTHON=$$(bash deploy/scripts/setup-torch.sh) .venv/bin/python -m pytest -m training $(PYTEST_ARGS)

# The unit tier alone: pure logic, no nats-server, no criu, no cluster; a few seconds.
# The unit tier, its property tests at a fifth of their examples (tests/helpers.py examples).
# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE): the
# assertion rewriting and compiling of every module are a third of the tier's time, and the
# run before every commit should pay them once.
test-fast: setup
	PYTHONDONTWRITEBYTECODE= REVENANT_TEST_EXAMPLES=0.2 .venv/bin/python -m pytest -m unit $(PYTEST_ARGS)

demo: setup
	@bash deploy/scripts/demo.sh

clean:
	rm -rf .venv .pytest_cache .hypothesis build *.egg-info
