# The README's two commands, `make demo` and `make test`, both set up first.
.PHONY: setup test demo bench clean

setup:
	@bash deploy/scripts/setup.sh

test: setup
	.venv/bin/python -m pytest $(PYTEST_ARGS)

demo: setup
	@bash deploy/scripts/demo.sh

clean:
	rm -rf .venv .pytest_cache .hypothesis build *.egg-info
