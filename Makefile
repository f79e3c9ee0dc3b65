# Distributed Training Playbook. `make` alone lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Passed through to torchrun and the scripts: the same target runs on a laptop, a GPU box and
# across nodes (run it once per node with NODE_RANK=0..NNODES-1 and the same MASTER_ADDR).
comma := ,
GPUS := $(if $(CUDA_VISIBLE_DEVICES),$(words $(subst $(comma), ,$(CUDA_VISIBLE_DEVICES))),$(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU'))
NPROC ?= $(if $(filter-out 0,$(GPUS)),$(GPUS),2)
NNODES ?= 1
NODE_RANK ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29500
SIZE ?= small
STEPS ?=
ARGS ?=
LINK ?=
# TRACE=1: every training script also writes a Chrome trace per rank (--trace); `make traces`
# then shows where each step's time went.
TRACE ?=

# LINK=1gbit (any rate tc accepts): each launch runs in a private network namespace whose
# loopback is rate-limited with tc, so the ranks on this host talk as over a slow link. All
# traffic stays on 127.0.0.1; the shaped loopback carries both directions, so LINK is the
# link's total rate. Records carry it as `link`.
ifdef LINK
TBF := tc qdisc add dev lo root tbf rate $(LINK) burst 1mb latency 50ms
LINK_PROBLEM := $(shell \
	if [ "$(NNODES)" != 1 ]; then echo "LINK shapes this host's loopback: use it with NNODES=1"; \
	elif ! command -v tc >/dev/null || ! command -v ip >/dev/null; then \
		echo "LINK needs tc and ip: apt-get install iproute2, or drop LINK"; \
	elif ! unshare --net true 2>/dev/null; then \
		echo "LINK needs a private network namespace (unshare --net): run as root, or drop LINK"; \
	elif ! unshare --net $(TBF) 2>/dev/null; then \
		echo "LINK=$(LINK) is not a rate tc accepts: use e.g. LINK=1gbit or LINK=100mbit"; fi)
ifneq ($(LINK_PROBLEM),)
$(error $(LINK_PROBLEM))
endif
SHAPED := unshare --net -- sh -c 'ip link set lo up && $(TBF) && exec "$$@"' shaped
endif
export PLAYBOOK_LINK := $(LINK)

# PYTHON=/path/to/python uses an interpreter that already has the requirements (a GPU box with
# PyTorch preinstalled); otherwise a virtual environment is made once in .venv.
ifdef PYTHON
PY := $(PYTHON)
INSTALLED :=
else
PY := .venv/bin/python
INSTALLED := .venv/.installed
endif

FOLDERS := $(sort $(patsubst %/,%,$(wildcard [0-9][0-9]_*/)))
TECHNIQUES := $(foreach f,$(FOLDERS),$(word 2,$(subst _, ,$(f))))
SCRIPT_FLAGS := --size $(SIZE) $(if $(STEPS),--steps $(STEPS)) $(if $(TRACE),--trace) $(ARGS)
# RESTARTS=1: torchrun restarts the whole group (same flags) when a process dies; a script run
# with --resume then continues from its last checkpoint. RDZV=c10d: elastic c10d rendezvous at
# MASTER_ADDR:MASTER_PORT (ranks assigned at rendezvous, NODE_RANK unused) instead of static.
RESTARTS ?= 0
RDZV ?=
ifeq ($(RDZV),c10d)
RENDEZVOUS := --rdzv-backend=c10d --rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT) --rdzv-id=playbook
else ifeq ($(RDZV),)
RENDEZVOUS := --node_rank=$(NODE_RANK) --master_addr=$(MASTER_ADDR) --master_port=$(MASTER_PORT)
else
$(error RDZV=$(RDZV) is not a rendezvous this Makefile knows: use RDZV=c10d, or leave it unset)
endif
TORCHRUN := $(PY) -m torch.distributed.run --nproc_per_node=$(NPROC) --nnodes=$(NNODES) \
	--max-restarts=$(RESTARTS) $(RENDEZVOUS)
# torchrun sets this to 1 anyway (with a warning); the scripts size their thread pools per rank.
export OMP_NUM_THREADS ?= 1

.PHONY: help install all report traces plan list test clean distclean fsdp-ablation \
	$(TECHNIQUES)

help:
	@echo "Distributed Training Playbook"
	@echo
	@echo "  make all report     run every folder under torchrun, then print the results table"
	@echo "  make test           CPU-only test suite (lint, unit and 2-process launch tests)"
	@echo "  make <technique>    one folder: $(TECHNIQUES)"
	@echo "  make fsdp-ablation  03_fsdp's FP8 / activation checkpointing rows, one flag apart"
	@echo "  make report         table of outputs/results.jsonl, also written to outputs/report.md"
	@echo "                      with charts in outputs/charts/"
	@echo "  make traces         where each traced step's time went (after make all TRACE=1)"
	@echo "  make plan ARGS='--params 7e9 --gpus 8 --gpu-mem 80'   which strategy fits, and its bytes"
	@echo "  make list           every script with the first line of its docstring"
	@echo "  make install        create .venv and install requirements.txt (run targets do it)"
	@echo "  make clean          remove outputs/;  make distclean also removes .venv"
	@echo
	@echo "Variables: NPROC=$(NPROC) NNODES=$(NNODES) NODE_RANK=$(NODE_RANK)" \
		"MASTER_ADDR=$(MASTER_ADDR) MASTER_PORT=$(MASTER_PORT)"
	@echo "           SIZE=$(SIZE) (tiny|small|medium|large) STEPS=$(STEPS) ARGS='$(ARGS)'" \
		"PYTHON=$(PY) LINK=$(LINK) (e.g. 1gbit: a rate-limited loopback) TRACE=$(TRACE)"
	@echo "           RESTARTS=$(RESTARTS) (torchrun --max-restarts) RDZV=$(RDZV) (c10d: elastic" \
		"rendezvous)"
	@echo "Example:   make ddp report NPROC=4 SIZE=medium ARGS='--dtype bf16'"

install: $(INSTALLED)
ifdef PYTHON
	@$(PY) -c "import torch, tabulate, matplotlib" || { echo "$(PYTHON) lacks the requirements:" \
		"pip install -r requirements.txt, or drop PYTHON= to use .venv"; exit 1; }
endif

.venv/.installed: requirements.txt
	python3 -m venv .venv
	.venv/bin/pip install -r requirements.txt
	touch $@

all: $(TECHNIQUES)

# Runs a folder makes beyond one per script, as "script flags": PyTorch's own implementation of
# a second technique beside the hand-written one (the script's default runs anyway).
EXTRA_RUNS_zero := "04_zero/optimized_zero_pytorch.py --stage 3"
EXTRA_RUNS_pipeline := "05_pipeline/optimized_pipeline_pytorch.py --schedule 1f1b" \
	"05_pipeline/optimized_pipeline_pytorch.py --schedule dualpipev"

# One folder: every baseline, then every optimized script (then its extra runs), each under
# torchrun. A failing run prints its whole log, is recorded as failed, and fails the target after
# the others ran. Only node 0 holds rank 0, which prints and records; other nodes keep own logs.
LOG_SUFFIX := $(if $(filter-out 1,$(NNODES)),.node$(NODE_RANK))$(if $(LINK),.$(LINK))
$(TECHNIQUES): %: install
	@mkdir -p outputs/logs; status=0; folder=$(filter %_$@,$(FOLDERS)); \
	for run in $$(ls $$folder/baseline_*.py) $$(ls $$folder/optimized_*.py) $(EXTRA_RUNS_$@); do \
		script=$${run%% *}; flags=$${run#$$script}; \
		log=outputs/logs/$$(basename $$script .py)$$(echo $$flags | tr -d ' ')$(LOG_SUFFIX).log; \
		since=$$(date +%s); \
		echo "== $$script$$flags: $(NNODES) node(s) x $(NPROC) process(es), size $(SIZE)$(if $(LINK),$(comma) link $(LINK)) -> $$log"; \
		$(SHAPED) $(TORCHRUN) $$script $(SCRIPT_FLAGS) $$flags 2>&1 | tee $$log \
			| { grep --line-buffered -E '^(step |[a-z0-9_]+: |skipped: |one step|rank +[0-9]+ \|)'; \
			true; }; \
		if [ $${PIPESTATUS[0]} -ne 0 ]; then \
			echo "-- $$log:"; cat $$log; echo "FAILED: $$script$$flags (log: $$log)"; status=1; \
			if [ $(NODE_RANK) -eq 0 ]; then $(PY) common.py mark-failed $$script \
				--since $$since --world-size $$(( $(NPROC) * $(NNODES) )) \
				--reason "torchrun failed, see $$log" -- $(SCRIPT_FLAGS) $$flags; fi; \
		fi; \
	done; exit $$status

# 03_fsdp's FP8 / activation-checkpointing ablation: the folder (optimized_fsdp_fp8 with both),
# then the three other rows, each one flag apart; `make report` shows them as one table.
fsdp-ablation: fsdp
	@for flags in --no-checkpointing --no-fp8 "--no-fp8 --no-checkpointing"; do \
		log=outputs/logs/optimized_fsdp_fp8$$(echo $$flags | tr -d ' ')$(LOG_SUFFIX).log; \
		echo "== 03_fsdp/optimized_fsdp_fp8.py $$flags -> $$log"; \
		$(SHAPED) $(TORCHRUN) 03_fsdp/optimized_fsdp_fp8.py $(SCRIPT_FLAGS) $$flags > $$log 2>&1 \
			|| { cat $$log; echo "FAILED: optimized_fsdp_fp8 $$flags (log: $$log)"; exit 1; }; \
		grep -E '^[a-z0-9_]+: ' $$log; \
	done

report: install
	@$(PY) report.py

traces: install
	@$(PY) report.py traces

plan: install
	@$(PY) report.py plan $(ARGS)

list: install
	@$(PY) report.py list

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest

clean:
	rm -rf outputs .pytest_cache .ruff_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf .venv
