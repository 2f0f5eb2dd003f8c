"""Code the tests run in other processes: spawn targets and scripts.

Spawn targets are imported by the child by module path (``workers.<module>``: tests/ is on
the child's sys.path, inherited from the parent), so these modules import no pytest and
nothing from the test modules. Scripts (corruption_worker, pidns_child) are run by path with
this interpreter.

* soak_worker: WorkerView traffic on a shared segment until killed (test_soak.py);
* remote_worker, remote_stats_worker: engine processes of the remote tier's hosts;
* vllm_engine_child: a real vLLM engine, a model writer, engines opening a segment at once;
* faulty_connector: a HostKVConnector whose copies fail at random on one rank, which vLLM
  loads in a real engine's processes (test_vllm_faults.py);
* corruption_worker: corrupts segments and uses them (a script, test_corruption.py);
* pidns_child: a process in a new PID namespace (a script, test_pid_namespace.py).
"""
