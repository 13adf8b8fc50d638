# tfdist: set-up, demo, tests, benchmarks. Every target does the whole set-up from a fresh clone.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXTRAS := $(VENV)/.installed-extras
HOROVOD := $(VENV)/.horovod-installed

.PHONY: setup horovod demo lint test test-fast bench bench-peer bench-sample bench-scaling bench-scaling-ps bench-scaling-horovod \
        bench-allreduce bench-links bench-dp-quality bench-overlap bench-pipeline bench-model-parallel bench-mesh bench-zero bench-zero-cap bench-disk bench-offload bench-offload-xl bench-accumulation bench-backup bench-elastic bench-data test-long chaos chaos-write \
        chaos-ps chaos-horovod chaos-islands chaos-zero chaos-offload chaos-preempt chaos-partition chaos-elastic chaos-ray chaos-spares \
        bench-node-loss bench-warm bench-auto bench-probe plan-validate plan-measured clean cluster-tools

# Set-up by purpose: `make setup` (and `make demo`) installs tfdist and its runtime dependencies
# only; the tests, the benchmarks and the chaos trials add every extra (setup.cfg: test, horovod's
# runtime, ray, hf = torch and transformers, keras_hub), and `make horovod` builds Horovod.
setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e .
	touch $(STAMP)

# keras-hub with --no-deps: its metadata asks for tensorflow-text (see setup.cfg).
$(EXTRAS): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test,horovod,ray,hf]'
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps $$($(BIN)/python -c \
	  "import configparser; p = configparser.ConfigParser(); p.read('setup.cfg'); \
	  print(p['options.extras_require']['keras_hub'])")
	touch $(EXTRAS)

# Horovod 0.28.1, patched for TF 2.21 and built once per machine (cached in ~/.cache/tfdist).
horovod: $(HOROVOD)

# After cluster-tools (order only), so that Horovod is built with MPI where Open MPI was installed.
$(HOROVOD): $(EXTRAS) tools/horovod/build.sh tools/horovod/horovod-0.28.1-tf2.21.patch | cluster-tools
	tools/horovod/build.sh $(BIN)
	touch $(HOROVOD)

# What the cluster tests need beyond Python: iptables (tools/cluster/netcluster.py), Debian's Slurm and
# munge (tools/cluster/slurm_local.py), and Open MPI (Horovod over MPI), as root. Where they cannot be installed (not root, no package
# repository) those tests are skipped and say why.
CLUSTER_PACKAGES := iptables slurm-wlm munge openmpi-bin libopenmpi-dev
cluster-tools:
	@missing=""; for c in iptables slurmctld slurmd munged mpirun mpicc; do command -v $$c >/dev/null || missing=1; done; \
	[ -z "$$missing" ] || { [ "$$(id -u)" = 0 ] && \
	  (apt-get install -y -q $(CLUSTER_PACKAGES) >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $(CLUSTER_PACKAGES) >/dev/null 2>&1)); } || \
	  echo "cluster-tools: $(CLUSTER_PACKAGES) could not be installed; those tests will be skipped"

# The main job: train the demo GPT on the default corpus (this Python's standard library), then sample.
demo: $(STAMP)
	$(BIN)/tfdist train --config=configs/gpt_demo.py --workdir=runs/demo --overwrite
	$(BIN)/tfdist sample --model=runs/demo/model.keras --prompt='def ' --max_new_tokens=300

# Three pytest processes (pytest-xdist) on 2 cores, each test file whole in one of them (its module
# fixtures, such as an uninterrupted reference run, made once): many tests wait on their processes
# (restarts, partitions, heartbeats) and would leave a core idle. Measured from fresh clones
# (docs/testing.md, Suite time): 1308 s of pytest with 2, 1185 s with 3 (the CPU 97 % busy).
PYTEST_PROCS := -n 3 --dist loadfile

# The machine's fp32 matmul rate before and after (tools/bench/matmul_peak.py): a slow day shows.
# ruff first (pyproject.toml: its rule sets, lines of at most 100 characters): a finding fails the
# target before any test runs.
lint: $(EXTRAS)
	$(BIN)/ruff check .

test: $(EXTRAS) $(HOROVOD) cluster-tools lint
	@$(BIN)/python tools/bench/matmul_peak.py --when=before
	@start=$$(date +%s); $(BIN)/python -m pytest -q -ra --durations=25 $(PYTEST_PROCS) -m 'not long'; \
	  status=$$?; echo "make test: pytest took $$(( $$(date +%s) - start )) s"; \
	  $(BIN)/python tools/bench/matmul_peak.py --when=after; exit $$status

# The trials `make test` leaves out for time (tests marked long).
test-long: $(EXTRAS) $(HOROVOD) cluster-tools
	$(BIN)/python -m pytest -q -ra $(PYTEST_PROCS) -m long

# Under 3 minutes from a fresh clone (pip's wheel cache warm): no Horovod build, no training in
# subprocesses, one case of each family of CLI error cases (tests/helpers.py first_fast). Its
# tests compute in the pytest process: one pytest process per core (3 min 38 s in one, here).
test-fast: $(EXTRAS) lint
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadfile -m 'not slow and not horovod'

bench: $(EXTRAS)
	$(BIN)/python tools/bench/step.py

# tfdist against a plain PyTorch GPT of the same shape and plain Keras fit, fp32 and bf16,
# interleaved in one run (tools/bench/peer.py). torch lives in its own environment (setup.cfg's
# `peer` extra, installed alone: tfdist does not depend on it).
PEER := .venv-peer
$(PEER)/.installed: setup.cfg
	test -x $(PEER)/bin/python || $(PYTHON) -m venv $(PEER)
	$(PEER)/bin/pip install --quiet --disable-pip-version-check $$($(PYTHON) -c "import configparser; \
	  p = configparser.ConfigParser(); p.read('setup.cfg'); print(p['options.extras_require']['peer'])")
	$(PEER)/bin/python tools/bench/torch_gpt.py --check
	touch $@

# Sampling tokens/s: tfdist's KV-cache generate against transformers' generate on the same
# weights (tools/bench/sample.py); writes bench_results/sample.json.
bench-sample: $(EXTRAS)
	$(BIN)/python tools/bench/sample.py

bench-peer: $(EXTRAS) $(PEER)/.installed
	$(BIN)/python tools/bench/peer.py

# 2 workers x 1 thread vs 1 process x 1 thread, gpt_mini, same batch per worker.
bench-scaling: $(EXTRAS)
	$(BIN)/python tools/bench/scaling.py

# parameter server: 2 workers + 1 ps vs 1 worker + 1 ps, 1 thread each, gpt_mini.
bench-scaling-ps: $(EXTRAS)
	$(BIN)/python tools/bench/scaling.py --ps

# The data path: peak RSS against corpus size (a generated 2.6 G-token store, ~5 GB in /tmp) under
# single / MWMS / parameter server; input cost in the step; byte vs BPE-8192 on gpt_mini.
bench-data: $(EXTRAS)
	$(BIN)/python tools/bench/data.py --memory --input --tokenizers

# 5 trials: SIGKILL a worker of a 2-worker run at a random step; the launcher restarts, the run
# must end with the exact steps and bitwise the weights of an uninterrupted run.
chaos: $(EXTRAS)
	$(BIN)/python tools/faults/chaos.py

clean:
	rm -rf $(VENV) $(PEER) runs build *.egg-info

# 5 trials: SIGKILL a parameter-server worker at a random time; it must be restarted alone and the
# run must count exactly the planned steps.
chaos-ps: $(EXTRAS)
	$(BIN)/python tools/faults/chaos.py --strategy=parameter_server

# 5 trials: SIGKILL a Horovod rank at a random step; tfdist launch restarts horovodrun, the run must
# end with the exact steps and bitwise the weights of an uninterrupted run.
chaos-horovod: $(HOROVOD)
	$(BIN)/python tools/faults/chaos.py --strategy=horovod

# ZeRO-1 under Horovod, then under multi_worker_mirrored: SIGKILL a replica at a random step, 5
# trials each; each resumes from every replica's optimizer shard and must end bitwise equal to an
# uninterrupted ZeRO run.
# 5 trials: SIGKILL one island's worker between two syncs; the other island goes on, the killed
# one restarts from its backup and rejoins (tools/faults/chaos_islands.py).
chaos-islands: $(EXTRAS)
	$(BIN)/python tools/faults/chaos_islands.py

chaos-zero: $(HOROVOD)
	$(BIN)/python tools/faults/chaos.py --strategy=horovod --zero=1
	$(BIN)/python tools/faults/chaos.py --zero=1
	$(BIN)/python tools/faults/chaos.py --strategy=horovod --zero=3
	$(BIN)/python tools/faults/chaos.py --zero=3

# ZeRO-3 with disk offload over 2 Horovod ranks: SIGKILL inside an offloaded optimizer step, its
# store's files half written, 5 trials; each resumes from its newest backup, bitwise.
chaos-offload: $(HOROVOD)
	$(BIN)/python tools/faults/chaos.py --strategy=horovod --zero=3 --offload=disk \
		--fault=kill_in_offload

# Asynchronous backups: the chief SIGKILLed while a background write is in flight (seen from its
# files), 5 trials under MWMS and under Horovod: resumed from the backup before, bitwise equal.
chaos-write: $(HOROVOD)
	$(BIN)/python tools/faults/chaos.py --fault=kill_in_write
	$(BIN)/python tools/faults/chaos.py --fault=kill_in_write --strategy=horovod

# Synchronous against asynchronous backups: the time a save blocks training, and the step-time
# overhead of a backup every 10 steps (gpt_mini and gpt2 124M; 1 process, 2 with ZeRO-1).
bench-backup: $(HOROVOD)
	$(BIN)/python tools/bench/backup.py

# What a resize of an elastic job costs (gpt_mini, 2 -> 1 -> 2 workers, with ZeRO-1 and without):
# progress lost and time to resume.
bench-elastic: $(EXTRAS)
	$(BIN)/python tools/bench/elastic.py

# What a lost host costs: seconds to the first step after it and steps trained twice, with a spare,
# without (shrink), with cold workers; 5 rounds, MWMS then Horovod (root). The grow-back bench of
# Ray against tfdist's elastic path: node_loss.py --variants=ray,elastic.
bench-node-loss: $(HOROVOD) cluster-tools
	$(BIN)/python tools/bench/node_loss.py --strategy=multi_worker_mirrored
	$(BIN)/python tools/bench/node_loss.py --strategy=horovod

# Warm workers against cold: tfdist launch to the first step, and a restart to the first step after
# it, 2 workers of gpt_nano, MWMS then Horovod, 3 interleaved rounds (bench_results/warm-start.json).
bench-warm: $(HOROVOD)
	$(BIN)/python tools/bench/warm_start.py

# Hosts lost under --spares, 5 trials each (root): the spare's host killed while it waits; a shard's
# owner and its peer copy's host killed together (ZeRO-3: the disk backup); a kill while the state
# is sent to the spare.
chaos-spares: $(HOROVOD) cluster-tools
	$(BIN)/python tools/faults/chaos_spares.py --fault=spare_lost
	$(BIN)/python tools/faults/chaos_spares.py --fault=owner_and_peer
	$(BIN)/python tools/faults/chaos_spares.py --fault=during_transfer

# Horovod: 2 ranks x 1 thread vs 1 process x 1 thread, gpt_mini; then with fp16 gradients.
# On shaped links between tools/cluster/netcluster.py's hosts (root), at 10, 1 and 0.1 Gbit/s: allreduce bus
# bandwidth and the 2-process scaling of gpt_mini (MWMS, Horovod +- fp16, parameter server), each
# beside the planner's prediction. One round each (about 40 minutes in all). Then a straggler: the
# second worker's host at 100 Mbit/s, the others at 1 Gbit/s (MWMS and the parameter server).
LINKS := 10gbit 1gbit 100mbit
# Then 2 hosts x 2 workers (tools/bench/links.py): the bytes each host's link carries a step,
# counted at the link, for the flat ring (workers in host order and interleaved) and dp.hierarchy.
DP_LINKS := 1gbit 100mbit
# gpt_mini on 2 and 4 workers: the validation loss of PowerSGD rank 4 and of 2 islands (H = 50)
# against synchronous data parallelism, the same tokens (tools/bench/dp_quality.py).
bench-dp-quality: $(EXTRAS)
	$(BIN)/python tools/bench/dp_quality.py

bench-links: $(HOROVOD) cluster-tools
	for link in $(LINKS); do \
	  $(BIN)/python tools/bench/allreduce.py --link=$$link --rounds=1 --iters=5 && \
	  $(BIN)/python tools/bench/scaling.py --link=$$link --rounds=1 && \
	  $(BIN)/python tools/bench/scaling.py --horovod --link=$$link --rounds=1 && \
	  $(BIN)/python tools/bench/scaling.py --horovod --compression=fp16 --link=$$link --rounds=1 && \
	  $(BIN)/python tools/bench/scaling.py --ps --link=$$link --rounds=1 || exit 1; \
	done
	$(BIN)/python tools/bench/scaling.py --link=1gbit --straggler=100mbit --rounds=1
	$(BIN)/python tools/bench/scaling.py --ps --link=1gbit --straggler=100mbit --rounds=1
	for link in $(DP_LINKS); do \
	  $(BIN)/python tools/bench/links.py --link=$$link --steps=4 && \
	  $(BIN)/python tools/bench/links.py --horovod --link=$$link --steps=4 || exit 1; \
	done

# The gradient all-reduce overlapped with the backward pass, or not, and bucket sizes 1-100 MiB:
# 2-process efficiency of gpt_mini under multi_worker_mirrored and horovod, interleaved rounds on
# loopback; then overlapped against not on the test cluster's 10 and 1 Gbit/s links (root). Each
# writes bench_results/overlap[-<link>].json and a trace of one step of each strategy.
bench-overlap: $(HOROVOD) cluster-tools
	$(BIN)/python tools/bench/overlap.py --rounds=2
	for link in 10gbit 1gbit; do \
	  $(BIN)/python tools/bench/overlap.py --link=$$link --buckets=25 --rounds=1 || exit 1; \
	done

bench-scaling-horovod: $(HOROVOD)
	$(BIN)/python tools/bench/scaling.py --horovod
	$(BIN)/python tools/bench/scaling.py --horovod --compression=fp16

# GPipe: the GPT in 2 stages on 2 logical CPU devices, M = 1..16 microbatches, vs unsplit.
bench-pipeline: $(EXTRAS)
	$(BIN)/python tools/bench/pipeline.py

# 1F1B vs GPipe peak memory (M = 4..32), t = 2 tensor-parallel speed on gpt_mini, and the
# activation bytes per shard with and without sequence parallelism.
bench-model-parallel: $(EXTRAS)
	$(BIN)/python tools/bench/model_parallel.py --schedules --tensor --sequence

# Keras's ModelParallel on TF (tfdist.parallel.mesh): keras-hub's Llama on a (1, 2) mesh against
# one device and ZeRO-3 on 2 replicas: time, memory, bytes sent against the Megatron count.
bench-mesh: $(HOROVOD)
	$(BIN)/python tools/bench/mesh.py --rounds=2

# --config.layout=auto against every layout the planner calls runnable and fitting, 1 and 2
# Horovod ranks: gpt_nano, gpt_mini and GPT-2 124M (about 40 minutes), then GPT-2 XL under a
# 20 GiB cap (about 2 hours). bench_results/auto.json; its small models' rows fit the framework's
# own time (tfdist/plan/overheads.py).
# The step probe of `tfdist train --probe` against 3 runs of 45 steps (bench_results/probe.json).
bench-probe: $(EXTRAS)
	$(BIN)/python tools/bench/probe.py

bench-auto: $(HOROVOD)
	$(BIN)/python tools/bench/auto.py --models=gpt_nano,gpt_mini,gpt2
	$(BIN)/python tools/bench/auto.py --models=gpt2_xl

# ZeRO-1/2/3 against plain data parallel, 2 Horovod ranks then 2 MWMS workers of gpt_mini: time,
# memory, bytes sent.
bench-zero: $(HOROVOD)
	$(BIN)/python tools/bench/zero.py
	$(BIN)/python tools/bench/zero.py --strategy=multi_worker_mirrored

# Gradient accumulation's cost under multi_worker_mirrored: 4 batches per update against one batch
# 4 times larger, per token, interleaved (bench_results/accumulation-mwms.json).
bench-accumulation: $(EXTRAS)
	$(BIN)/python tools/bench/accumulation.py

# A model that trains only sharded: each of 2 Horovod ranks capped at 1600 MiB (a memory cgroup;
# root), a 57 M-parameter GPT: which ZeRO stages train.
bench-zero-cap: $(HOROVOD)
	$(BIN)/python tools/bench/zero.py --model=wide --cap_mib=1600 --batch=1 --steps=3

# ZeRO-Offload's prices here: the disk through the offload store, the CPU AdamW's rate
# (bench_results/disk.json, read by tfdist plan).
bench-disk: $(EXTRAS)
	$(BIN)/python tools/bench/disk.py

# gpt_mini, ZeRO-3: disk offload against resident, and with prefetch off (bench_results/offload.json).
bench-offload: $(HOROVOD)
	$(BIN)/python tools/bench/offload.py --what=overhead

# GPT-2 XL (1.56 B) trains 5 steps with disk offload in a 20 GiB memory cgroup (root; ~30 min),
# and is killed for memory without it (bench_results/offload-xl.json).
bench-offload-xl: $(HOROVOD)
	$(BIN)/python tools/bench/offload.py --what=xl

# allreduce bus bandwidth, 1-64 MiB: Horovod/Gloo (and fp16) vs TF's collective ring, 2 processes.
bench-allreduce: $(HOROVOD)
	$(BIN)/python tools/bench/allreduce.py

# tfdist plan against the published runs (ZeRO Fig. 1, Megatron-LM 175B/1T, LLaMA-2 70B) and
# against this machine's own benchmarks (run the bench-* targets first).
plan-validate: $(EXTRAS)
	$(BIN)/tfdist plan --validate

plan-measured: $(EXTRAS)
	$(BIN)/tfdist plan --measured --config=configs/gpt_mini.py

# Preemption, 5 trials per strategy: SIGTERM to one process while a random step runs (parameter
# server: to the launcher); every process backs up that step and exits 75, the run is started again
# and must end with the exact steps (and, synchronous, bitwise the weights of an uninterrupted run).
chaos-preempt: $(HOROVOD)
	$(BIN)/python tools/faults/chaos.py --fault=sigterm --strategy=single
	$(BIN)/python tools/faults/chaos.py --fault=sigterm --strategy=multi_worker_mirrored
	$(BIN)/python tools/faults/chaos.py --fault=sigterm --strategy=horovod
	$(BIN)/python tools/faults/chaos.py --fault=sigterm --strategy=parameter_server

# Partitions across 2 hosts (network namespaces; root): 3 trials of 10 s and 3 of 60 s per
# synchronous strategy. The run must move on within 120 s of the heal, log every step once and end
# bitwise equal to an uninterrupted run. The parameter server (4 hosts): every step counted once,
# the reachable worker trains on during a 60 s cut, the cut-off one again after the heal.
chaos-partition: $(HOROVOD) cluster-tools
	$(BIN)/python tools/faults/chaos_partition.py --strategy=multi_worker_mirrored
	$(BIN)/python tools/faults/chaos_partition.py --strategy=horovod
	$(BIN)/python tools/faults/chaos_partition.py --strategy=parameter_server

# Elastic: a host killed and cut off for good mid-run (the job goes on at 1), then a new host
# offered (it grows back to 2); 5 trials per strategy, 3 network-namespace hosts (root).
chaos-elastic: $(HOROVOD) cluster-tools
	$(BIN)/python tools/faults/chaos_elastic.py --strategy=multi_worker_mirrored --trials=5
	$(BIN)/python tools/faults/chaos_elastic.py --strategy=horovod --trials=5

# A 3-node Ray cluster in network namespaces: a node lost, the group restarted, grown back (root).
chaos-ray: $(HOROVOD) cluster-tools
	$(BIN)/python tools/faults/chaos_ray.py --strategy=multi_worker_mirrored --trials=5
	$(BIN)/python tools/faults/chaos_ray.py --strategy=horovod --trials=5
