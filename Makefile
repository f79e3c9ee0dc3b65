# Distributed Training Playbook. `make` alone lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# GPUS: what this host offers, as CUDA_VISIBLE_DEVICES (set, even empty) or nvidia-smi says.
# CPU=1 hides them and runs on CPU (gloo), also where torch cannot use them.
comma := ,
ifeq ($(CPU),1)
export CUDA_VISIBLE_DEVICES :=
endif
ifeq ($(origin CUDA_VISIBLE_DEVICES),undefined)
GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
else
GPUS := $(words $(subst $(comma), ,$(CUDA_VISIBLE_DEVICES)))
endif

# Passed through to torchrun and the scripts: the same target runs on a laptop, a GPU box and
# across nodes (run it once per node with NODE_RANK=0..NNODES-1 and the same MASTER_ADDR).
NPROC ?= $(if $(filter-out 0,$(GPUS)),$(GPUS),2)
NNODES ?= 1
NODE_RANK ?= 0
MASTER_ADDR ?= 127.0.0.1
# MASTER_PORT given: every run listens there. Not given, a single-node run (NNODES=1, RDZV unset)
# takes a free port of its own (two `make` runs on one host would both want 29500); across nodes
# and with RDZV it is 29500, which every node must agree on.
PORT_GIVEN := $(filter-out undefined,$(origin MASTER_PORT))
MASTER_PORT ?= 29500
SIZE ?= small
# MODEL=llama: every script on the Llama-style decoder (moe: its Mixture-of-Experts form; resnet:
# the CNN; each where it applies); unset,
# each script's default (the GPT).
MODEL ?=
STEPS ?=
ARGS ?=
LINK ?=
# TRACE=1: every training script also writes a Chrome trace per rank (--trace); `make traces`
# then shows where each step's time went.
TRACE ?=
# CALIBRATE=0: no quick calibration of the step-time model's rates before a target's runs
CALIBRATE ?= 1

FOLDERS := $(sort $(patsubst %/,%,$(wildcard [0-9][0-9]_*/)))
TECHNIQUES := $(foreach f,$(FOLDERS),$(word 2,$(subst _, ,$(f))))

# The variables a run uses, checked before anything starts: one line that says what to change.
RUN_GOALS := all smoke fsdp-ablation calibrate dryrun $(TECHNIQUES)
positive = $(shell [ "$(1)" -ge 1 ] 2>/dev/null && echo yes)
ifneq ($(filter $(RUN_GOALS),$(MAKECMDGOALS)),)
ifeq ($(filter $(SIZE),tiny small medium large),)
$(error SIZE=$(SIZE) is not a size: use tiny, small, medium or large)
endif
ifneq ($(filter-out gpt llama moe resnet,$(MODEL)),)
$(error MODEL=$(MODEL) is not a model: use gpt, llama, moe or resnet, or leave it unset)
endif
ifneq ($(call positive,$(NPROC)),yes)
$(error NPROC=$(NPROC) is not a number of processes: use 1 or more)
endif
ifneq ($(call positive,$(NNODES)),yes)
$(error NNODES=$(NNODES) is not a number of nodes: use 1 or more)
endif
ifneq ($(shell [ "$(NODE_RANK)" -ge 0 ] 2>/dev/null && [ "$(NODE_RANK)" -lt "$(NNODES)" ] && echo yes),yes)
$(error NODE_RANK=$(NODE_RANK) must be 0 to NNODES-1 ($(NNODES) nodes))
endif
ifneq ($(if $(STEPS),$(call positive,$(STEPS)),yes),yes)
$(error STEPS=$(STEPS) is not a number of steps: use 1 or more, or leave it unset)
endif
ifneq ($(filter smoke,$(MAKECMDGOALS)),)
ifneq ($(NNODES),1)
$(error smoke checks this host alone: run `make smoke` on each node, without NNODES)
endif
endif
endif

# LINK=1gbit (any rate tc accepts): each launch runs in a private network namespace whose
# loopback is rate-limited with tc, so the ranks on this host talk as over a slow link. All
# traffic stays on 127.0.0.1; the shaped loopback carries both directions, so LINK is the
# link's total rate. Records carry it as `link`. GPUs of one host talk over NVLink, PCIe or
# shared memory, not the loopback: there LINK would label a run slow that is not, so it refuses.
ifdef LINK
TBF := tc qdisc add dev lo root tbf rate $(LINK) burst 1mb latency 50ms
LINK_PROBLEM := $(shell \
	if [ "$(GPUS)" != 0 ]; then echo "LINK shapes the loopback, which NCCL does not use between" \
		"this host's GPUs (NVLink/PCIe/shared memory): drop LINK, or CPU=1 to shape gloo on CPU;" \
		"across nodes, a slow NIC (NCCL_SOCKET_IFNAME, NCCL_IB_DISABLE=1) is the slow link"; \
	elif [ "$(NNODES)" != 1 ]; then echo "LINK shapes this host's loopback: use it with NNODES=1"; \
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

SCRIPT_FLAGS := --size $(SIZE) $(if $(MODEL),--model $(MODEL)) $(if $(STEPS),--steps $(STEPS)) $(if $(TRACE),--trace) $(ARGS)
# RESTARTS=1: torchrun restarts the whole group (same flags) when a process dies; a script run
# with --resume then continues from its last checkpoint. RDZV=c10d: elastic c10d rendezvous at
# MASTER_ADDR:MASTER_PORT (ranks assigned at rendezvous, NODE_RANK unused) instead of static.
RESTARTS ?= 0
RDZV ?=
ifeq ($(RDZV),c10d)
RENDEZVOUS := --rdzv-backend=c10d --rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT) --rdzv-id=playbook
else ifeq ($(RDZV),)
FREE_PORT := $(if $(PORT_GIVEN)$(filter-out 1,$(NNODES)),,yes)
RENDEZVOUS := --node_rank=$(NODE_RANK) --master_addr=$(MASTER_ADDR) --master_port=$$port
else
$(error RDZV=$(RDZV) is not a rendezvous this Makefile knows: use RDZV=c10d, or leave it unset)
endif
TORCHRUN := $(PY) -m torch.distributed.run --nproc_per_node=$$nproc --nnodes=$(NNODES) \
	--max-restarts=$(RESTARTS) $(RENDEZVOUS)
# torchrun sets this to 1 anyway (with a warning); the scripts size their thread pools per rank.
export OMP_NUM_THREADS ?= 1

.PHONY: help install preflight all smoke report traces plan list test fix-copies clean \
	distclean fsdp-ablation calibrate calibrated dryrun $(TECHNIQUES)

# `make foo`: make's own answer ("No rule to make target") says nothing of what there is.
GOALS := help install preflight all smoke report traces plan list test fix-copies clean \
	distclean fsdp-ablation calibrate calibrated dryrun $(TECHNIQUES) $(INSTALLED)
ifneq ($(filter-out $(GOALS),$(MAKECMDGOALS)),)
$(error no target '$(firstword $(filter-out $(GOALS),$(MAKECMDGOALS)))': run `make` for the list)
endif

help:
	@echo "Distributed Training Playbook"
	@echo
	@echo "  make smoke          first thing on a new host: every script, 6 steps at tiny, one"
	@echo "                      line each (ok / skipped: why / FAILED: its error)"
	@echo "  make all report     run every folder under torchrun, then print the results table"
	@echo "  make test           CPU-only test suite (lint, unit and 2-process launch tests)"
	@echo "  make <technique>    one folder: $(TECHNIQUES)"
	@echo "  make fsdp-ablation  03_fsdp's FP8 / activation checkpointing rows, one flag apart"
	@echo "  make report         table of outputs/results.jsonl, also written to outputs/report.md"
	@echo "                      with charts in outputs/charts/"
	@echo "  make traces         where each traced step's time went (after make all TRACE=1)"
	@echo "  make calibrate      this host's rates for the step-time model, every world and decoder,"
	@echo "                      into outputs/calibration.json (each target takes a quick one first)"
	@echo "  make plan ARGS='--params 7e9 --gpus 8 --gpu-mem 80'   which strategy fits, and its bytes"
	@echo "  make plan           the planner's picks for ResNet-50, GPT-2 1.5B, LLaMA-7B, 70B (--cases)"
	@echo "  make list           every script with the first line of its docstring"
	@echo "  make dryrun         every script as rank 0 of 8 and of 64 GPUs on this CPU (fake"
	@echo "                      tensors), then the planner's seed models at their worlds"
	@echo "  make fix-copies     rewrite every '# Copied from' copy from its source (a changed one stays)"
	@echo "  make install        create .venv and install requirements.txt (run targets do it)"
	@echo "  make clean          remove outputs/;  make distclean also removes .venv"
	@echo
	@echo "Variables: NPROC=$(NPROC) NNODES=$(NNODES) NODE_RANK=$(NODE_RANK)" \
		"MASTER_ADDR=$(MASTER_ADDR) MASTER_PORT=$(if $(FREE_PORT),(a free one a run),$(MASTER_PORT))"
	@echo "           SIZE=$(SIZE) (tiny|small|medium|large) MODEL=$(MODEL) (gpt|llama|moe|resnet)" \
		"STEPS=$(STEPS) ARGS='$(ARGS)'" \
		"PYTHON=$(PY) LINK=$(LINK) (e.g. 1gbit: a rate-limited loopback) TRACE=$(TRACE)"
	@echo "           RESTARTS=$(RESTARTS) (torchrun --max-restarts) RDZV=$(RDZV) (c10d: elastic" \
		"rendezvous) CPU=$(CPU) (1: hide the GPUs, run on CPU) CALIBRATE=$(CALIBRATE) (0: no" \
		"quick calibration before the runs)"
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

# first a quick calibration of every world the folders run (each folder's own then finds it)
all: calibrated $(TECHNIQUES)

# Runs a folder makes beyond one per script, as "script flags" (the script's default runs
# anyway): PyTorch's own implementation of a second technique beside the hand-written one; a
# row that takes one change of two apart; a setting where the technique's cost is most of a step.
EXTRA_RUNS_zero := "04_zero/optimized_zero_pytorch.py --stage 3" \
	"04_zero/optimized_zero_pytorch.py --stage 3 --cpu-offload"
# 03's fine-tuning: a pretraining run saved after its 160th step, then full fine-tuning
# (optimized_fsdp) and LoRA from it on the fine-tuning task (the attention's adapters, then the
# MLP's too), where LoRA's own run (from random weights) shows what the pretrained start is
# worth. A decoder's: the task is its tokens.
# `make smoke` runs them at tiny into outputs/smoke/; the pretraining's warm-up is its own, so
# that its 160th step (the save) comes whatever warm-up the other runs take.
PRETRAINED := $(strip $(if $(filter smoke,$(MAKECMDGOALS)),\
	outputs/smoke/pretrained/$(or $(MODEL),gpt)-tiny,outputs/pretrained/$(or $(MODEL),gpt)-$(SIZE)))
EXTRA_RUNS_fsdp := $(if $(filter resnet,$(MODEL)),,\
	"03_fsdp/optimized_fsdp_checkpoint.py --warmup 5 --steps 155 --checkpoint-every 160 --checkpoint-dir $(PRETRAINED)" \
	"03_fsdp/optimized_fsdp.py --init-from $(PRETRAINED)" \
	"03_fsdp/optimized_fsdp_lora.py --init-from $(PRETRAINED)" \
	"03_fsdp/optimized_fsdp_lora.py --init-from $(PRETRAINED) --lora-mlp")
# PowerSGD where it is meant to run: 110 steps beside the baseline's 110, at rank 8 (10x fewer
# bytes at `small`), judged by its final loss; on the GPT, where 110 steps settle (README).
# DiLoCo: in 4 streamed fragments at the folder's 25 steps (its largest exchange); beside the
# long pair, syncing every 16 steps, in fp32 and in int8, judged by its final loss, and at the
# paper's outer momentum beside the script's.
EXTRA_RUNS_compression := $(if $(filter-out gpt,$(MODEL)),,\
	"02_compression/baseline_compression.py --long-run" \
	"02_compression/optimized_compression_powersgd.py --rank 8 --long-run" \
	"02_compression/optimized_compression_diloco.py --fragments 4" \
	"02_compression/optimized_compression_diloco.py --long-run" \
	"02_compression/optimized_compression_diloco.py --quantize int8 --long-run" \
	"02_compression/optimized_compression_diloco.py --outer-momentum 0.9 --long-run")
# 06's short token batches are a decoder's (a ResNet's BatchNorm needs two images a rank).
EXTRA_RUNS_symmem := "06_symmem/optimized_symmem_training.py --replicated-optimizer" \
	$(if $(filter resnet,$(MODEL)),,"06_symmem/baseline_symmem_training.py --batch-size 1 --seq-len 32" \
	"06_symmem/optimized_symmem_training.py --batch-size 1 --seq-len 32" \
	"06_symmem/optimized_symmem_training.py --batch-size 1 --seq-len 32 --replicated-optimizer")
EXTRA_RUNS_pipeline := "05_pipeline/optimized_pipeline_zb.py --zbv" \
	"05_pipeline/optimized_pipeline_pytorch.py --schedule 1f1b" \
	"05_pipeline/optimized_pipeline_pytorch.py --schedule interleaved" \
	"05_pipeline/optimized_pipeline_pytorch.py --schedule zb" \
	"05_pipeline/optimized_pipeline_pytorch.py --schedule zbv" \
	"05_pipeline/optimized_pipeline_pytorch.py --schedule dualpipev"
# 07's lengths by size: the long-context length (common.SIZES' long_seq_len, the folder's
# default), and one where attention is most of a step, for the balance and overlap rows.
size_value = $(word 2,$(subst :, ,$(filter $(SIZE):%,$(1))))
CONTEXT_SEQ := $(call size_value,tiny:128 small:768 medium:4096 large:4096)
ATTENTION_SEQ := $(call size_value,tiny:1024 small:6144 medium:16384 large:16384)
CONTEXT_SEQ_2X := $(shell echo $$(( 2 * $(CONTEXT_SEQ) )))
CONTEXT_SEQ_4X := $(shell echo $$(( 4 * $(CONTEXT_SEQ) )))
# a few steps: five timed ones (each ten seconds at small), the fewest a speedup in the report
# rests on (report/results_table.py, MIN_TIMED_STEPS); or a row for its memory alone, taken at
# the last warm-up step (the second: AdamW's state exists by then), whose time nothing compares
SHORT_RUN := --steps 5 --warmup 1
MEMORY_RUN := --steps 2 --warmup 2
# zigzag against the unbalanced ring and the blocking exchange, where attention dominates; then
# twice the length on 2 processes (the memory table: the baseline's wall, the two ways past it)
EXTRA_RUNS_context := \
	"07_context/optimized_context_ring.py --seq-len $(ATTENTION_SEQ) $(SHORT_RUN)" \
	"07_context/optimized_context_ring.py --seq-len $(ATTENTION_SEQ) $(SHORT_RUN) --balance none" \
	"07_context/optimized_context_ring.py --seq-len $(ATTENTION_SEQ) $(SHORT_RUN) --no-overlap" \
	"07_context/baseline_context.py --seq-len $(CONTEXT_SEQ_2X) $(MEMORY_RUN)" \
	"07_context/optimized_context_ring.py --seq-len $(CONTEXT_SEQ_2X) --batch-size 1 $(MEMORY_RUN)" \
	"07_context/optimized_context_ulysses.py --seq-len $(CONTEXT_SEQ_2X) --batch-size 1 $(MEMORY_RUN)"

# Runs on a mesh of several dims, each after a DDP baseline of its world: on CPU at the smallest
# world that has every dim with dp >= 2 (03's dp x tp: 4 processes; 05's pp x dp x tp: 8), on
# GPUs at NPROC. Scripts only these runs start are left out of the folder's NPROC runs. An entry
# may carry flags, as "script flags" (a run at a length only the mesh's world holds).
# 08's balance rows: 40 steps, for the model to learn past its first routing and the routers'
# bias to settle, with bias balancing and without.
EXTRA_RUNS_moe := "08_moe/optimized_moe_ep.py --long-run" \
	"08_moe/optimized_moe_ep.py --long-run --moe-balance none"
MESH_RUNS_fsdp := 03_fsdp/baseline_fsdp.py 03_fsdp/optimized_fsdp_tp.py
MESH_RUNS_pipeline := 05_pipeline/baseline_pipeline_3d.py 05_pipeline/optimized_pipeline_3d.py
# 07: cp 4 at the baseline's batch, dp 2 x cp 2 sharded by FSDP2, and cp 4 at four times the
# length, one sequence a group
MESH_RUNS_context := 07_context/baseline_context.py 07_context/optimized_context_ring.py \
	07_context/optimized_context_ulysses.py "07_context/optimized_context_ring.py --cp 2 --fsdp" \
	"07_context/optimized_context_ring.py --seq-len $(CONTEXT_SEQ_4X) --batch-size 1 $(MEMORY_RUN)" \
	"07_context/optimized_context_ulysses.py --seq-len $(CONTEXT_SEQ_4X) --batch-size 1 $(MEMORY_RUN)"
MESH_RUNS_moe := 08_moe/baseline_moe.py 08_moe/optimized_moe_ep.py \
	"08_moe/optimized_moe_ep.py --ep 2 --fsdp"
MESH_NPROC_fsdp := $(if $(filter-out 0,$(GPUS)),$(NPROC),4)
MESH_NPROC_context := $(if $(filter-out 0,$(GPUS)),$(NPROC),4)
MESH_NPROC_pipeline := $(if $(filter-out 0,$(GPUS)),$(NPROC),8)
# said on a mesh run's launch line where its processes are not NPROC
MESH_WHY_fsdp := on CPU the dp x tp mesh runs at dp 2 x tp 2
MESH_WHY_pipeline := on CPU the pp x dp x tp mesh runs at pp 2 x dp 2 x tp 2
MESH_WHY_context := on CPU dp 2 x cp 2 and cp 4 run at 4 processes
MESH_NPROC_moe := $(if $(filter-out 0,$(GPUS)),$(NPROC),4)
MESH_WHY_moe := on CPU ep 4 and dp 2 x ep 2 run at 4 processes
MESH_ONLY := 03_fsdp/optimized_fsdp_tp.py 05_pipeline/baseline_pipeline_3d.py \
	05_pipeline/optimized_pipeline_3d.py

# One run of $$script with $$flags under torchrun: its whole output in a log named after the
# run's setup (size, world, link, node), progress and summary lines on the terminal. A failing
# run shows its own error line (`python -m report mark-failed` finds it, and records the run when it
# could not record itself) and fails the target once the others ran. Only node 0 holds rank 0,
# which prints and records; other nodes keep their own logs.
# $$nproc: processes per node, NPROC unless a mesh run sets its own.
WORLD = $$(( nproc * $(NNODES) ))
# common.free_port without importing torch (2 s a run): a port nothing on 127.0.0.1 listens on.
FREE_PORT_OF_HOST := $(PY) -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); \
	print(s.getsockname()[1])'
LOG_SETUP = .$(SIZE)$(if $(MODEL),.$(MODEL)).w$(WORLD)$(if $(LINK),.$(LINK))$(if $(filter-out 1,$(NNODES)),.node$(NODE_RANK))
define launch
log=outputs/logs/$$(basename $$script .py)$$(echo $$flags | tr -d ' ' | tr / _)$(LOG_SETUP).log; \
since=$$(date +%s); \
port=$(if $(FREE_PORT),$$($(FREE_PORT_OF_HOST)),$(MASTER_PORT)); \
echo "== $$script$$flags: $(NNODES) node(s) x $$nproc process(es)$$([ $$nproc = $(NPROC) ] || \
	echo " (NPROC=$(NPROC) -> $$nproc: $(MESH_WHY_$@))"), size $(SIZE)$(if $(MODEL), $(MODEL))$(if $(LINK),$(comma) link $(LINK)) -> $$log"; \
$(SHAPED) $(TORCHRUN) $$script $(SCRIPT_FLAGS) $$flags 2>&1 | tee $$log \
	| { grep --line-buffered -E '^(step |[a-z0-9_]+: |skipped: |one step|rank +[0-9]+ \|)'; true; }; \
code=$${PIPESTATUS[0]}; \
if [ $$code -ne 0 ]; then status=1; \
	echo "FAILED: $$script$$flags: $$($(PY) -m report mark-failed $$script --since $$since \
		--exit-code $$code --log $$log --world-size $(WORLD) \
		$(if $(filter-out 0,$(NODE_RANK)),--no-record) -- $(SCRIPT_FLAGS) $$flags) (log: $$log)"; \
fi
endef

# ARGS are every script's: read by the folder's first script's parser (its first baseline) before
# anything starts, so that a bad flag is its one line (`baseline_zero.py: error: argument
# --steps: ...`), not a failed row a script. `--check-flags` (common.py's): parse, then exit 0.
define check_args
$(if $(strip $(ARGS)),$(PY) \
	$$(ls $$folder/baseline_*.py $$folder/optimized_*.py 2>/dev/null | head -1) \
	$(SCRIPT_FLAGS) --check-flags || exit 2,true)
endef

# The step-time model's rates at the process counts the folders run (NPROC and the mesh runs'),
# measured at SIZE: `make calibrate` measures them all for the three decoders. Before its runs,
# each target takes a quick calibration of its worlds for MODEL (about 15 s a world) unless this
# host has one younger than an hour with this torch (CALIBRATE=0: none): the report prices each
# run at the calibration taken with it, so that a speedup's two steps are priced alike.
CALIBRATED_WORLDS := $(sort $(NPROC) $(foreach t,$(TECHNIQUES),$(MESH_NPROC_$(t))))
calibrate: preflight
	@$(PY) -m report calibrate --size $(SIZE) --worlds $(CALIBRATED_WORLDS)

define quick_calibration
$(if $(filter resnet,$(MODEL))$(filter 0,$(CALIBRATE)),true,$(PY) -m report calibrate --quick \
	--if-older 3600 --size $(SIZE) --models $(or $(MODEL),gpt) --worlds $(1))
endef

calibrated: preflight
	@$(call quick_calibration,$(CALIBRATED_WORLDS))

# One folder: every baseline, then every optimized script, then its extra runs, then its mesh
# runs (on GPUs, the baseline again only where the mesh's world is not NPROC's).
$(TECHNIQUES): %: preflight
	@mkdir -p outputs/logs; status=0; folder=$(filter %_$@,$(FOLDERS)); nproc=$(NPROC); \
	$(check_args); \
	$(call quick_calibration,$(sort $(NPROC) $(MESH_NPROC_$@))) || exit 1; \
	for run in $$(ls $$folder/baseline_*.py $$folder/optimized_*.py | grep -vxF \
			"$$(printf '%s\n' $(MESH_ONLY))") $(EXTRA_RUNS_$@); do \
		script=$${run%% *}; flags=$${run#$$script}; \
		$(launch); \
	done; nproc=$(MESH_NPROC_$@); \
	for run in $(MESH_RUNS_$@); do \
		script=$${run%% *}; flags=$${run#$$script}; \
		if [ $$nproc = $(NPROC) ] && [ -z "$$flags" ] && ! echo " $(MESH_ONLY) " | grep -qF " $$script "; then continue; fi; \
		$(launch); \
	done; exit $$status

# 03_fsdp's FP8 / activation-checkpointing ablation: the folder (optimized_fsdp_fp8 with both),
# then the three other rows, each one flag apart; `make report` shows them as one table.
fsdp-ablation: fsdp
	@status=0; nproc=$(NPROC); script=03_fsdp/optimized_fsdp_fp8.py; \
	for flags in " --no-checkpointing" " --no-fp8" " --no-fp8 --no-checkpointing"; do \
		$(launch); \
	done; exit $$status

# The first command on a new host: every script of every folder and the extra runs, 6 steps at
# `tiny` on what the host has (all its GPUs, or 2 CPU processes), one line each (ok, skipped:
# why, FAILED: its error line), non-zero if any failed. The ranks are forked from one Python
# that imported torch once (37 runs x 2 fresh interpreters would take minutes on 2 cores);
# records and logs go to outputs/smoke/, not into the report. On GPUs a run may take 40 minutes
# before it counts as hung: the compiled runs' first compile on 8 ranks (see COMPILE_TIMEOUT_S).
SMOKE_RUNS = $(foreach f,$(FOLDERS),$(sort $(wildcard $(f)/baseline_*.py)) \
	$(sort $(wildcard $(f)/optimized_*.py)) $(EXTRA_RUNS_$(word 2,$(subst _, ,$(f)))))
smoke: preflight
	@rm -rf outputs/smoke
	@$(PY) -m report smoke --nproc $(NPROC) $(if $(filter-out 0,$(GPUS)),--timeout 2400) --flags "--size tiny $(if $(MODEL),--model $(MODEL)) --steps 2 --warmup 4 --timeout 60" \
		-- $(SMOKE_RUNS)

# A host whose GPUs torch cannot use (a driver older than torch's CUDA build, say) would
# otherwise start one CPU process per GPU, each labelled `cpu`: say so and stop.
NO_CUDA := this host has $(GPUS) GPU(s), but torch {torch.__version__} (CUDA \
	{torch.version.cuda}) cannot use them (a driver older than its CUDA build?): update the \
	driver, or run on CPU with CPU=1
preflight: install
ifneq ($(GPUS),0)
	@$(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit(f'$(NO_CUDA)')"
endif

# make dryrun: each script as rank 0 of each world in DRY_WORLDS on this CPU, under the fake
# process group and fake tensors (--dry-run), then the planner's seed rows at their worlds on the
# published shapes; two at a time, each bounded; the table by python -m report dryrun.
DRY_WORLDS ?= 8 64
DRY_RUNS = $(foreach f,$(FOLDERS),$(sort $(wildcard $(f)/*.py))) '08_moe/optimized_moe_ep.py --fsdp' \
	'07_context/optimized_context_ring.py --fsdp'
DRY_SEED_RUNS = '03_fsdp/optimized_fsdp.py --size llama2-7b --dry-run 8' \
	'04_zero/optimized_zero3_offload.py --size llama2-7b --dry-run 8' \
	'03_fsdp/optimized_fsdp_tp.py --size llama2-70b --dry-run 64 --tp 8' \
	'05_pipeline/optimized_pipeline_1f1b.py --size qwen3-30b-a3b --dry-run 16' \
	'03_fsdp/optimized_fsdp_lora.py --size llama2-7b --dry-run 2'
dryrun: install
	@mkdir -p outputs/logs; rm -f outputs/dryrun.jsonl; \
	{ for world in $(DRY_WORLDS); do for run in $(DRY_RUNS); do \
		echo "$$run --size $(SIZE) --dry-run $$world"; done; done; \
	for run in $(DRY_SEED_RUNS); do echo "$$run"; done; } | \
	xargs -P 2 -I RUN sh -c 'log=outputs/logs/dryrun-$$(echo "RUN" | tr -c "a-z0-9\n" -).log; \
		timeout 600 $(PY) RUN > $$log 2>&1; tail -1 $$log | cut -c1-200'
	@$(PY) -m report dryrun

report: install
	@$(PY) -m report

traces: install
	@$(PY) -m report traces

plan: install
	@$(PY) -m report plan $(ARGS)

list: install
	@$(PY) -m report list

# The suite is the CPU suite: GPUs hidden from it and from every process it launches.
test: install
	$(PY) -m ruff check .
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest

# A script repeats another's function on purpose, marked `# Copied from <script>: <name>`:
# tests/test_copies.py holds each copy to its source, and rewrites them when run (a copy marked
# `, changed: <what>` it holds to its pinned diff instead, and leaves as it is).
fix-copies: install
	$(PY) tests/test_copies.py

clean:
	rm -rf outputs .pytest_cache .ruff_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf .venv
