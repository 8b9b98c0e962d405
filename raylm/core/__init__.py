"""The scheduler's world: requests, the paged KV-cache block manager with
prefix caching (and the block events the supervisor's prefix index follows),
the requests and queues the scheduler keeps (request_queues), and the
continuous-batching scheduler (with decode bursts, decode_burst), plus what
the core reports per step (outputs), structured outputs' grammars
(structured_output, json_grammar) and the quarantine of requests that keep
killing cores (quarantine).
"""
