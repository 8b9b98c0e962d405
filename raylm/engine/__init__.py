"""The engine: LLM (offline) and AsyncLLM (online) front ends, request intake and
output assembly, the engine core's step loop and its process, the wire protocol
and errors, and the supervisor of engine cores (a local process, or data-parallel
replicas on Ray): the ledger of in-flight requests, routing, recovery, scaling."""
