# The two commands of the README. Both set up .venv first (a no-op when it is current).
.PHONY: quickstart test venv

venv:
	bash scripts/install.sh

quickstart: venv
	.venv/bin/mcore-rl train configs/quickstart.yaml

test: venv
	.venv/bin/python -m pytest
