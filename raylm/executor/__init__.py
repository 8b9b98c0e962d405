"""How calls reach the workers: the Executor contract (abstract) and its errors,
the factory that picks a backend, and the backends: in-process
(uniproc_executor), one process per rank on this machine (multiproc_executor,
over mq_rpc's message-queue calls), and Ray (ray_executor: the cluster in
ray_cluster, actor placement shared with `raylm plan` in ray_placement, the
rank's actor in ray_worker, and the step transports of ray_transport: `mq` or
a Ray Compiled Graph, `cgraph`).
"""
