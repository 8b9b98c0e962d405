"""What runs on each model rank: the Worker (device, distributed init, KV cache,
the rank's side of K/V transfers through raylm.kv_transfer.rank), its
ModelRunner (batch preparation in input_batch and, under context parallelism,
cp_input; the forward; prompt logprobs) and the Sampler with its per-step
sampling_metadata. memory_profiling sizes the KV cache on a GPU by measuring
a step; cpu_placement decides which CPU cores each rank runs on and with how
many threads (from the machine's cpu_topology), and thread_governance governs
a single rank's threads at run time (the Linux accounting it reads is
raylm.thread_accounting); fault_injection is the tests' hook into the failure
model.
"""
