"""Helpers the tests import: segment snapshots, crash loops, servers, models, fixtures.

tests/ is on sys.path (tests/ is not a package, so pytest's default import mode puts the
directory of its conftest.py and test modules there; spawned children inherit the parent's
sys.path), so these are imported as ``lib.<module>``, as conftest's helpers are as
``conftest``:

* crashlib: crash a mutation at every logged store, in forked children, and compare states;
* rawseg: a segment's bytes through a plain mmap, behind hostkv's back;
* reference_model: the pure-Python twin of the radix tree (also the benchmarks' baseline);
* worker_view_lib: the WorkerView tests' pool, ``make`` fixture and exact-rollback snapshots;
* redislib, remotelib: real redis-server processes, and two-"host" set-ups of the remote tier;
* vllm_engine: real vLLM engines in spawned children, driven over a pipe;
* vllm_helpers: hostkv.vllm imported quietly, random prompts, vLLM requests and blocks.

Code that runs in another process lives in tests/workers/ instead.
"""
