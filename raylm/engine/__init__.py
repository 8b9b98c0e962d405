"""The engine: the LLM (offline) and AsyncLLM (online) front ends with LLMEngine,
request intake (input_processor) and output assembly (output_processor,
detokenizer), the engine core's step loop (engine_core) and its process
(core_proc), the wire protocol between them (protocol) and the engine's errors.

The supervisor of engine cores (supervisor.py, core_recovery.py) is the front
ends' one client of their cores, whatever runs them: one local process, N of
them (process_launcher) or N data-parallel replicas on Ray (ray_launcher,
dp_manager). It keeps the ledger of in-flight requests, routes new ones
(routing), recovers from a core's death or hang within a restart budget
(restart_budget, with raylm.core.quarantine), scales (autoscaler), restarts a
replica without losing a request (replica_restart), and drives live migration
of a running request with its KV cache to another core (migration.py; the
cores' side is core_migration.py, the K/V's way raylm.kv_transfer).
"""
