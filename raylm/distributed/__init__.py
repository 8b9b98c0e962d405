"""Process groups of the PP x CP x TP mesh (parallel_state), the collectives
the model layers call (a no-op at world size 1; shared memory between ranks
of a CPU node, shm_collective), the broadcast queue that carries each step to
the ranks (shm_broadcast over a shared-memory ring, shm_ring and doorbell,
and ZMQ for big payloads and other nodes, mq_sockets), its typed msgpack
codec and call envelopes (message_codec, rpc_messages), and CURVE
authentication for its TCP sockets (tcp_auth). K/V moving between engines is
raylm.kv_transfer's.
"""
