# `make train` and `make test` set themselves up on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
WORKDIR ?= runs/small
VISION_WORKDIR ?= runs/vision
SFT_WORKDIR ?= runs/sft
# `make sft` starts from `make train`'s checkpoint when there is one, else from a random init.
SFT_INIT ?= $(if $(wildcard $(WORKDIR)/checkpoints),$(WORKDIR))

.PHONY: install test train train-vision sft serve bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the local CPU wheel (any other torch pulls a CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 tests

train: $(STAMP)
	$(BIN)/python -m experiments.train --config=configs/small.py --workdir=$(WORKDIR)

# tiny_multimodal on the shapes corpus (CPU, minutes), then caption loss / word accuracy with
# the true vs shuffled images and vision_loss.png (docs/notes/vision_training.md).
train-vision: $(STAMP)
	$(BIN)/python -m experiments.train --config=configs/tiny_multimodal.py --workdir=$(VISION_WORKDIR)
	$(BIN)/python -m experiments.eval_vision --workdir=$(VISION_WORKDIR) --json=$(VISION_WORKDIR)/eval_vision.json

# SFT of `small` on the embedded chat tasks (docs/notes/sft.md): held-out exact match and
# parse rate before (eval_before.json) and after (eval_sft.json).
sft: $(STAMP)
	$(BIN)/python -m experiments.eval_sft $(if $(SFT_INIT),--checkpoint=$(SFT_INIT),--config=configs/sft_small.py) --json=$(SFT_WORKDIR)/eval_before.json
	$(BIN)/python -m experiments.sft --config=configs/sft_small.py --workdir=$(SFT_WORKDIR) $(if $(SFT_INIT),--init=$(SFT_INIT))
	$(BIN)/python -m experiments.eval_sft --checkpoint=$(SFT_WORKDIR) --json=$(SFT_WORKDIR)/eval_sft.json

# The OpenAI-compatible server on `make train`'s checkpoint (docs/notes/serve.md).
PORT ?= 8000
serve: $(STAMP)
	$(BIN)/python -m experiments.serve --checkpoint=$(WORKDIR) --port=$(PORT)

clean:
	rm -rf $(VENV) runs .pytest_cache
