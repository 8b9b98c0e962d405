"""How calls reach the workers: the Executor contract, its factory and backends
(in-process, multiprocess, Ray: cluster, placement, worker actor, step transports)."""
