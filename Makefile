# The two commands of the README:
#   make demo   install llmrun in .venv, put the default model in the store, ask it a question
#   make test   install the test dependencies, fetch the test model (cached), run the suite
#               (with an environment whose llama.cpp has the Vulkan backend, for the Vulkan
#               tests on Mesa's CPU driver: scripts/vulkan-env.sh; and Debian's Chromium for
#               the web page's tests: scripts/browser-env.sh). Where one cannot be built
#               its tests fail (tests/ci_groups.py); LLMRUN_TEST_SKIP=browser,vulkan skips
#               them on purpose
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo install test lint bench

demo: install
	$(BIN)/llmrun pull smollm2
	$(BIN)/llmrun run smollm2 "Why is the sky blue?"

install:
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	scripts/llama-wheel.sh $(BIN)/python
	$(BIN)/python -m pip install -q --disable-pip-version-check -e .

test: install
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	scripts/vulkan-env.sh $(BIN)/python $(VENV)-vulkan
	scripts/browser-env.sh
	$(BIN)/python scripts/fetch_test_models.py
	$(BIN)/ruff check llmrun tests scripts
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint:
	$(BIN)/ruff check llmrun tests scripts
