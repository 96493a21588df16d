# `make train` and `make test` set themselves up on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
WORKDIR ?= runs/small
VISION_WORKDIR ?= runs/vision

.PHONY: install test train train-vision bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the local CPU wheel (any other torch pulls a CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

train: $(STAMP)
	$(BIN)/python -m experiments.train --config=configs/small.py --workdir=$(WORKDIR)

# tiny_multimodal on the shapes corpus (CPU, minutes), then caption loss / word accuracy with
# the true vs shuffled images and vision_loss.png (docs/notes/vision_training.md).
train-vision: $(STAMP)
	$(BIN)/python -m experiments.train --config=configs/tiny_multimodal.py --workdir=$(VISION_WORKDIR)
	$(BIN)/python -m experiments.eval_vision --workdir=$(VISION_WORKDIR) --json=$(VISION_WORKDIR)/eval_vision.json

clean:
	rm -rf $(VENV) runs .pytest_cache
