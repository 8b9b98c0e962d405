"""How calls reach the workers: the Executor contract and its backends
(in-process, multiprocess over shared memory, Ray actors)."""
